"""Copiers: one object per (layout, pool) that gathers and scatters chunks.

`open_copier` returns a `CpuCopier` for a CPU KV cache (copies run synchronously on the
calling thread) or a `CudaCopier` (copies run on a side stream, ordered after the
compute stream, and complete asynchronously). Both return a handle with `done()` and
`wait()`. `gather` and `scatter` are one-shot helpers around a copier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import structlog
import torch

from kvdepot.gpu import _flat, _triton
from kvdepot.gpu._copy import (
    BlockIds,
    CompletedCopy,
    CopyHandle,
    CopyPlan,
    check_pool,
    gather_cpu,
    plan_copy,
    scatter_cpu,
)
from kvdepot.gpu._errors import CopierClosedError, CopyArgumentError
from kvdepot.gpu._flat import flat_rows, gather_flat, scatter_flat
from kvdepot.gpu._layout import KVLayout, dtype_of_width, width_of
from kvdepot.gpu._segments import SegmentTable, segment_tables

log = structlog.get_logger(__name__)

Method = Literal["auto", "triton", "dma"]

# With "auto", a plane group whose merged contiguous runs average at least this many
# bytes goes to the DMA copy engines: few large descriptors run at full link speed
# there and leave the SMs to compute. Smaller runs go to the Triton kernel, whose one
# launch costs the same for 10 or 10,000 segments. (vLLM measured the crossover for
# single descriptors near 28 KiB on H100 PCIe Gen5; here a run pays a Python call too.)
DMA_MIN_RUN_BYTES = 1 << 20

# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every context, and
# mapped into the device address space so kernels can read and write it.
_HOST_REGISTER_FLAGS = 0x1 | 0x2


def triton_copy(layout: KVLayout, plan: CopyPlan, pool: torch.Tensor, pool_arg: Any, *, to_pool: bool) -> list[Any]:
    """Run `plan` through the Triton kernel, one launch per plane group.

    `pool_arg(width)` is what the kernel gets for the pool: a word view of the pool
    tensor (CPU, under TRITON_INTERPRET=1) or a `DevicePointer` (CUDA). Returns the
    tensors that must stay alive until the copy completes.
    """
    keep: list[Any] = []
    max_width = width_of(8, pool.data_ptr(), pool.storage_offset())
    for table in segment_tables(layout, plan, pool.data_ptr(), max_width=max_width):
        keep += launch_table(table, pool_arg(table.width), layout.device, to_pool=to_pool)
    return keep


def launch_table(table: SegmentTable, pool_words: Any, device: torch.device, *, to_pool: bool) -> list[Any]:
    """One kernel launch for every segment of one plane group."""
    if table.num_segments == 0:
        return []
    kv_words = table.group.base(table.width)
    kv_offsets, slot_offsets = _to_device(table, device)
    if to_pool:
        _triton.copy_segments(kv_words, pool_words, kv_offsets, slot_offsets, table.seg_words)
    else:
        _triton.copy_segments(pool_words, kv_words, slot_offsets, kv_offsets, table.seg_words)
    return [kv_offsets, slot_offsets]


def _to_device(table: SegmentTable, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cpu":
        return table.kv_offsets, table.slot_offsets
    both = torch.stack([table.kv_offsets, table.slot_offsets]).pin_memory().to(device, non_blocking=True)
    return both[0], both[1]


def pool_words(pool: torch.Tensor, width: int) -> torch.Tensor:
    """The whole pool as `width`-byte words."""
    usable = pool.numel() - pool.numel() % width
    return pool[:usable].view(dtype_of_width(width))


def dma_copy(layout: KVLayout, plan: CopyPlan, pool: torch.Tensor, *, to_pool: bool, tables: Any = None) -> None:
    """Run `plan` as one `copy_` per contiguous run (cudaMemcpyAsync on CUDA)."""
    max_width = width_of(8, pool.data_ptr(), pool.storage_offset())
    for table in tables if tables is not None else segment_tables(layout, plan, pool.data_ptr(), max_width=max_width):
        kv_words = table.group.base(table.width)
        words = pool_words(pool, table.width)
        kv_starts, slot_starts, lengths = (t.tolist() for t in table.runs())
        for kv, slot, n in zip(kv_starts, slot_starts, lengths, strict=True):
            if to_pool:
                words[slot : slot + n].copy_(kv_words[kv : kv + n], non_blocking=True)
            else:
                kv_words[kv : kv + n].copy_(words[slot : slot + n], non_blocking=True)


class CpuCopier:
    """Gather and scatter for a KV cache in host memory; copies finish before the call returns."""

    def __init__(self, layout: KVLayout, pool: torch.Tensor) -> None:
        self.layout = layout
        self.pool = check_pool(pool)
        self._closed = False
        # every layer's blocks as rows of one matrix, when the addresses allow (see _flat)
        self.flat = flat_rows(layout)
        self._pool_bytes = self.pool.numpy()

    def gather(
        self, block_ids_per_chunk: Sequence[BlockIds], slot_offsets: Sequence[int], *, slot_size: int | None = None
    ) -> CopyHandle:
        """Copy every layer's bytes of each chunk's blocks into its slot."""
        self._check_open()
        plan = plan_copy(
            self.layout, self.pool, slot_offsets, block_ids_per_chunk, slot_size=slot_size, writes_kv=False, check=False
        )
        if self.flat is not None:
            gather_flat(self.flat, self.pool, plan)
        else:
            gather_cpu(self.layout, self.pool, plan)
        return CompletedCopy()

    def scatter(
        self,
        slot_offsets: Sequence[int],
        block_ids_per_chunk: Sequence[BlockIds],
        *,
        skip_blocks: int | Sequence[int] = 0,
        slot_size: int | None = None,
    ) -> CopyHandle:
        """Copy each slot into its chunk's blocks, except the `skip_blocks` leading ones."""
        self._check_open()
        plan = plan_copy(
            self.layout, self.pool, slot_offsets, block_ids_per_chunk, skip_blocks=skip_blocks, slot_size=slot_size,
            writes_kv=True,
            check=False,
        )  # fmt: skip
        if self.flat is not None:
            scatter_flat(self.flat, self._pool_bytes, plan)
        else:
            scatter_cpu(self.layout, self.pool, plan)
        return CompletedCopy()

    def describe(self) -> str:
        """How copies run, for logs."""
        if self.flat is None:
            return "cpu: one tensor op per layer group and chunk"
        rows = f"one row matrix of {self.flat.row_bytes}-byte rows"
        if _flat.FLAT_NATIVE:
            return f"cpu: native block copy over {rows}, {_flat.native_threads()} threads"
        return f"cpu: index_select / numpy.put over {rows} (native copy not built)"

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CopierClosedError("this copier is closed; open a new one with open_copier(layout, pool).")

    def __enter__(self) -> CpuCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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

    def __init__(self, layout: KVLayout, pool: torch.Tensor, *, method: Method = "auto", register: bool = True) -> None:
        if layout.device.type != "cuda":
            raise CopyArgumentError(f"CudaCopier needs a CUDA KV cache, got {layout.device}.", got=str(layout.device))
        if method not in ("auto", "triton", "dma"):
            raise CopyArgumentError(f"method must be 'auto', 'triton' or 'dma', got {method!r}.", got=method)
        self.layout = layout
        self.pool = check_pool(pool)
        self.device = layout.device
        self.stream = torch.cuda.Stream(device=self.device)
        self.registered = False
        if register and not pool.is_pinned():
            self.registered = _host_register(pool)
        can_zero_copy = (self.registered or pool.is_pinned()) and _triton.available()
        if method == "triton" and not can_zero_copy:
            raise CopyArgumentError(
                "method='triton' needs the triton package and a pool registered for DMA; use method='auto'.",
                got=method,
            )
        self.method: Method = method if method != "auto" or can_zero_copy else "dma"
        self._closed = False

    def describe(self) -> str:
        """How copies run, for logs."""
        return f"cuda: {self.method}, pool {'registered for DMA' if self.registered else 'pageable'}"

    def gather(
        self,
        block_ids_per_chunk: Sequence[BlockIds],
        slot_offsets: Sequence[int],
        *,
        slot_size: int | None = None,
        after: Any = None,
    ) -> CudaCopyHandle:
        """Queue copies of each chunk's blocks into its slot; returns at once."""
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
        max_width = width_of(8, self.pool.data_ptr(), self.pool.storage_offset())
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            tables = segment_tables(self.layout, plan, self.pool.data_ptr(), max_width=max_width)
            for table in tables:
                if not table.num_segments:
                    continue
                if self._use_dma(table):
                    dma_copy(self.layout, plan, self.pool, to_pool=to_pool, tables=[table])
                else:
                    keep += self._launch(table, to_pool=to_pool)
            done = torch.cuda.Event()
            done.record(self.stream)
        return CudaCopyHandle(done, keep)

    def _use_dma(self, table: SegmentTable) -> bool:
        if self.method != "auto":
            return self.method == "dma"
        _, _, lengths = table.runs()
        return bool(lengths.numel()) and float(lengths.double().mean()) * table.width >= DMA_MIN_RUN_BYTES

    def _launch(self, table: SegmentTable, *, to_pool: bool) -> list[Any]:
        pool_ptr = _triton.DevicePointer(self.pool.data_ptr(), dtype_of_width(table.width))
        return launch_table(table, pool_ptr, self.device, to_pool=to_pool)

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


