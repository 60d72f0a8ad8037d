"""A kept pool's own file counts as room for the restart that adopts it (in-process servers)."""

from __future__ import annotations

import pytest

from kvdepot.server import _server
from kvdepot.server._errors import ServerArgumentError
from kvdepot.server._server import CacheServer, ServerConfig

MIB = 1 << 20


def test_a_kept_pool_larger_than_what_is_left_free_beside_it_restarts(tmp_path, monkeypatch):
    """The filesystem holding the pool has less free than its capacity once the pool takes its
    room: the next start still fits (the file is the new pool's), and adopts it."""
    address = f"ipc://{tmp_path}/s.sock"
    config = ServerConfig(address=address, capacity=8 * MIB, page_size=MIB, pool_dir=tmp_path, keep_pool=True)
    with CacheServer(config) as first:
        assert first.pool.keep
    monkeypatch.setattr(_server, "pool_dir_free_bytes", lambda _dir=None: 3 * MIB)  # the pool took the rest
    with CacheServer(config) as again:
        assert again.journal is not None
        assert again.adoption.fresh == ""
    bigger = ServerConfig(address=address, capacity=16 * MIB, page_size=MIB, pool_dir=tmp_path, keep_pool=True)
    with pytest.raises(ServerArgumentError, match=r"more than the 11\.0 MiB free"):  # 3 free and the old 8
        CacheServer(bigger)
