"""The worker's mapping of the pool: real shared memory, prefaulted in the background."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvdepot.gpu import KVLayout
from kvdepot.vllm_connector._pool_mapping import PREFAULT_STEP, PoolSwitch, _PoolMapping

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SIZE = 32 << 20


@pytest.fixture
def pool_file() -> Iterator[Path]:
    """A file under /dev/shm allocated in full, as `kvdepot serve` makes its pool."""
    path = Path("/dev/shm") / f"kvdepot-test-pool-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, SIZE)
    finally:
        os.close(fd)
    yield path
    path.unlink()


def _mapped_kib(address: int) -> int:
    """Rss of the mapping that starts at `address`: pages present in this process's page tables."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if "-" in line.split(" ", 1)[0] and int(line.split("-", 1)[0], 16) == address:
            for entry in lines[i + 1 :]:
                if entry.startswith("Rss:"):
                    return int(entry.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


def _layout() -> KVLayout:
    return KVLayout.from_kv_caches({"layers.0": torch.zeros((4, 1, 16, 64), dtype=torch.float16)})


@pytest.mark.parametrize("prefault", [True, False])
def test_pool_pages_are_mapped_in_the_background(pool_file: Path, prefault: bool) -> None:
    """With prefault on, every page of the pool is in the worker's page tables soon after mapping,
    before any copy; with it off, none is until used. The bytes are not changed either way."""
    mapping = _PoolMapping(str(pool_file), SIZE, "server", [_layout()], prefault=prefault)
    try:
        address = mapping.tensor.data_ptr()
        if mapping.prefault is not None:
            mapping.prefault.join(30)
            assert not mapping.prefault.is_alive()
        mapped = _mapped_kib(address)
        if prefault:
            assert mapped == SIZE >> 10
        else:
            assert mapped < SIZE >> 12  # a few pages at most
        assert int(mapping.tensor.count_nonzero()) == 0
    finally:
        mapping.close()


def test_the_prefault_maps_nothing_while_the_engine_is_in_a_step(pool_file: Path) -> None:
    """While the worker says the engine is in a step, the prefault maps no page: each of its
    system calls holds the process's address-space lock, and a forward pass that maps or unmaps
    memory (torch's allocator does, for large tensors) would wait behind it. Between steps it
    goes on and maps the whole pool."""
    between_steps = threading.Event()  # cleared: a step is running
    mapping = _PoolMapping(str(pool_file), SIZE, "server", [_layout()], prefault=True, may_run=between_steps)
    try:
        address = mapping.tensor.data_ptr()
        assert mapping.prefault is not None
        time.sleep(1.0)  # time enough to map the whole pool many times over, were it allowed to
        assert mapping.prefault.is_alive()
        assert _mapped_kib(address) < PREFAULT_STEP >> 10
        between_steps.set()
        mapping.prefault.join(30)
        assert not mapping.prefault.is_alive()
        assert _mapped_kib(address) == SIZE >> 10
    finally:
        mapping.close()


def test_a_paused_prefault_stops_when_the_mapping_closes(pool_file: Path) -> None:
    """A prefault waiting for the engine's step to end still stops when the pool is unmapped."""
    mapping = _PoolMapping(str(pool_file), SIZE, "server", [_layout()], prefault=True, may_run=threading.Event())
    prefault = mapping.prefault
    assert prefault is not None
    mapping.close()
    prefault.join(30)
    assert not prefault.is_alive()


def _reply(path: Path | str, size: int = SIZE) -> Any:
    """What the worker's `PoolSwitch` reads of a `RegisterReply`."""
    return SimpleNamespace(pool=SimpleNamespace(path=str(path), size=size), reservation_ttl_s=3.0)


def test_the_pool_switch_maps_a_registration_on_the_copy_thread_and_swaps_on_a_restart(pool_file: Path) -> None:
    """A registration is mapped at the copy thread's next `current`; the same server's again keeps the
    mapping, a restarted server's (a new id) replaces it, and the old one is closed. While one waits,
    the engine's thread gets no mapping to copy with."""
    pools = PoolSwitch(prefault=False, may_run=threading.Event())
    layouts = [_layout()]
    try:
        pools.offer(_reply(pool_file), "s1")
        assert pools.remap_pending()
        with pools.for_engine() as pool:
            assert pool is None  # a newer mapping waits for the copy thread
        first = pools.current(layouts)
        assert first is not None
        assert (first.server_id, first.reservation_ttl, pools.remap_pending()) == ("s1", 3.0, False)
        with pools.for_engine() as pool:
            assert pool is first
        pools.offer(_reply(pool_file), "s1")
        assert pools.current(layouts) is first
        pools.offer(_reply(pool_file), "s2")
        second = pools.current(layouts)
        assert second is not first
        assert second is not None
        assert second.server_id == "s2"
        assert first.prefault is None
        assert not hasattr(first, "tensor")  # closed
    finally:
        pools.close()
    assert pools.mapping is None


def test_the_first_registration_waits_behind_a_reconnects(pool_file: Path) -> None:
    """The worker's own registration does not replace one a reconnect brought meanwhile (``unless_pending``)."""
    pools = PoolSwitch(prefault=False, may_run=threading.Event())
    try:
        pools.offer(_reply(pool_file), "restarted")
        pools.offer(_reply(pool_file), "old", unless_pending=True)
        pool = pools.current([_layout()])
        assert pool is not None
        assert pool.server_id == "restarted"
    finally:
        pools.close()


def test_a_pool_that_cannot_be_mapped_keeps_the_mapping_there_is(pool_file: Path, tmp_path: Path) -> None:
    """A registration whose pool file is gone is logged and dropped: the copies go on with the old mapping
    (or with none); and one that comes before the worker has any layout is dropped too."""
    pools = PoolSwitch(prefault=False, may_run=threading.Event())
    try:
        pools.offer(_reply(pool_file), "s1")
        assert pools.current([]) is None  # no layouts yet: nothing to map for
        assert not pools.remap_pending()
        pools.offer(_reply(pool_file), "s1")
        first = pools.current([_layout()])
        pools.offer(_reply(tmp_path / "gone"), "s2")
        assert pools.current([_layout()]) is first
    finally:
        pools.close()
