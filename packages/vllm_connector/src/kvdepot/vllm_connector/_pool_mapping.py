"""The worker's mapping of the server's shared-memory pool, its background prefault, and the
switch to a new mapping after a server restart.

Mapped, and remapped after a server restart, on the worker's copy thread only (`_worker.py`,
`PoolSwitch.current`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING

from kvdepot.core import SLOT_HEADER_BYTES
from kvdepot.server import PoolError

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from kvdepot.gpu import KVLayout
    from kvdepot.transport import RegisterReply

log = logging.getLogger("vllm.kvdepot.worker")

#: madvise(2) advice that maps a range's pages as if written, without writing (Linux 5.14+).
_MADV_POPULATE_WRITE = 23
#: The background prefault maps this much of the pool per system call. The call holds the
#: process's address-space lock (read side) throughout: any thread that maps or unmaps memory
#: meanwhile waits for it (torch's allocator, for the forward pass's larger tensors), and so do
#: the page faults queued behind that thread. 64 MiB took up to 270 ms on a busy 2-core VM;
#: 256 KiB take a fraction of a millisecond, and 4 GiB so take 16,384 calls.
PREFAULT_STEP = 256 << 10
#: How often a paused prefault checks whether it was stopped.
PREFAULT_POLL_S = 0.2


class _PoolMapping:
    """The server's shared-memory pool, mapped read-write once per server instance.

    A fresh mapping costs one page fault per 4 KiB page on first use, which makes the
    first copy into each slot several times slower than memory speed. A daemon thread maps
    the pages in the background (`prefault`), so the first pass through the pool does not
    pay for them on the engine's critical path. It maps a small step at a time, and only
    while ``may_run`` is set: the worker clears it while the engine is in a step, so the
    prefault never holds the address space under a forward pass for longer than the one
    step it had started. It runs at normal priority: at the lowest, a busy machine left it
    preempted for seconds in the middle of a step, holding the lock, while the engine's
    allocations waited behind it (a priority inversion).
    """

    def __init__(
        self,
        path: str,
        size: int,
        server_id: str,
        layouts: list[KVLayout],
        *,
        prefault: bool = True,
        may_run: threading.Event | None = None,
    ) -> None:
        import torch

        from kvdepot.gpu import open_copier
        from kvdepot.server import open_pool_file

        fd = open_pool_file(path)
        try:
            self.mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # Held until `close`: while this export lives the mapping cannot be closed (BufferError)
        # under the copiers, which use its raw address with the GIL released.
        self._export = memoryview(self.mmap)
        self.tensor = torch.frombuffer(self._export, dtype=torch.uint8)
        self.server_id = server_id
        self.path = path
        self.size = size
        #: Seconds the server keeps a reservation uncommitted (0: it did not say).
        self.reservation_ttl = 0.0
        # One copier per KV-cache group and mapping: on CUDA the first registers the pool for DMA.
        # On a CPU every copy runs on one thread, the copy thread: a threaded copy there would
        # start a second OpenMP team beside the engine's, and libgomp would then stop spinning at
        # the forward pass's barriers (each thread sleeping and waking at every one of them).
        self.copiers = [
            open_copier(layout, self.tensor, register=i == 0, cpu_threads=1) for i, layout in enumerate(layouts)
        ]
        # A CPU engine's loads run on its own thread, between its forward passes: there the
        # copy may use torch's team (`native_threads`), the cores being otherwise idle. (A GPU's
        # loads stay on the copy thread; a second CUDA copier would register the pool again.)
        self.engine_copiers = [open_copier(layout, self.tensor) for layout in layouts if layout.device.type == "cpu"]
        self._stop_prefault = threading.Event()
        self.prefault: threading.Thread | None = None
        if prefault:
            if may_run is None:
                may_run = threading.Event()
                may_run.set()
            self.prefault = threading.Thread(
                target=_prefault, args=(self.tensor.data_ptr(), size, self._stop_prefault, may_run), daemon=True,
                name="kvdepot-prefault",
            )  # fmt: skip
            self.prefault.start()

    def header(self, offset: int) -> bytes:
        """The header in front of the slot at ``offset`` (what it holds, and its generation)."""
        return self.mmap[offset - SLOT_HEADER_BYTES : offset]

    def close(self) -> None:
        self._stop_prefault.set()
        if self.prefault is not None:
            self.prefault.join(5)  # one step at most: the range must not be unmapped under it
        for copier in [*self.engine_copiers, *reversed(self.copiers)]:  # the first, which registered the pool, last
            copier.close()
        del self.tensor
        with contextlib.suppress(BufferError):  # a view of it is still alive somewhere: the OS unmaps at exit
            self._export.release()
            self.mmap.close()


class PoolSwitch:
    """The mapping the worker copies with, and the registration reply of a newer one to switch to.

    A reply comes from the engine thread (the worker's registration) or from the transport's
    settler thread (a reconnect to a restarted server); only the copy thread maps it
    (`current`), and never while a copy may use the old mapping: the engine thread copies only
    while it holds `lock`, and the switch takes it to swap the mappings.
    """

    def __init__(self, *, prefault: bool, may_run: threading.Event) -> None:
        self.prefault = prefault
        self.may_run = may_run
        self.mapping: _PoolMapping | None = None
        #: Held by the engine thread while it copies, and by the copy thread while it swaps mappings.
        self.lock = threading.Lock()
        self._pending_lock = threading.Lock()
        self._pending: tuple[RegisterReply, str] | None = None

    def offer(self, reply: RegisterReply, server_id: str, *, unless_pending: bool = False) -> None:
        """A registration reply of server ``server_id``, mapped before the copy thread's next copy."""
        with self._pending_lock:
            if not unless_pending or self._pending is None:
                self._pending = (reply, server_id)

    def remap_pending(self) -> bool:
        """Whether a newer registration waits to be mapped (by the copy thread)."""
        with self._pending_lock:
            return self._pending is not None

    @contextlib.contextmanager
    def for_engine(self) -> Iterator[_PoolMapping | None]:
        """The mapping the engine's thread may copy with, held until the block ends; None when
        there is none, or a newer one waits to be mapped by the copy thread."""
        remap_pending = self.remap_pending()
        with self.lock:
            yield None if remap_pending else self.mapping

    def current(self, layouts: Sequence[KVLayout]) -> _PoolMapping | None:
        """The mapped pool, first switching to a newly registered one (copy thread only; a
        registration before any ``layouts`` is dropped)."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None or not layouts:
            return self.mapping
        reply, server_id = pending
        if self.mapping is not None and self.mapping.server_id == server_id and self.mapping.path == reply.pool.path:
            return self.mapping
        try:
            pool = _PoolMapping(
                reply.pool.path, reply.pool.size, server_id, list(layouts), prefault=self.prefault,
                may_run=self.may_run,
            )  # fmt: skip
            pool.reservation_ttl = reply.reservation_ttl_s
        except (OSError, PoolError) as exc:
            log.warning("kvdepot worker could not map the pool %s: %s", reply.pool.path, exc)
            return self.mapping
        with self.lock:  # never under the engine thread's copy
            old, self.mapping = self.mapping, pool
            if old is not None:
                old.close()
        return pool

    def close(self) -> None:
        with self._pending_lock:
            pool, self.mapping = self.mapping, None
        if pool is not None:
            pool.close()


def _prefault(address: int, size: int, stop: threading.Event, may_run: threading.Event) -> None:
    """Maps the pool's pages into this process, a step at a time while ``may_run`` is set, until
    done or stopped."""
    import ctypes

    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    end = address + size  # an mmap starts on a page boundary, as madvise needs
    for at in range(address, end, PREFAULT_STEP):
        while not may_run.wait(PREFAULT_POLL_S):
            if stop.is_set():
                return
        if stop.is_set():
            return
        if madvise(at, min(PREFAULT_STEP, end - at), _MADV_POPULATE_WRITE) != 0:
            log.debug("kvdepot pool prefault stopped: %s", os.strerror(ctypes.get_errno()))
            return  # an older kernel (EINVAL): pages fault in on first use, as before
