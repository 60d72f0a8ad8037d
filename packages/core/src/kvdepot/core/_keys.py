"""Chunk keys: a namespaced, chained SHA-256 over full chunks of token ids.

``key_0 = SHA256(seed || le32(tokens of chunk 0))`` and
``key_i = SHA256(key_{i-1} || le32(tokens of chunk i))``, where ``seed`` is the
SHA-256 of the canonical encoding of a :class:`Namespace`. Token ids are packed as
little-endian unsigned 32-bit integers, so keys are the same on every machine,
process and Python version. ``docs/core.md`` publishes golden vectors.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

import attrs

from kvdepot.core._errors import InvalidArgumentError

#: Tokens per chunk unless a deployment says otherwise; a multiple of every
#: common engine block size (16, 32, 64, 128, 256).
DEFAULT_CHUNK_SIZE = 256

#: Length of every chunk key in bytes (SHA-256).
KEY_SIZE = 32

_NAMESPACE_TAG = b"kvdepot/namespace/v1"
_MAX_TOKEN_ID = 2**32 - 1
_BIG_ENDIAN = sys.byteorder == "big"


def _field(tag: bytes, value: bytes) -> bytes:
    # tag, then a 4-byte little-endian length, then the value: unambiguous
    # whatever bytes the value holds.
    return tag + struct.pack("<I", len(value)) + value


def _check_non_negative(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            f"{attribute.name} must be a non-negative int, got {value!r}",
            field=attribute.name,
            got=value,
        )


def _to_digests(value: Sequence[bytes]) -> tuple[bytes, ...]:
    out = tuple(value)
    for item in out:
        if not isinstance(item, bytes):
            raise InvalidArgumentError(
                f"extra digests must be bytes, got {type(item).__name__}",
                field="extra",
                got=type(item).__name__,
            )
    return out


@attrs.frozen
class Namespace:
    """Everything the KV bytes of a chunk depend on besides its token ids.

    Two requests share chunks only when every field is equal. ``extra`` holds
    digests of inputs that token ids do not capture (multimodal inputs, prompt
    embeddings); order matters. ``epoch`` is empty until an engine resets its cache
    (`Planner.new_epoch`); after that no key of the old epoch can be produced.
    """

    model: str
    layout: str = ""
    kv_world_size: int = attrs.field(default=1, validator=_check_non_negative)
    kv_rank: int = attrs.field(default=0, validator=_check_non_negative)
    lora: str = ""
    cache_salt: str = ""
    extra: tuple[bytes, ...] = attrs.field(default=(), converter=_to_digests)
    epoch: str = ""
    seed: bytes = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.kv_world_size < 1 or self.kv_rank >= self.kv_world_size:
            raise InvalidArgumentError(
                f"kv_rank {self.kv_rank} is outside kv_world_size {self.kv_world_size}",
                kv_rank=self.kv_rank,
                kv_world_size=self.kv_world_size,
            )
        object.__setattr__(self, "seed", self._compute_seed())

    def _compute_seed(self) -> bytes:
        parts = [
            _NAMESPACE_TAG,
            _field(b"model", self.model.encode()),
            _field(b"layout", self.layout.encode()),
            _field(b"kv_world_size", struct.pack("<I", self.kv_world_size)),
            _field(b"kv_rank", struct.pack("<I", self.kv_rank)),
            _field(b"lora", self.lora.encode()),
            _field(b"cache_salt", self.cache_salt.encode()),
            _field(b"extra", struct.pack("<I", len(self.extra))),
        ]
        parts.extend(_field(b"digest", d) for d in self.extra)
        if self.epoch:  # absent when empty, so keys of namespaces without one keep their golden values
            parts.append(_field(b"epoch", self.epoch.encode()))
        return hashlib.sha256(b"".join(parts)).digest()

    def for_rank(self, kv_rank: int) -> Namespace:
        """The same namespace as seen by another KV rank."""
        return attrs.evolve(self, kv_rank=kv_rank)

    def with_salt(self, cache_salt: str | None) -> Namespace:
        """The same namespace scoped to a request's ``cache_salt`` (None means none)."""
        return attrs.evolve(self, cache_salt=cache_salt or "")


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; the exact bytes that keys hash."""
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgumentError(f"token ids must be ints in [0, {_MAX_TOKEN_ID}]: {exc}", field="tokens") from exc
    if packed.itemsize != 4:  # pragma: no cover - no such platform in use
        packed = array("L", tokens)
    if _BIG_ENDIAN:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


class KeyChain:
    """Chunk keys of one request, extended incrementally as its tokens grow.

    ``update(all_tokens)`` hashes only the full chunks not hashed before. One
    chain can serve several namespaces at once (one per KV rank, say); tokens are
    packed once and hashed once per namespace.

    ``marks`` are (token position, digest) pairs of inputs that token ids do not capture
    and that begin at that position (a multimodal input: its placeholder tokens say
    nothing of the image). A mark's digest is hashed into the key of the chunk that holds
    its position, after the tokens: ``key_i = SHA256(key_{i-1} || tokens || digests)``,
    so chunks before the first mark keep the keys of plain text and are shared, and every
    chunk from it on depends on it through the chain.
    """

    __slots__ = ("_chunk_bytes", "_keys", "_marks", "_tails", "chunk_size", "num_tokens_hashed")

    def __init__(
        self,
        namespaces: Namespace | Sequence[Namespace],
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        marks: Sequence[tuple[int, bytes]] = (),
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise InvalidArgumentError(f"chunk_size must be a positive int, got {chunk_size!r}", got=chunk_size)
        spaces = [namespaces] if isinstance(namespaces, Namespace) else list(namespaces)
        if not spaces:
            raise InvalidArgumentError("a KeyChain needs at least one namespace")
        self.chunk_size = chunk_size
        self.num_tokens_hashed = 0
        self._chunk_bytes = chunk_size * 4
        self._tails = [ns.seed for ns in spaces]
        self._keys: list[list[bytes]] = [[] for _ in spaces]
        self._marks: dict[int, bytes] = {}  # chunk index -> its marks' digests, in the given order
        for position, digest in marks:
            if isinstance(position, bool) or not isinstance(position, int) or position < 0:
                raise InvalidArgumentError(f"a mark's position must be a non-negative int, got {position!r}")
            if not isinstance(digest, bytes) or len(digest) != KEY_SIZE:
                raise InvalidArgumentError(f"a mark's digest must be {KEY_SIZE} bytes", field="marks")
            chunk = position // chunk_size
            self._marks[chunk] = self._marks.get(chunk, b"") + digest

    @property
    def num_namespaces(self) -> int:
        return len(self._keys)

    @property
    def num_chunks(self) -> int:
        return self.num_tokens_hashed // self.chunk_size

    def keys(self, index: int = 0) -> list[bytes]:
        """The keys so far for the ``index``-th namespace (a live list: do not mutate)."""
        return self._keys[index]

    def update(self, all_tokens: Sequence[int]) -> int:
        """Hash the full chunks of ``all_tokens`` past those hashed already.

        ``all_tokens`` is the request's whole token list so far; earlier tokens
        must not have changed. Returns the number of new chunks.
        """
        start = self.num_tokens_hashed
        end = len(all_tokens) - (len(all_tokens) - start) % self.chunk_size
        if end <= start:
            return 0
        data = memoryview(pack_tokens(all_tokens[start:end]))
        step = self._chunk_bytes
        sha256 = hashlib.sha256
        first, marks = start // self.chunk_size, self._marks
        for index, keys in enumerate(self._keys):
            prev = self._tails[index]
            append = keys.append
            for chunk, offset in enumerate(range(0, len(data), step), first):
                h = sha256(prev)
                h.update(data[offset : offset + step])
                if chunk in marks:
                    h.update(marks[chunk])
                prev = h.digest()
                append(prev)
            self._tails[index] = prev
        self.num_tokens_hashed = end
        return (end - start) // self.chunk_size


def chunk_keys(
    namespace: Namespace,
    tokens: Sequence[int],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    marks: Sequence[tuple[int, bytes]] = (),
) -> list[bytes]:
    """Keys of every full chunk of ``tokens`` under ``namespace`` (with ``marks``, see `KeyChain`)."""
    chain = KeyChain(namespace, chunk_size, marks)
    chain.update(tokens)
    return chain.keys()
