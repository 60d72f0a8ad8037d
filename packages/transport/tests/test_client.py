"""The client against real sockets: fake servers, restarts under load, many threads, closing."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any

import pytest
import zmq
from structlog.testing import capture_logs

import kvdepot.transport as t
from kvdepot.transport._io import IOLoop, ReplyFuture
from kvdepot.transport.testing import DictHandler, MemoryPair, ZmqPair, key, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# A reply this slow arrives while the caller is surely blocked in result() (it was the
# window in which the old client let a blocked caller read its own reply).
WAIT_ON_CALLER_S = 0.05


class _FakeServer:
    """A bare ROUTER that answers Hello properly and everything else with what `answer` returns."""

    def __init__(self, address: str, answer: Any) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(address)
        self.address = address
        self.answer = answer
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            for frame in frames:
                req = t.decode_request(frame)
                if isinstance(req.body, t.Hello):
                    replies = [t.encode_reply(t.Reply(req.id, t.HelloReply(t.PROTOCOL_VERSION, "fake", "fake")))]
                else:
                    replies = self.answer(req)
                for reply in replies:
                    self.sock.send_multipart([ident, reply])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture
def ipc_address(tmp_path: Any) -> str:
    return f"ipc://{tmp_path}/s.sock"


def test_client_survives_bad_replies(ipc_address: str) -> None:
    """Garbage, unknown ids and wrong reply types are counted or typed; the client keeps working."""

    def answer(req: t.Request) -> list[bytes]:
        if isinstance(req.body, t.Stats):  # a reply of the wrong type
            return [t.encode_reply(t.Reply(req.id, t.Pong()))]
        return [
            b"\xffgarbage",
            t.encode_reply(t.Reply(req.id + 10_000, t.Pong())),
            t.encode_reply(t.Reply(req.id, t.Pong())),
        ]

    server = _FakeServer(ipc_address, answer)
    client = t.CacheClient(ipc_address, timeout=5)
    try:
        assert isinstance(client.ping().result(5), t.Pong)
        with pytest.raises(t.RemoteProtocolError, match="Stats with Pong"):
            client.stats().result(5)
        assert isinstance(client.ping().result(5), t.Pong)
        assert client.counters["bad_replies"] >= 2
        assert client.counters["late_replies"] >= 2
    finally:
        client.close(end_session=False)
        server.close()


def test_version_refusal_fails_fast_and_stays_failed(ipc_address: str) -> None:
    """A server refusing our version fails pending and later requests with VersionMismatchError."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(ipc_address)
    client = t.CacheClient(ipc_address, timeout=5)
    try:
        fut = client.ping()
        assert sock.poll(5000)
        ident, frame = sock.recv_multipart()
        req = t.decode_request(frame)
        refusal = t.ErrorReply("version_mismatch", "old", {"client_version": 1, "server_version": 2})
        sock.send_multipart([ident, t.encode_reply(t.Reply(req.id, refusal))])
        with pytest.raises(t.VersionMismatchError):
            fut.result(5)
        with pytest.raises(t.VersionMismatchError) as info:
            client.stats().result(5)
        assert info.value.server_version == 2
    finally:
        client.close(end_session=False)
        sock.close(0)
        ctx.term()


def test_closed_client_fails_pending_and_new_requests() -> None:
    """Closing fails what is waiting, and later calls, with TransportClosedError."""
    client = t.CacheClient(f"memory://nobody-{os.getpid()}", timeout=30)
    fut = client.ping()
    client.close()
    with pytest.raises(t.TransportClosedError):
        fut.result(5)
    with pytest.raises(t.TransportClosedError):
        client.stats().result(5)


def test_a_client_made_before_a_fork_fails_at_once_in_the_child(ipc_address: str) -> None:
    """A fork's child inherits the client but not its I/O thread: a request made there fails at
    once with TransportClosedError, and close() returns at once; the parent's client works on."""
    with ZmqPair(ipc_address) as pair:
        pair.start_server(DictHandler())
        client = pair.client()
        assert isinstance(client.ping().result(5), t.Pong)
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code, never return into pytest
            code = 1
            try:
                started = time.monotonic()
                try:
                    client.ping().result(5)
                except t.TransportClosedError as exc:
                    code = 0 if "before a fork" in str(exc) else 2
                client.close()
                code = code if time.monotonic() - started < 1.0 else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert isinstance(client.ping().result(5), t.Pong)


