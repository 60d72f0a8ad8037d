from collections.abc import Sequence
from typing import Any

STREAMING_STORES: int
OPENMP: int

def openmp_library() -> str | None: ...
def copy_blocks(
    kv: int,
    kv_rows: int,
    slot: int,
    slot_rows: int,
    ids: Sequence[int],
    pattern: Any,
    block_rows: Any,
    plane_rows: int,
    row_bytes: int,
    to_slot: bool,
    stream: bool = True,
    threads: int = 1,
) -> None: ...
