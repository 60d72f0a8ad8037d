from typing import Any

STREAMING_STORES: int
OPENMP: int

def copy_rows(
    dst: int,
    dst_rows: Any,
    dst_limit: int,
    src: int,
    src_rows: Any,
    src_limit: int,
    count: int,
    row_bytes: int,
    stream: bool = True,
    threads: int = 1,
) -> None: ...
