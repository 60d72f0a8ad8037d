from collections.abc import Sequence
from typing import Any

STREAMING_STORES: int
OPENMP: int

def openmp_library() -> str | None: ...
def copy_chunk(
    table: Any,
    ids: Sequence[int],
    skip: int,
    slot: int,
    slot_bytes: int,
    num_blocks: int,
    to_slot: bool,
    stream: bool = True,
    threads: int = 1,
) -> None: ...
def copy_chunks(
    chunks: Sequence[tuple[Any, Sequence[int], int, int, int]],
    num_blocks: int,
    to_slot: bool,
    stream: bool = True,
    threads: int = 1,
) -> None: ...
