"""A reserve names the server instance whose pool the client mapped; another instance refuses it."""

from __future__ import annotations

import pytest

from kvdepot.transport import CacheClient, StalePoolError

CHUNK = 1000
T = 5.0


def test_reserve_for_another_servers_pool_is_refused(make_server):
    """After a restart a client that still maps the old pool gets stale_pool, and nothing is reserved."""
    server = make_server()
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        current = client.server_id
        assert current
        with pytest.raises(StalePoolError) as info:
            client.reserve("", [b"\x01" * 32], CHUNK, server_id="an-older-server").result(T)
        assert info.value.fields["expected"] == current
        assert client.stats().result(T).reservations == 0
        ok = client.reserve("", [b"\x01" * 32], CHUNK, server_id=current).result(T)
        assert len(ok.slots) == 1
        unchecked = client.reserve("", [b"\x02" * 32], CHUNK).result(T)
        assert len(unchecked.slots) == 1


def test_leases_left_at_session_end_are_counted(make_server):
    """Leases a client never released are reclaimed when it leaves, and Stats counts them."""
    server = make_server()
    with CacheClient(server.address, timeout=T) as writer:
        writer.register("layout", 256, CHUNK).result(T)
        res = writer.reserve("", [b"\x03" * 32], CHUNK).result(T)
        writer.commit(res.reservation_id).result(T)
    reader = CacheClient(server.address, timeout=T)
    (hit,) = reader.lookup([("", [b"\x03" * 32])]).result(T).results
    assert hit.num_hits == 1
    reader.close()  # ends its session with the lease still held
    with CacheClient(server.address, timeout=T) as probe:
        extra = probe.stats().result(T).extra
    assert extra["reclaimed_leases"] == 1
    assert extra["reclaimed_reservations"] == 0


def test_admin_requests_over_tcp_without_a_secret_are_refused(make_server):
    """On tcp without a shared secret any local user could connect: clear, set_quota and get_quotas
    (it names every tenant's salt) are refused (typed, nothing changes), while stores and lookups
    go on; with a secret they are allowed."""
    import socket

    from kvdepot.transport import UnauthorizedError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = make_server(address=f"tcp://127.0.0.1:{port}")
    with CacheClient(server.address, timeout=T) as client:
        client.register("layout", 256, CHUNK).result(T)
        client.commit(client.reserve("", [b"\x05" * 32], CHUNK).result(T).reservation_id).result(T)
        with pytest.raises(UnauthorizedError, match="auth-secret-file"):
            client.clear().result(T)
        with pytest.raises(UnauthorizedError):
            client.set_quota("tenant", 0).result(T)
        with pytest.raises(UnauthorizedError):
            client.get_quotas().result(T)
        assert client.stats().result(T).chunks == 1
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    secured = make_server(address=f"tcp://127.0.0.1:{port}", auth_secret="s3cret")
    with CacheClient(secured.address, timeout=T, auth_secret="s3cret") as owner:
        assert owner.clear().result(T).removed == 0
