"""The worker's mapping of the pool: real shared memory, prefaulted in the background."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvdepot.gpu import KVLayout
from kvdepot.vllm_connector._pool_mapping import PREFAULT_STEP, _PoolMapping

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
