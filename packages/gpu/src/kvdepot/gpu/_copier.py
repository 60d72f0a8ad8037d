"""Copiers: one object per (layout, pool) that gathers and scatters chunks.

`open_copier` gives each device its one fast path, and nothing chooses between others:

- CPU: `CpuCopier`, the native copy (`_rowcopy.c`) reading the layout's copy table; one
  call per chunk whatever the layout. It is built with the package and required.
- CUDA: `CudaCopier` (`_cuda.py`), the Triton kernel, or DMA copies where Triton or a
  registered pool is missing.
- Any other device, or `method="reference"`: `ReferenceCopier`, plain torch indexing
  (`_reference.py`), the copy the tests check every path against.

Every copier returns a handle with `done()` and `wait()`. `gather` and `scatter` are
one-shot helpers around a copier.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any, Literal

import structlog
import torch

from kvdepot.gpu._copy import BlockIds, CompletedCopy, CopyHandle, CopyPlan, check_pool, plan_copy, require_writable
from kvdepot.gpu._cuda import CudaCopier
from kvdepot.gpu._errors import CopierClosedError, CopyArgumentError, NativeCopyError
from kvdepot.gpu._layout import KVLayout
from kvdepot.gpu._reference import reference_copy
from kvdepot.gpu._table import CopyTables

try:
    from kvdepot.gpu import _rowcopy
except ImportError as exc:  # a broken install: the copier says so when it opens
    _rowcopy = None  # type: ignore[assignment]
    _NATIVE_IMPORT_ERROR = str(exc)

log = structlog.get_logger(__name__)

Method = Literal["auto", "triton", "dma", "reference"]


@functools.cache
def _shares_torch_openmp() -> bool:
    """Whether the native copy's OpenMP loops run on torch's own OpenMP runtime (and so its thread team).

    They do when the runtime the extension resolved lies in torch's package: torch loaded
    its libgomp.so.1 first and the loader reused it. A runtime from elsewhere (a system
    libgomp beside a torch that bundles a renamed one, an Intel OpenMP preloaded for the
    engine) would bring a second team competing with torch's for the cores.
    """
    ours = _rowcopy.openmp_library() if _rowcopy is not None and _rowcopy.OPENMP else None
    if ours is None or "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    return os.path.realpath(ours).startswith((torch_dir + os.sep, torch_dir + ".libs" + os.sep))


# libgomp's thread team does not survive fork(): in a child of a process that ran a
# threaded copy, a parallel region waits forever for threads that are gone (torch's own
# parallel ops in such a child hang the same way). Copies in such a child use one thread.
_forked_after_threads = False
_ran_threads = False


def _after_fork_in_child() -> None:
    global _forked_after_threads  # noqa: PLW0603 - process-wide state, set by the fork hook
    _forked_after_threads = _forked_after_threads or _ran_threads


os.register_at_fork(after_in_child=_after_fork_in_child)


def native_threads() -> int:
    """Threads for one native copy made on the thread that runs torch's operators: torch's
    intra-op threads when they can be shared, else 1.

    libgomp keeps one thread team per thread that starts parallel regions, so the team is
    shared only with copies made on the thread whose torch operators started it. A copy made
    on any other thread with more than one thread starts a second team; its idle threads then
    count against the cores, and libgomp stops spinning at every barrier of both teams (its
    threads sleep and wake instead): an engine's forward pass on the first team slows down
    for as long as the process lives. Copiers used from another thread pass ``threads=1``.
    """
    if _forked_after_threads or not _shares_torch_openmp():
        return 1
    return int(torch.get_num_threads())


class _SyncCopier:
    """Gather and scatter that finish before the call returns; subclasses move the bytes."""

    def __init__(self, layout: KVLayout, pool: torch.Tensor) -> None:
        self.layout = layout
        self.pool = check_pool(pool)
        self._closed = False
        self._writable = False  # checked at the first gather: a reader's pool may be read-only

    def gather(
        self,
        block_ids_per_chunk: Sequence[BlockIds],
        slot_offsets: Sequence[int],
        *,
        slot_size: int | None = None,
        after: Any = None,
    ) -> CopyHandle:
        """Copy every layer's bytes of each chunk's blocks into its slot (after `after`, an event
        from `compute_event`; None on a CPU, where the engine's work is done when it calls)."""
        self._check_open()
        if not self._writable:
            require_writable(self.pool)
            self._writable = True
        _wait_for(after)
        plan = plan_copy(
            self.layout, self.pool, slot_offsets, block_ids_per_chunk, slot_size=slot_size, writes_kv=False, check=False
        )
        self._copy(plan, to_slot=True)
        return CompletedCopy()

    def scatter(
        self,
        slot_offsets: Sequence[int],
        block_ids_per_chunk: Sequence[BlockIds],
        *,
        skip_blocks: int | Sequence[int] = 0,
        slot_size: int | None = None,
        after: Any = None,
    ) -> CopyHandle:
        """Copy each slot into its chunk's blocks, except the `skip_blocks` leading ones."""
        self._check_open()
        _wait_for(after)
        plan = plan_copy(
            self.layout, self.pool, slot_offsets, block_ids_per_chunk, skip_blocks=skip_blocks, slot_size=slot_size,
            writes_kv=True,
            check=False,
        )  # fmt: skip
        self._copy(plan, to_slot=False)
        return CompletedCopy()

    def _copy(self, plan: CopyPlan, *, to_slot: bool) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise CopierClosedError("this copier is closed; open a new one with open_copier(layout, pool).")

    def __enter__(self) -> _SyncCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CpuCopier(_SyncCopier):
    """Gather and scatter for a KV cache in host memory, by the native copy: one call per plan.

    The copy reads the layout's copy table for the chunk's size (`_table.py`), checks every
    block id, and moves each (layer, block) with prefetched reads, streaming writes on
    scatter, on ``threads`` OpenMP threads (None: `native_threads()`, torch's team, for copies
    made on the thread that runs torch's operators; 1 for copies made on a thread of their own).
    """

    def __init__(self, layout: KVLayout, pool: torch.Tensor, *, threads: int | None = None) -> None:
        if layout.device.type != "cpu":
            raise CopyArgumentError(f"CpuCopier needs a CPU KV cache, got {layout.device}.", got=str(layout.device))
        if _rowcopy is None:
            raise NativeCopyError(
                f"kvdepot.gpu's native CPU copy (kvdepot.gpu._rowcopy) is not built or does not load "
                f"({_NATIVE_IMPORT_ERROR}); reinstall kvdepot-gpu where a C compiler and the Python headers are "
                "installed (`pip install --force-reinstall --no-deps kvdepot-gpu`), or pass method='reference' to "
                "open_copier for the slow plain-torch copy.",
                cause=_NATIVE_IMPORT_ERROR,
            )
        if threads is not None and threads < 1:
            raise CopyArgumentError(f"threads must be at least 1, got {threads}.", got=threads)
        super().__init__(layout, pool)
        self.tables = CopyTables(layout)
        self.threads = threads

    def _threads(self) -> int:
        if self.threads is None:
            return native_threads()
        return 1 if _forked_after_threads else self.threads  # see native_threads: no team survives fork

    def _copy(self, plan: CopyPlan, *, to_slot: bool) -> None:
        global _ran_threads  # noqa: PLW0603 - process-wide state read by the fork hook
        threads = self._threads()
        _ran_threads = _ran_threads or threads > 1
        address = self.pool.data_ptr()
        chunks = []
        for offset, ids, skip in plan.chunks():
            table = self.tables(len(ids))
            chunks.append((table.rows, ids, skip, address + offset, table.chunk_bytes))
        # One call for the whole plan: the GIL is released once, not once per chunk. Taking it
        # back costs up to the switch interval (5 ms) while the engine thread runs Python.
        _rowcopy.copy_chunks(chunks, self.layout.num_blocks, to_slot, not to_slot, threads)

    def describe(self) -> str:
        """How copies run, for logs."""
        return f"cpu: native block copy by copy table, {self._threads()} threads"


class ReferenceCopier(_SyncCopier):
    """Gather and scatter by plain torch indexing, on any device: slow, and the tests' oracle."""

    def _copy(self, plan: CopyPlan, *, to_slot: bool) -> None:
        reference_copy(self.layout, self.pool, plan, to_slot=to_slot)

    def describe(self) -> str:
        """How copies run, for logs."""
        return f"{self.layout.device.type}: plain-torch reference copy (slow)"


def compute_event(device: torch.device) -> Any:
    """An event at the end of the work queued so far on the calling thread's current stream of
    `device`, or None where copies need none (a CPU: its work is done when the call returns).

    Pass it as `after=` to a gather or scatter made from another thread: each thread has its
    own current stream, and an engine computes on a stream of its own, so a copier on another
    thread cannot tell by itself which work the blocks wait for.
    """
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _wait_for(after: Any) -> None:
    """Make the calling thread's current stream wait for `after` (a CUDA event), if any."""
    if after is not None:
        after.wait()


def open_copier(
    layout: KVLayout,
    pool: torch.Tensor,
    *,
    method: Method = "auto",
    register: bool = True,
    cpu_threads: int | None = None,
    programs: int | None = None,
) -> CpuCopier | CudaCopier | ReferenceCopier:
    """The copier of this layout's device (same methods on each); see the module docstring.

    `method` picks the CUDA path ("triton" or "dma"; "auto": Triton where it can run) or,
    on any device, "reference". `register` (CUDA): register the pool for DMA. `cpu_threads`
    (CPU): threads per copy; pass 1 when copies run on a thread other than the one that runs
    torch's operators (see `native_threads`). `programs` (CUDA, Triton): at most this many of
    the kernel's programs at once, each holding a share of one SM while it copies (default
    `_triton.PROGRAMS`; 0: one per tile, the fastest copy and the most SMs taken from the engine).
    """
    if method == "reference" or layout.device.type not in ("cpu", "cuda"):
        return ReferenceCopier(layout, pool)
    if layout.device.type == "cpu":
        return CpuCopier(layout, pool, threads=cpu_threads)
    return CudaCopier(layout, pool, method=method, register=register, programs=programs)


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
