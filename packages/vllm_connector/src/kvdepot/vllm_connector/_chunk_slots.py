"""Where a chunk's blocks lie in a pool slot, and the copies between the two.

A slot holds one chunk: the blocks of KV-cache group 0, then group 1, ... (a hybrid model has
one `KVLayout` per group, over the same pool mapping), each group's part ``group_bytes[g]``
long at ``group_offsets[g]``. `SlotLayout` knows that arrangement once the worker has
registered its KV-cache tensors, and does the three things that depend on it alone: check a
load against the mapped pool (`check`), copy a load's chunks from their slots into their
blocks under the slot seqlock (`scatter`), and copy a store's blocks into its reserved slots
(`gather`). Which thread runs them, and under which lock, is the worker's (`_worker.py`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvdepot.core import SLOT_HEADER_BYTES, slot_digest, slot_header_holds
from kvdepot.vllm_connector._groups import NULL_BLOCK_ID, CacheGroup
from kvdepot.vllm_connector._loads import Checked, CopyMeter, SlotChangedError, leading_nulls

if TYPE_CHECKING:
    from kvdepot.gpu import KVLayout
    from kvdepot.vllm_connector._meta import LoadOp, StoreOp
    from kvdepot.vllm_connector._pool_mapping import _PoolMapping

#: A hybrid layout's fingerprint longer than this is sent as its digest (the wire allows 1024).
FINGERPRINT_MAX = 512


@attrs.frozen
class SlotLayout:
    """The KV-cache groups' layouts, and where each group's blocks of a chunk lie in its slot."""

    layouts: tuple[KVLayout, ...]
    blocks_per_chunk: int
    #: Per group: where its blocks start in a slot, and how many bytes they take.
    group_offsets: tuple[int, ...]
    group_bytes: tuple[int, ...]
    #: A slot's payload: every group's blocks of one chunk.
    chunk_bytes: int
    #: Every load's copy, timed (whichever thread copies).
    meter: CopyMeter = attrs.field(factory=CopyMeter, eq=False)

    @classmethod
    def of(cls, layouts: Sequence[KVLayout], blocks_per_chunk: int, meter: CopyMeter | None = None) -> SlotLayout:
        """The slots of ``layouts`` (none before the worker registered: no bytes)."""
        sizes = tuple(layout.chunk_bytes(blocks_per_chunk) for layout in layouts)
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        return cls(tuple(layouts), blocks_per_chunk, offsets, sizes, sum(sizes), meter or CopyMeter())

    @property
    def on_cpu(self) -> bool:
        """The KV cache is in host memory (a CPU engine); False before the worker registered."""
        return bool(self.layouts) and self.layouts[0].device.type == "cpu"

    def engine_copiers(self, pool: _PoolMapping) -> list[Any]:
        """The copiers the engine's thread uses: on a CPU with torch's OpenMP team, on CUDA the side streams'."""
        return pool.engine_copiers if self.on_cpu else pool.copiers

    def engine_event(self) -> Any:
        """The end of the work the engine queued so far (on this, its thread's stream): the copy
        thread's copies wait for it, on a GPU, or a store could read blocks before this step's
        layers wrote them, and a load write blocks kernels queued earlier still use."""
        from kvdepot.gpu import compute_event

        return compute_event(self.layouts[0].device) if self.layouts else None

    def fingerprint(self, groups: Sequence[CacheGroup]) -> str:
        """The layout's fingerprint: every group's, with what kind of attention it is."""
        if len(self.layouts) == 1:
            return self.layouts[0].fingerprint()
        pairs = zip(groups, self.layouts, strict=True)
        text = "|".join(f"{group.describe()}:{layout.fingerprint()}" for group, layout in pairs)
        if len(text) > FINGERPRINT_MAX:
            text = f"hybrid{len(self.layouts)}:sha256:{hashlib.sha256(text.encode()).hexdigest()}"
        return text

    def check(self, op: LoadOp, pool: _PoolMapping, kv_rank: int) -> Checked:
        """The load's slots, keys and blocks to skip per group, once it is checked against the mapped
        pool; RuntimeError says what does not fit."""
        if not op.server_id or op.server_id != pool.server_id:
            raise RuntimeError(f"the lease is from server {op.server_id!r}, the mapped pool from {pool.server_id!r}")
        if op.slot_bytes != self.chunk_bytes:
            raise RuntimeError(f"the slots hold {op.slot_bytes} bytes, this worker's chunks are {self.chunk_bytes}")
        slots, keys = op.slots[kv_rank], op.keys[kv_rank]
        bpc = self.blocks_per_chunk
        if len(op.block_ids) != len(self.layouts):
            raise RuntimeError(f"blocks of {len(op.block_ids)} KV-cache groups for {len(self.layouts)} groups")
        if any(len(slots) * bpc != len(ids) for ids in op.block_ids) or len(keys) != len(slots):
            raise RuntimeError(f"{len(slots)} slots and {len(keys)} keys for {[len(i) for i in op.block_ids]} blocks")
        # vLLM's null block stands for blocks outside a sliding window: always leading, never written.
        skips = [max(op.skip_blocks, leading_nulls(ids)) for ids in op.block_ids]
        if any(NULL_BLOCK_ID in ids[skip:] for ids, skip in zip(op.block_ids, skips, strict=True)):
            raise RuntimeError("vLLM's null block lies after a block to load")
        if any(offset < SLOT_HEADER_BYTES or offset + self.chunk_bytes > pool.size for offset in slots):
            raise RuntimeError("a slot lies outside the mapped pool")
        return Checked(list(slots), list(keys), skips)

    def scatter(
        self, op: LoadOp, pool: _PoolMapping, copiers: list[Any], checked: Checked, *, start: int, stop: int,
        after: Any = None,
    ) -> None:  # fmt: skip
        """Copy the load's chunks ``start`` to ``stop`` from their slots into their blocks.

        The seqlock (kvdepot.core._slots): only chunks whose slots say they hold them are
        copied, and only those whose header did not change while the copy read them are kept.
        Raises `SlotChangedError` at the first that is not: the chunks before it are loaded.
        """
        bpc = self.blocks_per_chunk
        slots, keys, skips = checked
        before = [pool.header(offset) for offset in slots[start:stop]]
        held = [
            slot_header_holds(h, slot_digest(op.salt, k), self.chunk_bytes)
            for h, k in zip(before, keys[start:stop], strict=True)
        ]
        good = start + (held.index(False) if False in held else len(held))
        if good > start:
            began = time.perf_counter()
            for copier, ids, skip, at, size in zip(
                copiers, op.block_ids, skips, self.group_offsets, self.group_bytes, strict=True
            ):
                blocks = [ids[i * bpc : (i + 1) * bpc] for i in range(start, good)]
                offsets = [offset + at for offset in slots[start:good]]
                # The load's first `skip` blocks are vLLM's (computed, or its null block): not written.
                skip_blocks = max(0, skip - start * bpc)
                copier.scatter(offsets, blocks, skip_blocks=skip_blocks, slot_size=size, after=after).wait()
            self.meter.add((good - start) * self.chunk_bytes, time.perf_counter() - began)
            good = next((i for i in range(start, good) if pool.header(slots[i]) != before[i - start]), good)
        if good < stop:
            raise SlotChangedError(good, len(slots))

    def gather(self, op: StoreOp, reply: Any, copiers: list[Any]) -> list[Any]:
        """Copy a store's blocks, every group's, into its reserved slots; the copies' handles.

        On a CPU the copy is done when this returns. On CUDA it runs on the copier's side stream
        after the work queued so far, and the compute stream waits for it before anything later.
        """
        bpc = self.blocks_per_chunk
        handles = []
        for copier, ids, at, size in zip(copiers, op.block_ids, self.group_offsets, self.group_bytes, strict=True):
            blocks = [ids[s.index * bpc : (s.index + 1) * bpc] for s in reply.slots]
            handle = copier.gather(blocks, [s.offset + at for s in reply.slots], slot_size=size)
            if hasattr(handle, "wait_stream"):
                handle.wait_stream()  # the compute stream: no later kernel writes a block before the copy read it
            handles.append(handle)
        return handles
