"""How the remote tier sends large values: straight from their buffers, through redis-py's own packer."""

from __future__ import annotations

from typing import Any

# Values past this many bytes are sent as their own piece, not copied into the command (redis-py's own cutoff).
LARGE_VALUE_BYTES = 6000


def _encode(value: Any) -> Any:
    """Command arguments as bytes, as redis-py's own encoder does for the types this tier sends."""
    if isinstance(value, bytes | memoryview):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int | float) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"cannot send a {type(value).__name__} to the remote tier")


_CONNECTION_CLASS: Any = None


def zero_copy_connection() -> Any:
    """A redis-py connection that sends large values straight from their buffers.

    With hiredis installed, redis-py packs every command into one new bytes object: a copy of
    each value into freshly allocated memory, about as costly as the socket write at these
    sizes. Its pure-Python packer (a public connection option) sends any value past 6,000
    bytes as its own piece, without copying it. Replies are still parsed by hiredis.
    """
    global _CONNECTION_CLASS  # noqa: PLW0603 - built once, on first use, so redis is imported lazily
    if _CONNECTION_CLASS is None:
        import redis
        from redis.connection import PythonRespSerializer

        class ZeroCopyConnection(redis.Connection):
            def __init__(self, **kwargs: Any) -> None:
                kwargs.setdefault("command_packer", PythonRespSerializer(LARGE_VALUE_BYTES, _encode))
                super().__init__(**kwargs)  # type: ignore[no-untyped-call]

        _CONNECTION_CLASS = ZeroCopyConnection
    return _CONNECTION_CLASS
