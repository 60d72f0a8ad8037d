"""The remote tier's connection: one redis-py client, up or down, and the thread that brings it back.

The first connection error or timeout of any command marks the link DOWN (one warning,
``outages`` counted). While down, `current` is None, so the tier's reads miss and its writes
are dropped at once. A background thread tries a fresh client every ``retry_interval``
seconds and marks the link UP when the server answers; for a cluster, only when every node
reports ``cluster_state:ok``. Each client has a generation, so a failure seen on an old client
cannot mark a new one down. While up, the same thread refreshes the server's memory figures,
and pings the server as soon as a read's reply came too late (`suspect`): a hung server is
marked down within the op timeout, so later calls do not wait for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from kvdepot.server._remote_send import zero_copy_connection
from kvdepot.server._remote_url import RemoteAddress
from kvdepot.server._tiers import Counters, TierState, WarnLimiter
from kvdepot.transport import get_logger

log = get_logger(__name__)

# Seconds to open a connection: loopback and a LAN answer in well under a millisecond.
CONNECT_TIMEOUT = 0.5
# Seconds one command may wait on its socket; past that the server counts as slow, so down.
# Long enough for a batch of 8 MiB values over a 10 Gb/s link.
OP_TIMEOUT = 2.0
# Bytes redis-py receives from the socket at once (its default is 64 KiB). A 1 MiB value then
# takes 4 reads, each a poll and a recv under the socket timeout, instead of 16: remote reads of
# 1 MiB chunks ran 20-40% faster on a 2-core machine (`benchmarks/tier_bench.py`).
SOCKET_READ_BYTES = 256 << 10
# Seconds between two reconnection attempts while down.
RETRY_INTERVAL = 2.0
# Seconds between two refreshes of the server's memory figures while up.
STATS_INTERVAL = 5.0


def redis_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(errors that mean the server is down or slow, every error a command may raise)."""
    import redis
    from redis import exceptions

    down = (
        redis.ConnectionError,
        redis.TimeoutError,
        exceptions.ClusterError,
        exceptions.ClusterDownError,
        exceptions.RedisClusterException,  # "cannot be connected" with every node down; not a RedisError
        OSError,
    )
    return down, (*down, redis.RedisError)


