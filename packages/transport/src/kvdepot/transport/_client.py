"""The driver of one client connection: the sans-I/O `ClientConnection` on the shared I/O loop.

Any thread may `prepare` a call (it is encoded there), `submit` calls and `close`; the rest
runs on the loop (`_io.IOLoop`): the link reports what happened, the driver feeds it to the
connection with the time, then acts on the connection's events: send frames through the
link, settle futures (`concurrent.futures.Future`s whose done-callbacks run on the
settler thread, never on the loop), log notes, and keep one timer for the next deadline or heartbeat.
The bytes move through a link: `ZmqLink` (DEALER) or the in-memory link of `_memory`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from kvdepot.transport._address import MEMORY_SCHEME, check_ipc_trusted, default_address, ipc_path
from kvdepot.transport._codec import DEFAULT_MAX_FRAME_BYTES
from kvdepot.transport._connection import Call, ClientConnection, Note, Reconnected, Send, Settle, State
from kvdepot.transport._errors import TransportClosedError
from kvdepot.transport._io import Callback, IOLoop, ReplyFuture, settle
from kvdepot.transport._log import get_logger
from kvdepot.transport._messages import HelloReply, RegisterReply, RequestBody

log = get_logger(__name__)

# A client gives up on a reply after this long unless told otherwise: long enough for a
# loaded server, short enough that "nothing is listening" surfaces within seconds.
DEFAULT_TIMEOUT = 5.0
# Pings keep the server's view of us alive; the server's peer timeout is 10 s.
DEFAULT_HEARTBEAT_INTERVAL = 1.0

ReconnectCallback = Callable[[HelloReply, "RegisterReply | None"], None]

__all__ = ["DEFAULT_HEARTBEAT_INTERVAL", "DEFAULT_TIMEOUT", "Call", "Connection", "ReconnectCallback"]


class Link(Protocol):
    """Moves frames between a `Connection` and one server; every method runs on the loop.

    The link reports to the connection through `on_link_up`, `on_link_down`, `on_frames`
    and `on_security_failure`, also on the loop.
    """

    def open(self) -> None: ...

    def send(self, frames: list[bytes]) -> bool:
        """Sends one message; False if no server is connected (nothing was sent)."""
        ...

    def close(self) -> None: ...


class Connection:
    """One client's connection to one server (see the module docstring)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        client_name: str = "",
        auth_secret: str | None = None,
        curve_server_key: bytes | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_reconnect: ReconnectCallback | None = None,
    ) -> None:
        self.address = address or default_address()
        path = ipc_path(self.address)
        if path is not None:
            check_ipc_trusted(path)
        self.curve_server_key = curve_server_key
        self.client_name = client_name
        self.client_id = secrets.token_hex(16)
        self.max_frame_bytes = max_frame_bytes
        self.auth_secret = auth_secret or ""  # the shared secret this client presents
        self.on_reconnect = on_reconnect
        self.proto = ClientConnection(
            self.address,
            self.client_id,
            client_name,
            self.auth_secret,
            timeout,
            heartbeat_interval,
            max_frame_bytes,
            curve=curve_server_key is not None,
        )
        self._closed = False
        self._pid = os.getpid()  # a fork's child has no loop thread: the client is closed there
        self._closed_event = threading.Event()
        self._timer: asyncio.TimerHandle | None = None
        self._loop = IOLoop.shared()
        self._link: Link = self._make_link()
        self._loop.call_soon(self._open)

    def _make_link(self) -> Link:
        if self.address.startswith(MEMORY_SCHEME):
            from kvdepot.transport._memory import MemoryLink

            return MemoryLink(self, self._loop)
        from kvdepot.transport._zmq_link import ZmqLink

        return ZmqLink(self, self._loop)

    # -- what other threads read ---------------------------------------------------------

    @property
    def state(self) -> State:
        """Where the connection stands (`State`)."""
        return self.proto.state

    @property
    def server_id(self) -> str | None:
        """The id of the server from the last handshake."""
        return self.proto.server_id

    @property
    def stats(self) -> dict[str, int]:
        """Late replies, bad reply frames, reconnects."""
        return self.proto.stats

    # -- any thread ----------------------------------------------------------------------

    def prepare(self, body: RequestBody, timeout: float | None = None) -> Call:
        """A call for `body`, encoded now in the caller's thread; its future is `call.token`.

        A body that cannot be encoded gives a call that is done already, its future failed.
        """
        future: Future[Any] = ReplyFuture(self._loop)
        call = self.proto.prepare(body, timeout, time.monotonic(), future)
        if isinstance(call, Settle):
            settle(future, error=call.error)
            call.call.done = True
            return call.call
        return call

    def submit(self, calls: Sequence[Call]) -> None:
        """Sends prepared calls, in one message when the connection is ready."""
        live = [c for c in calls if not c.done and not c.token.done()]
        if not live:
            return
        if self._closed or os.getpid() != self._pid:
            error = self.proto.closed_error() if self._closed else self._forked_error()
            for call in live:
                settle(call.token, error=error)
            return
        self._loop.call_soon(self._submit, live)

    def close(self, timeout: float = 1.0) -> None:
        """Fails what is pending with TransportClosedError and closes the link."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # made before a fork: the loop thread it would wait for is the parent's
        if self._loop.in_loop():
            self._close()
        else:
            self._loop.call_soon(self._close)
            self._closed_event.wait(timeout)

    def _forked_error(self) -> TransportClosedError:
        return TransportClosedError(
            f"this client of {self.address} was made in process {self._pid}, before a fork: its I/O thread is "
            "not in this process; make a new CacheClient here",
            address=self.address,
        )

    # -- the loop: inputs ----------------------------------------------------------------

    def _open(self) -> None:
        if not self._closed:
            self._link.open()

    def _submit(self, calls: list[Call]) -> None:
        self.proto.submit(calls, time.monotonic())
        self._act()

    def on_link_up(self) -> None:
        """The link reached a server."""
        self.proto.link_up(time.monotonic())
        self._act()

    def on_link_down(self) -> None:
        """The link lost its server."""
        self.proto.link_down()
        self._act()

    def on_frames(self, frames: list[bytes]) -> None:
        """Reply frames from the server."""
        self.proto.frames_received(frames, time.monotonic())
        self._act()

    def on_security_failure(self, event: int) -> None:
        """The ZMQ security handshake failed (`event` is the monitor's)."""
        log.warning("client_security_handshake_failed", address=self.address, zmq_event=event)
        self.proto.security_failed(self._security_message())
        self._act()

    def _on_timer(self) -> None:
        self._timer = None
        self.proto.timer(time.monotonic())
        self._act()

    def _close(self) -> None:
        self.proto.close()
        self._act()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._link.close()
        self._closed_event.set()

    # -- the loop: acting on events ------------------------------------------------------

    def _act(self) -> None:
        """Does what the connection asked for since the last input."""
        proto = self.proto
        callbacks: list[Callback] = []
        unsent: list[Call] = []
        for event in proto.take_events():
            if type(event) is Settle:  # the waiter wakes now; callbacks go to the settler
                settle(event.call.token, event.result, event.error)
            elif type(event) is Send:
                if unsent or not self._link.send([c.frame for c in event.calls]):
                    unsent.extend(event.calls)  # and everything after it, in order
            elif type(event) is Reconnected:
                if self.on_reconnect is not None:
                    callbacks.append(_reconnect_callback(self.on_reconnect, event))
            elif type(event) is Note:
                getattr(log, event.level)(event.name, **event.fields)
        if unsent:
            proto.send_failed(unsent, time.monotonic())
        if callbacks:
            self._loop.run_callbacks(callbacks)
        self._schedule()

    def _schedule(self) -> None:
        """Keeps one timer, at the connection's next deadline or heartbeat."""
        if self._closed and self.proto.state is State.CLOSED:
            return
        due = self.proto.next_timer()
        timer = self._timer
        if timer is not None:
            if due is not None and due >= timer.when():
                return  # it fires first; `_on_timer` schedules the next
            timer.cancel()
            self._timer = None
        if due is not None:
            self._timer = self._loop.loop.call_at(due, self._on_timer)

    def _security_message(self) -> str:
        if self.curve_server_key is not None:
            return (
                "the ZMQ security handshake with the server failed; check that the client's curve_server_key"
                " is the server's public key and that both sides use CURVE"
            )
        if self.address.startswith("ipc://"):
            return (
                f"the peer at {self.address} runs as another user, or refused this one (each side of an ipc"
                " connection accepts only its own user or root)"
            )
        return (
            f"the kvdepot server at {self.address} refused the connection's security handshake: it checks a "
            f"shared secret (this client's is {'wrong' if self.auth_secret else 'missing'}; pass the server's as "
            "auth_secret) or uses CURVE (pass its public key as curve_server_key)"
        )


def _reconnect_callback(callback: ReconnectCallback, event: Reconnected) -> Callable[[], None]:
    """`callback` bound to a reconnect, to run on the settler (it logs what the callback raises)."""
    return lambda: callback(event.hello, event.register)
