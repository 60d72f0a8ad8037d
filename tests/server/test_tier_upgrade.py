"""Upgrades below RAM (issue 47): servers of two builds, one writing the next tier format
(`_future_format.py`), share one real Valkey in a rolling upgrade, and a disk directory
written by the newer build is opened by the older one (a downgrade). No server ever deletes an
object of a format it does not read; each hits its own.
"""

from __future__ import annotations

import contextlib
import struct
import sys
from pathlib import Path

import pytest
from _chunks import POOL, extra, keys, lookup, store, wait_for

from kvdepot.server import object_name
from kvdepot.server._tier_format import FORMAT_VERSION

pytestmark = pytest.mark.integration


#: `kvdepot serve` of a build one tier format ahead.
NEXT = (sys.executable, str(Path(__file__).with_name("_future_format.py")))


def versions(client, salt: str, chunk_keys: list[bytes]) -> list[int | None]:
    """The format version of each chunk's object in Valkey (None: absent)."""
    values = [client.get("kvd:" + object_name(salt, k)) for k in chunk_keys]
    return [None if v is None else struct.unpack_from("<H", v, 4)[0] for v in values]


def test_rolling_upgrade_with_a_shared_valkey(serve, workdir, valkey_server):
    """A server of today's format and one of the next store chunks in one Valkey. Each misses (or,
    the newer, reads) the other's, and neither deletes any; restarted with empty RAM, each hits all
    of its own from Valkey."""
    remote = ("--remote", valkey_server.url)
    old_keys, new_keys = keys("today", 4), keys("next", 4)
    today = serve(*POOL, *remote)
    future = serve(*POOL, *remote, command=NEXT, where=workdir / "next")
    store(today.address, "t", old_keys)
    store(future.address, "t", new_keys)
    wait_for(lambda: extra(today, "tier:remote:writes") == 4 and extra(future, "tier:remote:writes") == 4)
    with contextlib.closing(valkey_server.client()) as plain:
        assert versions(plain, "t", old_keys + new_keys) == [FORMAT_VERSION] * 4 + [FORMAT_VERSION + 1] * 4

        assert lookup(today.address, "t", new_keys) == (0, True)  # the next format: a miss, left alone
        assert versions(plain, "t", new_keys) == [FORMAT_VERSION + 1] * 4
        assert extra(today, "tier:remote:unknown_format") >= 1
        assert extra(today, "tier:remote:corrupt") == 0
        assert lookup(future.address, "t", old_keys) == (4, True)  # the newer build reads the older format
        assert extra(future, "tier:remote:corrupt") == 0

        today.stop()
        future.stop()
        today = serve(*POOL, *remote, where=workdir / "today-again")
        future = serve(*POOL, *remote, command=NEXT, where=workdir / "next-again")
        assert lookup(today.address, "t", old_keys) == (4, True)
        assert lookup(future.address, "t", new_keys) == (4, True)
        assert lookup(today.address, "t", new_keys) == (0, True)
        assert extra(today, "tier:remote:corrupt") == 0
        assert versions(plain, "t", old_keys + new_keys) == [FORMAT_VERSION] * 4 + [FORMAT_VERSION + 1] * 4


def test_a_downgraded_server_leaves_the_newer_disk_files_in_place(serve, workdir):
    """Files the next format's server wrote to a disk directory are left in place by a server of
    today's format started on it (misses, counted unknown_format), and hit again when the newer
    server comes back."""
    disk = ("--disk-dir", str(workdir / "disk"), "--disk-capacity", "64MiB")
    chunk_keys = keys("downgrade", 4)
    future = serve(*POOL, *disk, command=NEXT, where=workdir / "next")
    store(future.address, "t", chunk_keys)
    wait_for(lambda: extra(future, "tier:disk:objects") == 4)
    future.stop()
    files = sorted(p for p in (workdir / "disk" / "objects").rglob("*") if p.is_file())
    assert len(files) == 4

    older = serve(*POOL, *disk)
    assert lookup(older.address, "t", chunk_keys) == (0, True)
    assert sorted(p for p in (workdir / "disk" / "objects").rglob("*") if p.is_file()) == files
    assert (extra(older, "tier:disk:unknown_format"), extra(older, "tier:disk:corrupt")) == (4, 0)
    older.stop()
    assert sorted(p for p in (workdir / "disk" / "objects").rglob("*") if p.is_file()) == files

    again = serve(*POOL, *disk, command=NEXT, where=workdir / "next-again")
    assert lookup(again.address, "t", chunk_keys) == (4, True)
