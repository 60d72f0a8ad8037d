"""A watched chunk as vLLM's KV events name it: its blocks' hashes, tokens, extra keys, and the
``BlockStored`` / ``BlockRemoved`` events of each of the phase table's emits.

`EventAnnouncer` (`_kv_events.py`) decides when a chunk is announced or removed, and where
(`_chunk_phases.py`); `BlockEvents` only writes those events as vLLM's own classes: one per
KV-cache group, naming vLLM's block hashes of the chunk's blocks (and the hash of the block before
it as the parent), its token ids and vLLM's block size, ``medium`` ``"CPU"`` (the server's RAM)
or ``"STORAGE"`` (the tiers below it), ``locality="LOCAL"`` and ``ownership="kvdepot"`` where
this vLLM's events have those fields. A salt travels as the server's keyed label of it (see
`_kv_events.py`, "Tenancy").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvdepot.core import InvalidArgumentError, SaltLabeler
from kvdepot.vllm_connector._chunk_phases import Chunk, Emit

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvdepot.transport import CacheClient

MEDIUM = "CPU"
STORAGE = "STORAGE"
OWNER = "kvdepot"
#: Each of the phases' events: (stored, medium).
_EMITS = {
    Emit.STORED_RAM: (True, MEDIUM),
    Emit.REMOVED_RAM: (False, MEDIUM),
    Emit.STORED_BELOW: (True, STORAGE),
    Emit.REMOVED_BELOW: (False, STORAGE),
}


def _same(block_hash: Any) -> Any:
    return block_hash


def _low_64_bits(block_hash: bytes) -> int:
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def block_hash_converter(vllm_convert: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """vLLM's conversion of a block hash for its events (bytes, or by default their low 64 bits as
    an int), without its cost: vLLM reads its environment on every call, which costs more than
    the rest of an announcement. Checked against vLLM's own on a probe; vLLM's is used if they differ."""
    probe = bytes(range(32))
    for convert in (_same, _low_64_bits):
        if convert(probe) == vllm_convert(probe):
            return convert
    return vllm_convert


class BlockEvents:
    """Writes a watched chunk, and its events, in vLLM's terms (scheduler thread)."""

    def __init__(self, client: CacheClient, *, block_size: int, chunk_size: int, num_groups: int) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored_cls, self._removed_cls = BlockStored, BlockRemoved
        self._convert = block_hash_converter(maybe_convert_block_hash)
        fields = set(BlockStored.__struct_fields__)
        self._extra = {name: value for name, value in (("locality", "LOCAL"), ("ownership", OWNER)) if name in fields}
        self.client = client
        self.block_size = block_size
        self.chunk_size = chunk_size
        self.blocks_per_chunk = chunk_size // block_size
        self.num_groups = num_groups
        self._labeler: SaltLabeler | None = None  # keyed by the server's label key, once it sent one

    def chunk(self, request: Request, index: int, keys: tuple[bytes, ...], salt: str, now: float) -> Chunk:
        """Chunk ``index`` of ``request`` (``keys``: one per KV rank), as its events will name it."""
        first_block = index * self.blocks_per_chunk
        blocks = range(first_block, first_block + self.blocks_per_chunk)
        lora = getattr(request, "lora_request", None)
        lora_name = lora.name if lora is not None else None
        return Chunk(
            keys,
            salt,
            hashes=[self._convert(request.block_hashes[block]) for block in blocks],
            parent=self._convert(request.block_hashes[first_block - 1]) if first_block else None,
            tokens=tuple(request.all_token_ids[index * self.chunk_size : (index + 1) * self.chunk_size]),
            lora=(lora.adapter_id if lora is not None else None, lora_name),
            extra=self._extra_keys(blocks, lora_name, salt),
            since=now,
        )

    def events(self, chunk: Chunk, emit: Emit) -> list[Any]:
        """The events of ``emit`` for ``chunk``: one per KV-cache group."""
        stored, medium = _EMITS[emit]
        return self._stored(chunk, medium) if stored else self._removed(chunk, medium)

    def _stored(self, chunk: Chunk, medium: str) -> list[Any]:
        tokens = list(chunk.tokens)
        return [
            self._stored_cls(
                block_hashes=chunk.hashes,
                parent_block_hash=chunk.parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=chunk.lora[0],
                medium=medium,
                lora_name=chunk.lora[1],
                extra_keys=chunk.extra,
                group_idx=group,
                **self._extra,
            )
            for group in range(self.num_groups)
        ]

    def _removed(self, chunk: Chunk, medium: str) -> list[Any]:
        return [
            self._removed_cls(block_hashes=chunk.hashes, medium=medium, group_idx=group, **self._extra)
            for group in range(self.num_groups)
        ]

    def _extra_keys(
        self, blocks: Sequence[int], lora_name: str | None, salt: str
    ) -> list[tuple[Any, ...] | None] | None:
        """Each block's extra keys (the LoRA's name; the salt's label on the first block of a
        prompt), or None where no block has any."""
        extra: list[tuple[Any, ...] | None] = []
        for block in blocks:
            label = self._label(salt) if block == 0 and salt else None
            keys_of_block = ([lora_name] if lora_name else []) + ([label] if label else [])
            extra.append(tuple(keys_of_block) or None)
        return extra if any(extra) else None

    def _label(self, salt: str) -> str | None:
        """The server's label of ``salt`` (as its /metrics names it); None without its key."""
        key = self.client.label_key
        if not key:
            return None
        if self._labeler is None or self._labeler.key != key:  # first, or a server with a new key
            try:
                self._labeler = SaltLabeler(key)
            except InvalidArgumentError:  # too short to be a key: no label rather than a guessable one
                return None
        return self._labeler(salt)