def test_too_large_request_fails_locally() -> None:
    """A request above max_frame_bytes fails its future with FrameTooLargeError, sending nothing."""
    with MemoryPair() as pair:
        pair.start_server(DictHandler())
        client = pair.client(max_frame_bytes=1024)
        with pytest.raises(t.FrameTooLargeError):
            client.reserve("s", [key(i) for i in range(100)], 1).result(5)
        assert isinstance(client.ping().result(5), t.Pong)


def test_all_clients_share_one_io_thread() -> None:
    """Creating clients does not create threads: one I/O thread serves them all."""
    with MemoryPair() as pair:
        pair.start_server(DictHandler())
        first = pair.client()
        first.ping().result(5)
        before = threading.active_count()
        clients = [pair.client() for _ in range(10)]
        for c in clients:
            c.ping().result(5)
        assert threading.active_count() == before
        assert sum(th.name == "kvdepot-transport-io" for th in threading.enumerate()) == 1
        assert IOLoop.shared().thread.is_alive()


@pytest.mark.slow
@pytest.mark.parametrize("make_pair", [MemoryPair, ZmqPair], ids=["memory", "ipc"])
def test_restart_under_load(make_pair: Any) -> None:
    """Several threads keep looking up through three server restarts; all recover and re-register."""
    with make_pair() as pair:
        pair.start_server(DictHandler())
        clients = [pair.client(timeout=1.0) for _ in range(3)]
        for i, c in enumerate(clients):
            c.register(f"layout-{i}", 256, 4096).result(5)
        stop = threading.Event()
        unexpected: list[BaseException] = []
        ok = [0] * 6

        def load(n: int) -> None:
            client = clients[n % 3]
            while not stop.is_set():
                try:
                    client.lookup([("s", [key(n)])]).result(5)
                    ok[n] += 1
                except (t.TransportBrokenError, t.DeadlineExceededError):
                    pass  # the server is down right now: a miss
                except BaseException as exc:
                    unexpected.append(exc)
                    return

        threads = [threading.Thread(target=load, args=(n,)) for n in range(6)]
        for th in threads:
            th.start()
        try:
            for _ in range(3):
                assert wait_until(lambda: min(ok) > 0)
                pair.stop_server()
                handler = DictHandler()
                pair.start_server(handler)
                ok[:] = [0] * 6
                assert wait_until(lambda: min(ok) > 0, timeout=10), ok
                for i, c in enumerate(clients):
                    assert handler.registered[c.client_id].layout == f"layout-{i}"
        finally:
            stop.set()
            for th in threads:
                th.join(10)
        assert not unexpected, unexpected[:3]


