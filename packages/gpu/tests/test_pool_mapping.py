"""A pool mapped read-only (a reader's view of the server's pool): scatters read it, and a gather
into it is a typed error, not a SIGSEGV that kills the engine."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from kvdepot.gpu import PoolReadOnlyError
from kvdepot.gpu._copy import require_writable


def mapped(path, size: int, *, writable: bool) -> torch.Tensor:
    with open(path, "wb") as f:
        f.write(bytes(size))
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that a read-only buffer is not writable
        return torch.frombuffer(m, dtype=torch.uint8)


def test_the_memory_map_tells_a_read_only_pool_from_a_writable_one(tmp_path) -> None:
    require_writable(mapped(tmp_path / "rw", 1 << 16, writable=True))
    with pytest.raises(PoolReadOnlyError) as err:
        require_writable(mapped(tmp_path / "ro", 1 << 16, writable=False))
    assert "w" not in err.value.fields["permissions"]
    require_writable(torch.zeros(1 << 20, dtype=torch.uint8))  # anonymous memory
    require_writable(torch.zeros(0, dtype=torch.uint8))


def test_a_process_without_a_memory_map_is_not_checked(tmp_path) -> None:
    require_writable(mapped(tmp_path / "ro", 4096, writable=False), maps=str(tmp_path / "missing"))


def test_a_gather_into_a_read_only_pool_is_refused_and_a_scatter_from_it_works(tmp_path) -> None:
    """In a child process: on the old code the gather's store killed it with SIGSEGV."""
    code = textwrap.dedent(
        f"""
        import mmap, os, warnings, torch
        from kvdepot.gpu import KVLayout, PoolReadOnlyError, gather, open_copier, scatter
        warnings.simplefilter("ignore")
        kv = {{"l0": torch.randn(4, 2, 4, 8)}}
        layout = KVLayout.from_kv_caches(kv)
        size = layout.chunk_bytes(1) * 2
        path = {str(tmp_path / "pool")!r}
        with open(path, "wb") as f:
            f.write(os.urandom(size))
        fd = os.open(path, os.O_RDONLY)
        pool = torch.frombuffer(mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ), dtype=torch.uint8)
        for attempt in (lambda: gather(layout, [[1]], pool, [0]),
                        lambda: open_copier(layout, pool).gather([[1]], [0]).wait()):
            try:
                attempt()
                raise SystemExit("a gather into a read-only pool was not refused")
            except PoolReadOnlyError:
                pass
        before = kv["l0"].clone()
        scatter(layout, pool, [0], [[2]])
        assert not torch.equal(before[2], kv["l0"][2]), "the scatter did not write block 2"
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode} (negative: a signal): {proc.stderr[-600:]}"
    assert proc.stdout.strip().endswith("ok")
