"""What every tier below RAM offers: batched, blocking writes, reads, existence checks and stats.

The server calls a tier from background threads only, never from its event loop: a
`WriteBehind` worker writes, the read-through thread reads. Every method takes a batch and
costs one round trip (remote) or one pass over the files (disk). A tier never raises for a
failed object: a write that could not be made returns False, a read that could not be served
(absent, corrupt, late, tier down) returns False, and the tier counts why in `stats()`.

Objects are named by `object_name(salt, key)`: the hex of `kvdepot.core.slot_digest`, so a
salt can only ever find its own chunks, wherever the object lives.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from kvdepot.core import slot_digest
from kvdepot.server._errors import TierConfigError
from kvdepot.server._tier_format import MAX_FINGERPRINT_BYTES, Buffer


def object_name(salt: str, key: bytes) -> str:
    """The name of chunk ``key`` of ``salt`` in every tier below RAM (64 hex digits)."""
    return slot_digest(salt, key).hex()


#: Bytes of a salt's tag: the disk tier puts it in front of the caller's fingerprint in each
#: header, and the remote tier names each salt's accounting keys by it.
SALT_TAG_BYTES = 16
_TAG_PERSON = b"kvdepot-dsalt-v1"


def salt_tag(salt: str) -> bytes:
    """A short digest of ``salt``, by which a tier counts each salt's bytes without keeping the salt.

    The disk tier keeps it in each file's header so that a restarted tier can count each salt's
    bytes again (the file's name mixes the salt in, but cannot be read back)."""
    raw = salt.encode()
    prefixed = len(raw).to_bytes(4, "little") + raw
    return hashlib.blake2b(prefixed, digest_size=SALT_TAG_BYTES, person=_TAG_PERSON).digest()


@attrs.frozen
class ChunkRef:
    """A chunk asked of a tier: which one, with which fingerprint, and how many bytes it has."""

    salt: str
    key: bytes
    fingerprint: bytes = b""
    length: int = 0
    #: Its name's digest (`slot_digest`), computed once: every tier asks for it.
    digest: bytes = attrs.field(init=False, eq=False, repr=False)

    @digest.default
    def _digest(self) -> bytes:
        return slot_digest(self.salt, self.key)


@attrs.frozen
class ChunkWrite:
    """A chunk to write: its name, fingerprint and bytes.

    ``payload`` is the bytes (or a view that stays valid until the write is done).
    """

    salt: str
    key: bytes
    payload: Buffer
    fingerprint: bytes = b""

    @property
    def digest(self) -> bytes:
        return slot_digest(self.salt, self.key)

    @property
    def length(self) -> int:
        return memoryview(self.payload).nbytes


class TierState(enum.Enum):
    UP = "up"
    DOWN = "down"


@attrs.frozen
class TierStats:
    """One tier's figures, for `kvdepot stats` and the metrics.

    ``capacity`` and ``used_bytes`` are None where the tier cannot know them cheaply.
    ``misses`` counts chunks asked for and not served for any reason; ``corrupt``, ``late``
    and ``skipped`` (asked while the tier was down) say why some of them were not.
    ``unknown_format`` counts objects of a format this build does not read (`_tier_format`),
    missed and left in place: on the disk, the files found at start, and on the remote, the
    objects read (a rolling upgrade's other build wrote them).
    """

    kind: str
    state: TierState
    capacity: int | None
    used_bytes: int | None
    objects: int | None
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    writes: int
    failed_writes: int
    errors: int
    corrupt: int
    late: int
    skipped: int
    outages: int
    unknown_format: int = 0


class Tier(Protocol):
    """A tier below RAM. Every method blocks and is safe to call from several threads."""

    kind: str
    #: Whether `lengths` answers from memory without waiting on a device or a peer (the disk's
    #: index): a Query then asks it on the server's loop, without a hand-off to the reader.
    probes_in_memory: bool

    @property
    def state(self) -> TierState:
        """UP while the tier is worth asking; DOWN while its calls would only fail (the remote
        tier between a lost connection and the next probe that finds it back)."""
        ...

    def write(self, items: Sequence[ChunkWrite]) -> list[bool]:
        """Write the chunks (one batch); True where a chunk is now in the tier."""
        ...

    def read(self, refs: Sequence[ChunkRef], into: Sequence[memoryview], *, timeout: float | None = None) -> list[bool]:
        """Fill ``into[i]`` (exactly ``refs[i].length`` writable bytes) with each chunk found intact.

        True where ``into[i]`` now holds the chunk; where False its bytes are undefined (a
        corrupt object may have been read into it). Returns within about ``timeout`` seconds
        (the tier's own deadline when None); chunks not in by then are misses.
        """
        ...

    def lengths(self, refs: Sequence[ChunkRef], *, timeout: float | None = None) -> list[int | None]:
        """The payload bytes each chunk probably has in the tier, None where it is not there
        (not verified; a read may still miss), or not known within about ``timeout`` seconds.
        ``refs[i].length`` is not looked at: a chunk's name fixes its bytes, so what the tier
        holds under it is the length to read it with."""
        ...

    def stats(self) -> TierStats:
        """The tier's figures now."""
        ...

    def clear(self, salt: str | None = None) -> int:
        """Delete every chunk of ``salt`` the tier holds (None: every chunk, of every salt), as
        found by the salt tag in each object's header, whichever server wrote it; how many went.
        Raises `TierError` when the tier could not be cleared (e.g. it is down)."""
        ...

    def close(self) -> None:
        """Let go of files, connections and threads; later calls miss or fail."""
        ...


def check_batch(refs: Sequence[ChunkRef], into: Sequence[memoryview]) -> None:
    """Raise `TierConfigError` unless each buffer of ``into`` is writable and the size its ref says."""
    if len(refs) != len(into):
        raise TierConfigError(f"{len(refs)} refs but {len(into)} buffers", refs=len(refs), buffers=len(into))
    for ref, buf in zip(refs, into, strict=True):
        if buf.readonly or buf.nbytes != ref.length:
            raise TierConfigError(
                f"a read buffer must be writable with exactly {ref.length} bytes, got {buf.nbytes}"
                + (" (read-only)" if buf.readonly else ""),
                expected=ref.length,
                got=buf.nbytes,
            )
        if len(ref.fingerprint) > MAX_FINGERPRINT_BYTES:
            raise TierConfigError(f"a fingerprint has at most {MAX_FINGERPRINT_BYTES} bytes", got=len(ref.fingerprint))


class Counters:
    """The counters behind `TierStats`, safe to bump from several threads."""

    NAMES = (
        "hits",
        "misses",
        "bytes_read",
        "bytes_written",
        "writes",
        "failed_writes",
        "errors",
        "corrupt",
        "late",
        "skipped",
        "outages",
        "unknown_format",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def __getitem__(self, name: str) -> int:
        return self._values[name]


# Seconds between two warnings of one kind from one tier: one line per burst of failures.
WARN_INTERVAL = 60.0


class WarnLimiter:
    """Logs a warning at most once per `WARN_INTERVAL` seconds per event name, with how many were held back."""

    def __init__(self, logger: Any, interval: float = WARN_INTERVAL) -> None:
        self._log = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(event)
            if last is not None and now - last < self._interval:
                self._held[event] = self._held.get(event, 0) + 1
                return
            self._last[event] = now
            held = self._held.pop(event, 0)
        self._log.warning(event, suppressed=held, **fields)
