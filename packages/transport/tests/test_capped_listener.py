"""A tcp server endpoint takes at most its cap of connections (`CappedListener`): it counts them,
closes those that never finish ZMTP's handshake, refuses no one below the cap, and ipc stays uncapped."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvdepot.transport as t
from kvdepot.transport import _capped_listener
from kvdepot.transport._capped_listener import tcp_listening_socket
from kvdepot.transport.testing import DictHandler, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

T = 10.0


@pytest.fixture
def serve() -> Iterator:
    """Start tcp endpoints on free loopback ports, served by threads; all closed at teardown."""
    started: list[tuple[t.ServerEndpoint, threading.Thread]] = []

    def start(**options) -> t.ServerEndpoint:
        endpoint = t.open_endpoint("tcp://127.0.0.1:0", DictHandler(), **options)
        thread = threading.Thread(target=endpoint.serve_forever, daemon=True)
        thread.start()
        started.append((endpoint, thread))
        return endpoint

    yield start
    for endpoint, thread in started:
        endpoint.close()
        thread.join(timeout=T)


def _port(endpoint: t.ServerEndpoint) -> int:
    return int(endpoint.address.rpartition(":")[2])


def test_a_tcp_endpoint_counts_its_connections_and_is_full_at_its_cap(serve):
    """Plain tcp connections up to the cap are counted; reaching it is counted once, and once they
    close the count goes back to none and a client is served."""
    endpoint = serve(max_connections=2)
    listener = endpoint.listener
    assert listener is not None
    assert listener.cap == 2
    peers = [socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=T) for _ in range(2)]
    try:
        assert wait_until(lambda: listener.connections == 2 and listener.refused["full"] == 1, T)
    finally:
        for peer in peers:
            peer.close()
    assert wait_until(lambda: listener.connections == 0, T)
    with t.CacheClient(endpoint.address, timeout=T) as client:
        assert isinstance(client.ping().result(T), t.Pong)
        assert listener.connections == 1
    assert listener.refused["full"] == 1


def test_a_silent_connection_is_closed_after_the_handshake_time(serve, monkeypatch):
    """A tcp peer that never sends ZMTP's greeting is closed after `HANDSHAKE_S` and counted as a
    handshake refusal: it holds a slot of the cap no longer."""
    monkeypatch.setattr(_capped_listener, "HANDSHAKE_S", 0.3)
    endpoint = serve(max_connections=8)
    listener = endpoint.listener
    assert listener is not None
    peer = socket.create_connection(("127.0.0.1", _port(endpoint)), timeout=T)
    try:
        while peer.recv(4096):  # the server's greeting, then the end of the connection
            pass
    finally:
        peer.close()
    assert wait_until(lambda: listener.connections == 0 and listener.refused["handshake"] == 1, T)


def test_ipc_endpoints_and_tcp_without_a_cap_have_no_listener(serve, tmp_path: Path):
    """ipc's directory is owner-only, so an ipc endpoint has no cap; `max_connections=None` turns
    the tcp cap off."""
    assert serve(max_connections=None).listener is None
    with t.open_endpoint(f"ipc://{tmp_path}/s.sock", DictHandler()) as endpoint:
        assert endpoint.listener is None


def test_a_tcp_endpoint_that_cannot_listen_says_where_and_why(serve):
    """A busy port is a TransportClosedError naming the address and the reason; an address that is
    not tcp://HOST:PORT a LocalProtocolError."""
    busy = serve()
    with pytest.raises(t.TransportClosedError, match="cannot listen on") as caught:
        t.open_endpoint(busy.address, DictHandler())
    assert caught.value.reason
    with pytest.raises(t.LocalProtocolError, match=r"give tcp://HOST:PORT"):
        tcp_listening_socket("tcp://127.0.0.1")
