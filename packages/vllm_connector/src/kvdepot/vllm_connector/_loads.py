"""What the worker keeps about a load while it copies it: the checked slots, the engine-thread
pacing record, and the error a slot that changed under the copy raises."""

from __future__ import annotations

from concurrent.futures import Future
from typing import NamedTuple

from kvdepot.vllm_connector._groups import NULL_BLOCK_ID
from kvdepot.vllm_connector._meta import LoadOp


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