class RemoteLink:
    """The client of the server at ``address``, while it answers."""

    def __init__(
        self,
        address: RemoteAddress,
        counters: Counters,
        *,
        ssl_ca_certs: str | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        op_timeout: float = OP_TIMEOUT,
        retry_interval: float = RETRY_INTERVAL,
    ) -> None:
        self.address = address
        self.ssl_ca_certs = ssl_ca_certs
        self.connect_timeout = connect_timeout
        self.op_timeout = op_timeout
        self.retry_interval = retry_interval
        #: Errors that mark the link down, and every error a command may raise.
        self.down_errors, self.errors = redis_errors()
        self.warn = WarnLimiter(log)
        self._counters = counters
        self._lock = threading.Lock()
        self._client: Any = None
        self._generation = 0  # bumped with every new client, so a stale failure cannot mark a new one down
        self._state = TierState.DOWN
        self._down_since = time.monotonic()
        self._server_figures: tuple[int | None, int | None, int | None] = (None, None, None)
        self._figures_at = 0.0
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._last_error = ""
        self._suspect: int | None = None  # the generation a late reply made suspect, checked next
        if not self._try_connect():
            log.warning("remote_tier_down", url=self.address.display, error=self._last_error, when="start")
            self._counters.add(outages=1)
        self._prober = threading.Thread(target=self._probe_loop, name="kvdepot-remote-probe", daemon=True)
        self._prober.start()

    @property
    def state(self) -> TierState:
        return self._state

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    @property
    def server_figures(self) -> tuple[int | None, int | None, int | None]:
        """The server's (memory limit, memory used, keys), None where unknown; refreshed while up."""
        return self._server_figures

    def current(self) -> tuple[Any, int] | None:
        """The client and its generation, or None while down."""
        with self._lock:
            if self._state is TierState.DOWN or self._client is None:
                return None
            return self._client, self._generation

    def failed(self, generation: int, exc: BaseException) -> bool:
        """A command of client ``generation`` raised ``exc``: mark the link down if it says so
        (True), else leave it up (False)."""
        if isinstance(exc, self.down_errors):
            self.mark_down(generation, exc)
            return True
        return False

    def mark_down(self, generation: int, exc: BaseException) -> None:
        with self._lock:
            if generation != self._generation or self._state is TierState.DOWN:
                return
            self._state = TierState.DOWN
            self._down_since = time.monotonic()
        self._counters.add(outages=1, errors=1)
        log.warning("remote_tier_down", url=self.address.display, error=describe(exc))
        self._wake.set()

    def suspect(self, generation: int) -> None:
        """A reply of client ``generation`` was not in by its caller's deadline: have the link's
        thread ask the server now, and mark the link down if it does not answer in time."""
        with self._lock:
            if generation != self._generation or self._state is TierState.DOWN:
                return
            self._suspect = generation
        self._wake.set()

    def wait_until_up(self, timeout: float) -> bool:
        """Block until the link is up (tests and start-up checks); False at the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._state is TierState.UP:
                return True
            self._wake.set()
            time.sleep(0.05)
        return self._state is TierState.UP

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._prober.join(timeout=5.0)
        with self._lock:
            client, self._client = self._client, None
            self._state = TierState.DOWN
        if client is not None:
            self._close_client(client)

    def _new_client(self) -> Any:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        common: dict[str, Any] = {
            "username": self.address.username,
            "password": self.address.password,
            "socket_timeout": self.op_timeout,
            "socket_connect_timeout": self.connect_timeout,
            "retry": Retry(NoBackoff(), 0),  # no hidden retries: a failure marks the tier down at once
            "client_name": "kvdepot",
            "socket_read_size": SOCKET_READ_BYTES,
        }
        if self.address.tls:
            common.update(ssl=True, ssl_ca_certs=self.ssl_ca_certs)
        else:
            common["connection_class"] = zero_copy_connection()
        if self.address.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            nodes: list[Any] = [ClusterNode(host, port) for host, port in self.address.nodes]  # type: ignore[no-untyped-call]
            if "connection_class" in common:
                # RedisCluster honours connection_class only for a client made from a URL.
                host, port = self.address.nodes[0]
                common["url"] = f"redis://[{host}]:{port}" if ":" in host else f"redis://{host}:{port}"
            cluster: Any = RedisCluster(
                startup_nodes=nodes,
                require_full_coverage=True,
                **common,
            )
            try:
                cluster.ping(target_nodes=RedisCluster.ALL_NODES)
                infos: dict[Any, Any] = cluster.cluster_info(target_nodes=RedisCluster.ALL_NODES)
                for info in infos.values():
                    if info.get("cluster_state") != "ok":
                        raise redis.exceptions.ClusterDownError("a node says the cluster is not ok")
            except BaseException:
                cluster.close()
                raise
            return cluster
        host, port = self.address.nodes[0]
        if self.address.tls:
            client: Any = redis.Redis(host=host, port=port, db=self.address.db, **common)
        else:
            pool = redis.ConnectionPool(host=host, port=port, db=self.address.db, **common)
            client = redis.Redis(connection_pool=pool)
        try:
            client.ping()
        except BaseException:
            client.close()
            raise
        return client

    def _try_connect(self) -> bool:
        """Open a fresh client and mark the link up when the server answers."""
        try:
            client = self._new_client()
        except self.errors as exc:
            self._last_error = describe(exc)
            return False
        with self._lock:
            old, self._client = self._client, client
            self._generation += 1
            self._state = TierState.UP
            down_for = time.monotonic() - self._down_since
        if old is not None:
            self._close_client(old)
        log.info("remote_tier_up", url=self.address.display, down_s=round(down_for, 3))
        return True

    @staticmethod
    def _close_client(client: Any) -> None:
        with contextlib.suppress(Exception):  # a broken client's close may fail too; it is dropped either way
            client.close()

    def _probe_loop(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.retry_interval)
            self._wake.clear()
            if self._closed.is_set():
                return
            try:
                if self.current() is None:
                    self._try_connect()
                elif self._suspect is not None:
                    self._check()
                elif time.monotonic() - self._figures_at >= STATS_INTERVAL:
                    self._refresh_figures()
            except Exception as exc:  # whatever the client raises, this thread must live to bring the link back
                self.warn("remote_tier_probe_failed", url=self.address.display, error=describe(exc))

    def _check(self) -> None:
        """Ping the suspect client's server (every primary of a cluster); down if one does not answer."""
        with self._lock:
            generation, self._suspect = self._suspect, None
            client = self._client if generation == self._generation else None
        if client is None:
            return
        try:
            if self.address.cluster:
                from redis.cluster import RedisCluster

                client.ping(target_nodes=RedisCluster.PRIMARIES)
            else:
                client.ping()
        except self.errors as exc:
            assert generation is not None
            self.mark_down(generation, exc)

    def _refresh_figures(self) -> None:
        """Memory and key counts of the server (all of it, other data included)."""
        current = self.current()
        if current is None:
            return
        client, generation = current
        try:
            if self.address.cluster:
                from redis.cluster import RedisCluster

                infos = list(client.info("memory", target_nodes=RedisCluster.PRIMARIES).values())
                objects = int(client.dbsize())
            else:
                infos = [client.info("memory")]
                objects = int(client.dbsize())
        except self.errors as exc:
            self.mark_down(generation, exc)
            return
        used = sum(int(i.get("used_memory", 0)) for i in infos)
        limits = [int(i.get("maxmemory", 0)) for i in infos]
        capacity = sum(limits) if all(limits) else None
        self._server_figures = (capacity, used, objects)
        self._figures_at = time.monotonic()


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
