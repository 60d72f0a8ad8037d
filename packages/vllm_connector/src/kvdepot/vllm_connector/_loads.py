"""What the worker keeps about a load while it copies it: the checked slots, the engine-thread
pacing record, the error a slot that changed under the copy raises, the failures it reports
to vLLM, and how fast its copies ran."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import NamedTuple

from kvdepot.vllm_connector._groups import NULL_BLOCK_ID
from kvdepot.vllm_connector._meta import KVDepotWorkerMetadata, LoadOp

log = logging.getLogger("vllm.kvdepot.worker")


def leading_nulls(block_ids: list[int]) -> int:
    """How many of the blocks, from the first, are vLLM's null block."""
    count = 0
    for block in block_ids:
        if block != NULL_BLOCK_ID:
            break
        count += 1
    return count


class SlotChangedError(RuntimeError):
    """A slot did not hold its leased chunk before or after the copy (evicted and reused)."""

    def __init__(self, first_chunk: int, num_chunks: int) -> None:
        super().__init__(
            f"the slot of chunk {first_chunk} of {num_chunks} no longer held it (its lease was late or expired); "
            "the chunks before it were loaded"
        )
        self.first_chunk = first_chunk


class Checked(NamedTuple):
    """A load checked against the mapped pool: this rank's slots and keys, and each group's leading
    blocks not to write (vLLM's computed ones, or its null block)."""

    slots: list[int]
    keys: list[bytes]
    skips: list[int]


class PacedLoad:
    """A load copied on the engine thread, whole chunks at a time, over one or more steps."""

    def __init__(self, op: LoadOp) -> None:
        self.op = op
        self.future: Future[None] = Future()
        self.done_chunks = 0
        self.checked: Checked | None = None


class LoadFailures:
    """The loads that failed since vLLM last asked: by their blocks with one full-attention group
    (vLLM keeps what loaded before the first failed block: `get_block_ids_with_load_errors`), else
    by their requests (`failed_recving`: a window cut back to a failed block would hold vLLM's null
    block, and block ids are per group); and every failed request, for the scheduler side's count."""

    def __init__(self, *, per_block: bool, blocks_per_chunk: int) -> None:
        self.per_block = per_block
        self.blocks_per_chunk = blocks_per_chunk
        self.blocks: set[int] = set()
        self.requests: set[str] = set()
        self.meta = KVDepotWorkerMetadata()

    def report(self, op: LoadOp, exc: BaseException) -> None:
        log.warning("kvdepot load of %s failed; vLLM recomputes it: %s", op.req_id, exc)
        if self.per_block:
            first = exc.first_chunk * self.blocks_per_chunk if isinstance(exc, SlotChangedError) else 0
            self.blocks.update(op.block_ids[0][max(first, op.skip_blocks) :])
        else:
            self.requests.add(op.req_id)
        self.meta.failed.add(op.req_id)  # counted once, by the scheduler side

    def take_meta(self) -> KVDepotWorkerMetadata | None:
        meta, self.meta = self.meta, KVDepotWorkerMetadata()
        return meta if meta.failed else None

    def take_blocks(self) -> set[int]:
        out, self.blocks = self.blocks, set()
        return out

    def take_requests(self) -> set[str]:
        out, self.requests = self.requests, set()
        return out


class CopyMeter:
    """The bytes of hits copied into the KV cache and the seconds the copies took, since they were
    last taken (the engine's thread and the copy thread add; the engine's thread takes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = 0
        self._seconds = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._bytes += nbytes
            self._seconds += seconds

    def take(self) -> tuple[int, float]:
        with self._lock:
            out = (self._bytes, self._seconds)
            self._bytes, self._seconds = 0, 0.0
        return out
