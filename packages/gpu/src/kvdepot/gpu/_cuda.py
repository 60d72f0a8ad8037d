"""The CUDA copier: the copy table, moved by the Triton kernel or by DMA.

Each gather or scatter runs on the copier's side stream after an event of the compute
stream, and completes asynchronously. The path is fixed when the copier opens:

- **Triton** (`_triton.py`) when Triton is installed and the pool is registered (or
  pinned): one kernel launch per call writes or reads the registered host memory
  directly, whatever the number of layers, segments and chunks. The kernel reads the copy
  table from the device (`KernelTables`, built once per chunk size) and the call's block
  ids and slot offsets from one small host-to-device copy.
- **DMA** otherwise: segments that follow each other on both sides are merged into runs,
  and each run is one `cudaMemcpyAsync` (`copy_(non_blocking=True)`).

Both follow the same copy table (`_table.py`), and both run on CPU tensors too (the kernel
under `TRITON_INTERPRET=1`), which is how they are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import structlog
import torch

from kvdepot.gpu import _triton
from kvdepot.gpu._copy import BlockIds, CopyPlan, check_pool, plan_copy, require_writable
from kvdepot.gpu._errors import CopierClosedError, CopyArgumentError
from kvdepot.gpu._layout import KVLayout, PlaneGroup, dtype_of_width, width_of
from kvdepot.gpu._table import KV, KV_STEP, LENGTH, SLOT, SLOT_STEP, CopyTable, CopyTables, merge_runs

log = structlog.get_logger(__name__)

CudaMethod = Literal["auto", "triton", "dma"]

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, and
# mapped into the device address space so kernels can read and write it.
_HOST_REGISTER_FLAGS = 0x1 | 0x2


def plane_group_segments(
    layout: KVLayout, plan: CopyPlan, tables: Callable[[int], CopyTable], pool_address: int
) -> Iterator[tuple[PlaneGroup, int, int, torch.Tensor, torch.Tensor]]:
    """Per plane group: (group, word width, segment bytes, KV offsets, pool offsets) of every segment
    the plan copies, offsets in bytes, the word width dividing all of them on both sides."""
    per_group: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = [[] for _ in layout.groups]
    length = [0] * len(layout.groups)
    for offset, ids, skip in plan.chunks():
        table = tables(len(ids))
        for index, part in enumerate(table.parts):
            kv, slot = table.segments(part, ids, skip, offset)
            per_group[index].append((width_of(part.width, pool_address, offset), kv, slot))
            length[index] = int(table.rows[part.start, LENGTH])
    for group, pieces, seg_bytes in zip(layout.groups, per_group, length, strict=True):
        if pieces:
            width = min(w for w, _, _ in pieces)
            yield group, width, seg_bytes, torch.cat([k for _, k, _ in pieces]), torch.cat([s for _, _, s in pieces])


class KernelTables:
    """The copy tables as the Triton kernel reads them: in words from the pool's first byte,
    every plane group's rows in one table, on the KV cache's device; one per chunk size,
    word width and pool address, built on first use."""

    def __init__(self, layout: KVLayout, tables: CopyTables) -> None:
        self.layout = layout
        self.tables = tables
        self._rows: dict[tuple[int, int, int], tuple[torch.Tensor, int]] = {}

    def width(self, blocks: int, base: int, offsets: Sequence[int]) -> int:
        """The widest word, at most 8 bytes, dividing every offset the kernel adds to `base`."""
        return width_of(min(part.width for part in self.tables(blocks).parts), 8, base, *offsets)

    def rows(self, blocks: int, width: int, base: int) -> tuple[torch.Tensor, int]:
        """(kernel table [rows, ROW_COLUMNS] int64 on the device, its longest row in words)."""
        key = (blocks, width, base)
        cached = self._rows.get(key)
        if cached is None:
            table = self.tables(blocks).rows
            words = np.stack(
                [table[:, KV] - base, table[:, KV_STEP], table[:, SLOT], table[:, SLOT_STEP], table[:, LENGTH]], axis=1
            )
            assert not (words % width).any(), "the word width divides every offset"
            words //= width
            rows = torch.from_numpy(np.ascontiguousarray(words)).to(self.layout.device)
            cached = self._rows[key] = (rows, int(words[:, 4].max()))
        return cached


def triton_copy(
    plan: CopyPlan, base: int, base_arg: Callable[[int], Any], tables: KernelTables, *, to_pool: bool,
    programs: int = _triton.PROGRAMS,
) -> list[Any]:  # fmt: skip
    """Run `plan` through the Triton kernel: one launch per chunk size (a step's chunks have one).

    `base` is the pool's address and `base_arg(width)` what the kernel gets for it: a word
    view of the pool tensor (CPU, under TRITON_INTERPRET=1) or a `DevicePointer` (CUDA).
    Returns the tensors that must stay alive until the copy completes.
    """
    by_size: dict[int, list[tuple[int, list[int], int]]] = {}
    for offset, ids, skip in plan.chunks():
        by_size.setdefault(len(ids), []).append((offset, ids, skip))
    keep: list[Any] = []
    device = tables.layout.device
    for blocks, chunks in by_size.items():
        width = tables.width(blocks, base, [offset for offset, _, _ in chunks])
        rows, longest = tables.rows(blocks, width, base)
        count = len(chunks)
        packed = torch.tensor(
            [offset // width for offset, _, _ in chunks] + [skip for _, _, skip in chunks]
            + [block for _, ids, _ in chunks for block in ids],
            dtype=torch.int64,
        )  # fmt: skip
        if device.type != "cpu":
            packed = packed.pin_memory().to(device, non_blocking=True)
        _triton.copy_blocks(
            base_arg(width), rows, packed[2 * count :], packed[:count], packed[count : 2 * count],
            blocks=blocks, tile_words=longest, to_pool=to_pool, programs=programs,
        )  # fmt: skip
        keep.append(packed)
    return keep


def pool_words(pool: torch.Tensor, width: int) -> torch.Tensor:
    """The whole pool as `width`-byte words."""
    usable = pool.numel() - pool.numel() % width
    return pool[:usable].view(dtype_of_width(width))


def dma_copy(
    layout: KVLayout, plan: CopyPlan, pool: torch.Tensor, tables: Callable[[int], CopyTable], *, to_pool: bool
) -> None:
    """Run `plan` as one `copy_` per run of segments that follow each other on both sides (cudaMemcpyAsync)."""
    for group, _, seg_bytes, kv, slot in plane_group_segments(layout, plan, tables, pool.data_ptr()):
        kv_bytes = group.base(1)
        for kv_start, slot_start, n in merge_runs(kv, slot, seg_bytes):
            if to_pool:
                pool[slot_start : slot_start + n].copy_(kv_bytes[kv_start : kv_start + n], non_blocking=True)
            else:
                kv_bytes[kv_start : kv_start + n].copy_(pool[slot_start : slot_start + n], non_blocking=True)


class CudaCopyHandle:
    """Completion of a copy on the copier's side stream, observable without blocking."""

    def __init__(self, event: Any, keep: list[Any]) -> None:
        self.event = event
        self._keep = keep  # device tables the side stream still reads

    def done(self) -> bool:
        finished = bool(self.event.query())
        if finished:
            self._keep = []
        return finished

    def wait(self) -> None:
        self.event.synchronize()
        self._keep = []

    def wait_stream(self, stream: Any = None) -> None:
        """Make `stream` (default: the current stream) wait for the copy, without blocking the host."""
        (stream if stream is not None else torch.cuda.current_stream(self.event.device)).wait_event(self.event)


class CudaCopier:
    """Gather and scatter for a KV cache on a CUDA device.

    The pool is registered for DMA (cudaHostRegister) once, here, and unregistered by
    `close()`; where registration fails the copies still run, as pageable DMA copies.
    Each copy runs on a side stream after an event of the compute stream (or `after`),
    so it never reads a block before the kernels queued before it have written it, and
    overlaps the compute queued after it.
    """

    def __init__(
        self, layout: KVLayout, pool: torch.Tensor, *, method: CudaMethod = "auto", register: bool = True,
        programs: int | None = None,
    ) -> None:  # fmt: skip
        if layout.device.type != "cuda":
            raise CopyArgumentError(f"CudaCopier needs a CUDA KV cache, got {layout.device}.", got=str(layout.device))
        if method not in ("auto", "triton", "dma"):
            raise CopyArgumentError(f"method must be 'auto', 'triton' or 'dma', got {method!r}.", got=method)
        self.layout = layout
        self.pool = check_pool(pool)
        self.device = layout.device
        self.stream = torch.cuda.Stream(device=self.device)
        self.registered = register and not pool.is_pinned() and _host_register(pool)
        self.method = _pick_method(method, can_zero_copy=(self.registered or pool.is_pinned()) and _triton.available())
        self.tables = CopyTables(layout)
        self.kernel_tables = KernelTables(layout, self.tables)
        self.programs = _triton.PROGRAMS if programs is None else programs
        if self.programs < 0:
            raise CopyArgumentError(f"programs must be >= 0 (0: one per tile), got {programs}.", got=programs)
        self._closed = False
        self._writable = False  # checked at the first gather: a reader's pool may be read-only

    def describe(self) -> str:
        """How copies run, for logs."""
        programs = f" ({self.programs or 'a program per tile'} programs)" if self.method == "triton" else ""
        return f"cuda: {self.method}{programs}, pool {'registered for DMA' if self.registered else 'pageable'}"

    def gather(
        self,
        block_ids_per_chunk: Sequence[BlockIds],
        slot_offsets: Sequence[int],
        *,
        slot_size: int | None = None,
        after: Any = None,
    ) -> CudaCopyHandle:
        """Queue copies of each chunk's blocks into its slot; returns at once."""
        if not self._writable:
            require_writable(self.pool)
            self._writable = True
        plan = plan_copy(
            self.layout, self.pool, slot_offsets, block_ids_per_chunk, slot_size=slot_size, writes_kv=False, check=False
        )
        return self._run(plan, to_pool=True, after=after)

    def scatter(
        self,
        slot_offsets: Sequence[int],
        block_ids_per_chunk: Sequence[BlockIds],
        *,
        skip_blocks: int | Sequence[int] = 0,
        slot_size: int | None = None,
        after: Any = None,
    ) -> CudaCopyHandle:
        """Queue copies of each slot into its blocks; call `wait_stream()` on the handle before reading them."""
        plan = plan_copy(
            self.layout, self.pool, slot_offsets, block_ids_per_chunk, skip_blocks=skip_blocks, slot_size=slot_size,
            writes_kv=True,
            check=False,
        )  # fmt: skip
        return self._run(plan, to_pool=False, after=after)

    def _run(self, plan: CopyPlan, *, to_pool: bool, after: Any) -> CudaCopyHandle:
        if self._closed:
            raise CopierClosedError("this copier is closed; open a new one with open_copier(layout, pool).")
        ready = after
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        keep: list[Any] = []
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            if self.method == "triton":
                address = self.pool.data_ptr()
                pool_arg = lambda width: _triton.DevicePointer(address, dtype_of_width(width))  # noqa: E731
                keep = triton_copy(plan, address, pool_arg, self.kernel_tables, to_pool=to_pool, programs=self.programs)
            else:
                dma_copy(self.layout, plan, self.pool, self.tables, to_pool=to_pool)
            done = torch.cuda.Event()
            done.record(self.stream)
        return CudaCopyHandle(done, keep)

    def close(self) -> None:
        """Wait for queued copies, then unregister the pool. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stream.synchronize()
        if self.registered:
            _host_unregister(self.pool)
            self.registered = False

    def __enter__(self) -> CudaCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pick_method(method: CudaMethod, *, can_zero_copy: bool) -> CudaMethod:
    """Triton where it can run ("auto") or is asked for, else DMA."""
    if method == "triton" and not can_zero_copy:
        raise CopyArgumentError(
            "method='triton' needs the triton package and a pool registered for DMA; use method='auto'.", got=method
        )
    return "triton" if method == "triton" or (method == "auto" and can_zero_copy) else "dma"


def _cuda_status(result: Any) -> int:
    return int(getattr(result, "value", result))


def _host_register(pool: torch.Tensor) -> bool:
    """Pin the pool mapping for DMA and device access; False (and a log line) where that fails."""
    try:
        status = _cuda_status(torch.cuda.cudart().cudaHostRegister(pool.data_ptr(), pool.numel(), _HOST_REGISTER_FLAGS))
    except (RuntimeError, AttributeError) as exc:
        log.warning("pool_registration_failed", error=repr(exc), pool_bytes=pool.numel())
        return False
    if status != 0:
        log.warning("pool_registration_failed", cuda_error=status, pool_bytes=pool.numel())
        return False
    log.info("pool_registered", pool_bytes=pool.numel())
    return True


def _host_unregister(pool: torch.Tensor) -> None:
    status = _cuda_status(torch.cuda.cudart().cudaHostUnregister(pool.data_ptr()))
    if status != 0:
        log.warning("pool_unregistration_failed", cuda_error=status)