def open_copier(
    layout: KVLayout, pool: torch.Tensor, *, method: Method = "auto", register: bool = True
) -> CpuCopier | CudaCopier:
    """The copier for this layout's device: `CpuCopier` or `CudaCopier` (same methods)."""
    if layout.device.type == "cpu":
        return CpuCopier(layout, pool)
    return CudaCopier(layout, pool, method=method, register=register)


def gather(
    layout: KVLayout,
    block_ids_per_chunk: Sequence[BlockIds],
    pool: torch.Tensor,
    slot_offsets: Sequence[int],
    *,
    slot_size: int | None = None,
) -> None:
    """Copy every layer's bytes of each chunk's blocks into its slot, and return when done."""
    with open_copier(layout, pool, register=False) as copier:
        copier.gather(block_ids_per_chunk, slot_offsets, slot_size=slot_size).wait()


def scatter(
    layout: KVLayout,
    pool: torch.Tensor,
    slot_offsets: Sequence[int],
    block_ids_per_chunk: Sequence[BlockIds],
    *,
    skip_blocks: int | Sequence[int] = 0,
    slot_size: int | None = None,
) -> None:
    """Copy each slot into its chunk's blocks except the `skip_blocks` leading ones, and return when done."""
    with open_copier(layout, pool, register=False) as copier:
        copier.scatter(slot_offsets, block_ids_per_chunk, skip_blocks=skip_blocks, slot_size=slot_size).wait()
