"""The shared-memory pool file: owner-only, fixed size, shared by mapping, removed on close."""

from __future__ import annotations

import os
import stat

import pytest

from kvdepot.server import PoolError, PoolMapping, SharedPool
from kvdepot.server._pool import remove_stale_pools


def test_pool_file_is_owner_only_and_fixed_size(tmp_path):
    """The pool file is created 0o600 with exactly the requested size."""
    with SharedPool.create(1 << 20, tmp_path) as pool:
        st = os.stat(pool.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 1 << 20


def test_client_mapping_sees_server_bytes_and_back(tmp_path):
    """Bytes written through a client mapping are visible to the server mapping and vice versa."""
    with SharedPool.create(1 << 16, tmp_path) as pool, PoolMapping(pool.path, pool.size) as client:
        client.write(4096, b"hello")
        view = pool.buffer
        assert bytes(view[4096:4101]) == b"hello"
        view[0:3] = b"abc"
        view.release()
        assert client.read(0, 3) == b"abc"


def test_close_removes_the_file(tmp_path):
    """Closing the pool deletes its file."""
    pool = SharedPool.create(1 << 16, tmp_path)
    path = pool.path
    pool.close()
    assert not path.exists()
    pool.close()  # idempotent


def test_mapping_refuses_out_of_range_slots(tmp_path):
    """A client cannot read or write outside the pool through PoolMapping."""
    with (
        SharedPool.create(1 << 16, tmp_path) as pool,
        PoolMapping(pool.path, pool.size) as client,
        pytest.raises(PoolError),
    ):
        client.view((1 << 16) - 2, 4)


def test_pool_larger_than_free_space_is_refused(tmp_path):
    """Asking for more than the filesystem holds fails with advice to lower --capacity."""
    with pytest.raises(PoolError, match="--capacity"):
        SharedPool.create(1 << 62, tmp_path)


def test_stale_pool_of_dead_server_is_removed(tmp_path):
    """A pool file, or slot-index file, left by a dead process of this user is deleted; a live one is kept."""
    dead = tmp_path / f"kvdepot-{os.getuid()}-999999999-abc123.pool"
    dead_index = tmp_path / f"kvdepot-{os.getuid()}-999999999-abc124.index"
    live = tmp_path / f"kvdepot-{os.getuid()}-{os.getppid()}-abc123.pool"
    for path in (dead, dead_index, live):
        path.write_bytes(b"x")
    assert sorted(remove_stale_pools(tmp_path)) == [dead, dead_index]
    assert live.exists()


def test_mapping_address_supports_native_copies(tmp_path):
    """`address` points at the mapping, so a native memmove lands in the pool."""
    import ctypes

    with SharedPool.create(1 << 16, tmp_path) as pool, PoolMapping(pool.path, pool.size) as client:
        data = ctypes.create_string_buffer(b"native", 6)
        ctypes.memmove(client.address + 128, data, 6)
        assert client.read(128, 6) == b"native"


@pytest.mark.parametrize("trap", ["readable by others", "another user's", "a symlink"])
def test_a_pool_file_that_is_not_this_users_alone_is_not_mapped(tmp_path, trap):
    """A client maps only a pool file of its own user, mode 0600, reached without a symlink: another
    one could be a trap that collects this user's KV bytes, or feeds it another's."""
    if trap == "another user's" and os.getuid() != 0:
        pytest.skip("giving a file to another user needs root")
    with SharedPool.create(8192, tmp_path) as pool:
        path = pool.path
        if trap == "readable by others":
            path.chmod(0o644)
        elif trap == "another user's":
            os.chown(path, 4242, 4242)
        else:
            path = tmp_path / "link.pool"
            path.symlink_to(pool.path)
        with pytest.raises(PoolError):
            PoolMapping(path, 8192)