def run_in_threads(work: Any, count: int, *, timeout: float) -> list[BaseException]:
    """Run `work(n)` on `count` threads at once; what they raised (assertion failures included)."""
    errors: list[BaseException] = []

    def guarded(n: int) -> None:
        try:
            work(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(count)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
    return errors


@pytest.mark.parametrize("make_pair", [MemoryPair, ZmqPair], ids=["memory", "ipc"])
def test_many_threads_one_client(make_pair: Any) -> None:
    """Sixteen threads submitting through one client all get their own replies."""
    with make_pair() as pair:
        pair.start_server(DictHandler())
        client = pair.client()

        # Each reply lists every quota so far: 20 a thread keeps all the replies together (about
        # 1 MiB) under the 4 MiB the server lets a client leave unread, however late the client
        # reads them on a busy machine (100 a thread made 25 MiB, and a dropped peer under load).
        def work(n: int) -> None:
            futs = [client.set_quota(f"{n}-{j}", j) for j in range(20)]
            for j, f in enumerate(futs):
                assert f.result(10).quotas[f"{n}-{j}"] == j

        errors = run_in_threads(work, 16, timeout=30)
        assert not errors, errors[:3]
        assert len(client.get_quotas().result(5).quotas) == 320


def test_curve_encryption(tmp_path: Any) -> None:
    """With a CURVE key the server talks only to clients holding its public key; others get a clear error."""
    public, secret = zmq.curve_keypair()
    address = "tcp://127.0.0.1:0"
    endpoint = t.open_endpoint(address, DictHandler(), curve_secret_key=secret)
    thread = threading.Thread(target=endpoint.serve_forever, daemon=True)
    thread.start()
    good = t.CacheClient(endpoint.address, curve_server_key=public, timeout=5)
    wrong = t.CacheClient(endpoint.address, curve_server_key=zmq.curve_keypair()[0], timeout=1)
    plain = t.CacheClient(endpoint.address, timeout=1)
    try:
        assert isinstance(good.ping().result(5), t.Pong)
        with pytest.raises(t.DeadlineExceededError, match="security handshake"):
            wrong.ping().result(5)
        with pytest.raises(t.UnauthorizedError, match="curve_server_key"):
            plain.ping().result(5)
    finally:
        for c in (good, wrong, plain):
            c.close(end_session=False)
        endpoint.close()
        thread.join(5)


def _record_settling_thread(fut: Any, names: list[str]) -> None:
    """Appends to `names` the name of the thread that settles `fut` (its callbacks run there)."""
    fut.add_done_callback(lambda _f: names.append(threading.current_thread().name))


def test_blocked_caller_gets_its_reply_from_the_settler(ipc_address: str) -> None:
    """A thread blocked in result() gets its reply; done-callbacks run on the settler thread,
    never on the caller's or the I/O loop's."""

    def answer(req: t.Request) -> list[bytes]:
        time.sleep(0.005)  # the caller is surely blocked by the time the reply arrives
        return [t.encode_reply(t.Reply(req.id, t.Pong()))]

    server = _FakeServer(ipc_address, answer)
    client = t.CacheClient(ipc_address, timeout=5)
    try:
        client.ping().result(5)
        names: list[str] = []
        for _ in range(20):
            fut = client.ping()
            _record_settling_thread(fut, names)
            assert isinstance(fut.result(5), t.Pong)
        assert wait_until(lambda: len(names) == 20)  # callbacks run after the waiter wakes
        assert names == ["kvdepot-transport-io"] * 20, names
        assert IOLoop.shared().thread.name != "kvdepot-transport-io"
    finally:
        client.close(end_session=False)
        server.close()


def test_slow_reply_is_left_to_the_io_thread(ipc_address: str) -> None:
    """A slow reply is settled on the settler thread like any other; result() still gets it."""

    def answer(req: t.Request) -> list[bytes]:
        time.sleep(WAIT_ON_CALLER_S * 4)
        return [t.encode_reply(t.Reply(req.id, t.Pong()))]

    server = _FakeServer(ipc_address, answer)
    client = t.CacheClient(ipc_address, timeout=5)
    try:
        fut = client.ping()
        names: list[str] = []
        _record_settling_thread(fut, names)
        assert isinstance(fut.result(5), t.Pong)
        assert wait_until(lambda: len(names) == 1)
        assert names == ["kvdepot-transport-io"]
    finally:
        client.close(end_session=False)
        server.close()


def test_caller_wait_honours_timeouts_and_deadlines(ipc_address: str) -> None:
    """result(timeout) shorter than the reply raises TimeoutError and can be retried; a request
    past its deadline fails with DeadlineExceededError; exception() waits like result()."""
    release = threading.Event()

    def answer(req: t.Request) -> list[bytes]:
        if isinstance(req.body, t.Stats):
            return []  # never answered
        release.wait(5)
        return [t.encode_reply(t.Reply(req.id, t.ErrorReply("invalid_argument", "no")))]

    server = _FakeServer(ipc_address, answer)
    client = t.CacheClient(ipc_address, timeout=0.3)
    try:
        fut = client.request(t.Ping(), timeout=5)
        with pytest.raises(concurrent.futures.TimeoutError):
            fut.result(0.01)
        release.set()
        assert isinstance(fut.exception(5), t.RemoteInvalidArgumentError)
        with pytest.raises(t.DeadlineExceededError):
            client.stats().result(5)
        with pytest.raises(t.DeadlineExceededError):
            client.stats().result()
    finally:
        client.close(end_session=False)
        server.close()


def test_waiting_threads_take_each_others_replies(ipc_address: str) -> None:
    """Eight threads block on replies that come back in reverse order; every one gets its own."""
    lock = threading.Lock()
    held: list[t.Request] = []

    def answer(req: t.Request) -> list[bytes]:
        with lock:
            held.append(req)
            if len(held) < 8:
                return []
            batch = held[::-1]
            held.clear()
        return [t.encode_reply(t.Reply(r.id, t.QuotaReply({str(r.body.salt): 1}))) for r in batch]

    server = _FakeServer(ipc_address, answer)
    client = t.CacheClient(ipc_address, timeout=10)

    def work(n: int) -> None:
        for j in range(20):
            assert client.set_quota(f"{n}-{j}", 1).result(10).quotas == {f"{n}-{j}": 1}

    try:
        errors = run_in_threads(work, 8, timeout=60)
        assert not errors, errors[:3]
    finally:
        client.close(end_session=False)
        server.close()


def test_callback_may_wait_for_another_reply(ipc_address: str) -> None:
    """A done-callback run by a waiting thread may itself wait on a later reply without hanging."""

    def answer(req: t.Request) -> list[bytes]:
        time.sleep(0.02 if isinstance(req.body, t.Ping) else 0.2)
        body = t.Pong() if isinstance(req.body, t.Ping) else t.QuotaReply({})
        return [t.encode_reply(t.Reply(req.id, body))]

    server = _FakeServer(ipc_address, answer)
    client = t.CacheClient(ipc_address, timeout=10)
    seen: list[Any] = []
    try:
        client.ping().result(5)
        first = client.ping()
        second = client.get_quotas()
        first.add_done_callback(lambda _f: seen.append((threading.current_thread().name, second.result(5))))
        assert isinstance(first.result(5), t.Pong)
        # result() returns once the future is set; its callbacks run on the settler meanwhile
        assert wait_until(lambda: bool(seen), timeout=5), "the callback's wait timed out"
        assert isinstance(seen[0][1], t.QuotaReply)
    finally:
        client.close(end_session=False)
        server.close()


def test_callback_waiting_on_an_unanswered_request_gets_its_deadline(tmp_path: Any) -> None:
    """A done-callback that waits (no timeout) on a request the server never answers fails at
    that request's deadline; meanwhile another client of the process still gets a slow reply,
    which only the I/O thread can deliver."""

    def answer(req: t.Request) -> list[bytes]:
        if isinstance(req.body, t.Stats):
            return []  # never answered
        time.sleep(0.01)
        return [t.encode_reply(t.Reply(req.id, t.Pong()))]

    def slow(req: t.Request) -> list[bytes]:
        time.sleep(WAIT_ON_CALLER_S * 3)
        return [t.encode_reply(t.Reply(req.id, t.Pong()))]

    first_server = _FakeServer(f"ipc://{tmp_path}/a.sock", answer)
    second_server = _FakeServer(f"ipc://{tmp_path}/b.sock", slow)
    first = t.CacheClient(f"ipc://{tmp_path}/a.sock", timeout=0.3)
    second = t.CacheClient(f"ipc://{tmp_path}/b.sock", timeout=10)
    outcome: list[BaseException | None] = []

    def callback(_f: Any) -> None:
        try:
            first.stats().result()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        first.ping().result(5)
        fut = first.ping()
        fut.add_done_callback(callback)
        waiter = threading.Thread(target=fut.result, daemon=True)
        waiter.start()
        assert isinstance(second.ping().result(5), t.Pong)  # not starved by the waiting callback
        waiter.join(10)
        assert not waiter.is_alive()
        assert wait_until(lambda: len(outcome) == 1, timeout=5)  # the callback runs on the settler
        assert isinstance(outcome[0], t.DeadlineExceededError)
    finally:
        first.close(end_session=False)
        second.close(end_session=False)
        first_server.close()
        second_server.close()


def test_reply_future_is_a_full_concurrent_future() -> None:
    """The client hands out concurrent.futures.Futures (a subclass that only runs pending
    done-callbacks on the settler thread); stdlib wait/as_completed, cancel, callbacks and
    timeouts behave as for any of them."""
    with MemoryPair() as pair:
        pair.start_server(DictHandler())
        assert type(pair.client().ping()) is ReplyFuture

    def make() -> Any:
        return ReplyFuture(IOLoop.shared())

    late = make()
    threading.Timer(0.02, late.set_result, (3,)).start()
    assert late.result(5) == 3
    failing = make()
    threading.Timer(0.02, failing.set_exception, (ValueError("x"),)).start()
    done, _ = concurrent.futures.wait([failing], timeout=5)
    assert done == {failing}
    assert isinstance(failing.exception(), ValueError)
    with pytest.raises(ValueError, match="x"):
        failing.result()
    several = [make() for _ in range(3)]
    for i, fut in enumerate(several):
        threading.Timer(0.01 * i, fut.set_result, (i,)).start()
    assert sorted(f.result() for f in concurrent.futures.as_completed(several, timeout=5)) == [0, 1, 2]
    cancelled = make()
    assert cancelled.cancel()
    assert cancelled.done()
    with pytest.raises(concurrent.futures.CancelledError):
        cancelled.result(0)
    pending = make()
    with pytest.raises(concurrent.futures.TimeoutError):
        pending.result(0.01)
    seen: list[int] = []
    pending.add_done_callback(lambda f: seen.append(f.result()))
    pending.set_result(5)
    assert wait_until(lambda: seen == [5])  # on the settler thread
    pending.add_done_callback(lambda f: seen.append(f.result() + 1))  # already done: runs now
    assert seen == [5, 6]
    with pytest.raises(concurrent.futures.InvalidStateError):
        pending.set_result(6)


# How long a done-callback below waits for a later one before it gives up. The later one
# never runs meanwhile (one settler, one callback at a time), so this is only ever waited out.
WAIT_FOR_LATER_CALLBACK_S = 1.0


def test_done_callbacks_run_one_at_a_time_in_settling_order() -> None:
    """Done-callbacks run on one settler thread, in the order their futures were settled: one that
    waits on a later callback waits out its own timeout (no second settler runs the later one
    meanwhile), and then the rest follow in order."""
    later_ran = threading.Event()
    ran: list[int] = []
    threads: set[int] = set()
    waited_alone: list[bool] = []

    def first(_f: Any) -> None:
        threads.add(threading.get_ident())
        waited_alone.append(not later_ran.wait(WAIT_FOR_LATER_CALLBACK_S))
        ran.append(0)

    def later(i: int) -> Any:
        def callback(_f: Any) -> None:
            threads.add(threading.get_ident())
            later_ran.set()
            ran.append(i)

        return callback

    futures = [ReplyFuture(IOLoop.shared()) for _ in range(50)]
    futures[0].add_done_callback(first)
    for i, fut in enumerate(futures[1:], 1):
        fut.add_done_callback(later(i))
    for i, fut in enumerate(futures):
        fut.set_result(i)
    assert all(f.result(0) == i for i, f in enumerate(futures))  # settled at once, callbacks or not
    assert wait_until(lambda: len(ran) == 50, timeout=WAIT_FOR_LATER_CALLBACK_S + 10), ran
    assert waited_alone == [True]
    assert ran == list(range(50))
    assert len(threads) == 1


def test_a_batch_of_callbacks_runs_in_order_and_survives_a_failing_one() -> None:
    """A batch handed to the settler (a client's reconnect callbacks) runs in order after earlier
    batches; a callback that raises is logged and the ones after it still run."""
    loop = IOLoop.shared()
    ran: list[str] = []

    def fail() -> None:
        ran.append("fail")
        raise RuntimeError("boom")

    with capture_logs() as logs:
        loop.call_soon(loop.run_callbacks, [lambda: ran.append("a1"), fail, lambda: ran.append("a3")])
        loop.call_soon(loop.run_callbacks, [lambda: ran.append("b1"), lambda: ran.append("b2")])
        assert wait_until(lambda: len(ran) == 5, timeout=10), ran
    assert ran == ["a1", "fail", "a3", "b1", "b2"]
    assert [e["event"] for e in logs if e["event"] == "client_callback_failed"] == ["client_callback_failed"]


class _RecordingConn:
    """Stands in for `_client.Connection` behind a `ZmqLink`: records what the link reports."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.client_id = "edge-test"
        self.max_frame_bytes = 1 << 20
        self.auth_secret = ""
        self.curve_server_key = None
        self.up = threading.Event()
        self.replies: list[int] = []

    def on_frames(self, frames: list[bytes]) -> None:
        self.replies.extend(t.decode_reply(f).id for f in frames)

    def on_link_up(self) -> None:
        self.up.set()

    def on_link_down(self) -> None:
        self.up.clear()

    def on_security_failure(self, event: int) -> None:
        raise AssertionError(f"security handshake failed: {event}")


def test_a_send_never_strands_a_reply_that_arrived_before_it(ipc_address: str) -> None:
    """ZMQ_FD is edge-triggered and a send can consume the edge of a reply already waiting.
    Here each send runs on the loop after the previous reply has arrived and before the loop
    looked at the socket: every reply must still be read, with no later traffic to wake it."""
    from kvdepot.transport._zmq_link import ZmqLink

    server = _FakeServer(ipc_address, lambda req: [t.encode_reply(t.Reply(req.id, t.Pong()))])
    loop = IOLoop.shared()
    conn = _RecordingConn(ipc_address)
    link = ZmqLink(conn, loop)  # type: ignore[arg-type]
    sent: list[bool] = []

    def two_pings(first: int) -> None:
        sent.append(link.send([t.encode_request(t.Request(first, t.Ping()))]))
        time.sleep(0.02)  # its reply lands on the socket while the loop is busy here
        sent.append(link.send([t.encode_request(t.Request(first + 1, t.Ping()))]))  # takes the FD's edge

    try:
        loop.call_soon(link.open)
        assert conn.up.wait(5)
        for first in range(1, 21, 2):
            loop.call_soon(two_pings, first)
            assert wait_until(lambda n=first + 1: len(conn.replies) == n, timeout=2.0), conn.replies
        assert conn.replies == list(range(1, 21))
        assert all(sent)
    finally:
        loop.call_soon(link.close)
        server.close()
