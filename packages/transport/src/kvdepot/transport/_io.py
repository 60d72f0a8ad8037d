"""The one background I/O thread per process that every client shares, and its settler.

`IOLoop` is a plain asyncio event loop on a daemon thread; the ZMQ links register their
sockets' FDs with it (`add_reader`). Other threads hand it work with `call_soon`.

Futures (`ReplyFuture`, a plain `concurrent.futures.Future`) are settled on the loop, so a
thread waiting in `result()` wakes straight away; their done-callbacks run on another
thread, the `Settler`'s, so that they never run on the loop: a callback may block, or wait
on another reply (the loop settles it, not the settler), without stopping the loop that
would deliver that reply.

There is one settler thread per process, and it runs callbacks one at a time, in the order
the loop handed them over. So a callback must never wait on something that a later
callback does (it would wait until its own timeout, or forever), and a slow callback holds
up every later one of every client in the process.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

import zmq

from kvdepot.transport._log import get_logger
from kvdepot.transport._peercred import PeerUserCheck

log = get_logger(__name__)

SETTLER_THREAD_NAME = "kvdepot-transport-io"
LOOP_THREAD_NAME = "kvdepot-transport-loop"

# What the settler thread runs: a future's done-callback, or a client's `on_reconnect`
Callback = Callable[[], object]


class ReplyFuture(Future[Any]):
    """A `concurrent.futures.Future` whose done-callbacks run on the settler thread of `loop`
    (or at once, in the caller's thread, when it is done already, as for any future)."""

    def __init__(self, loop: IOLoop) -> None:
        super().__init__()
        self._io = loop

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        if self.done():
            super().add_done_callback(fn)
            return
        super().add_done_callback(lambda future: self._io.run_callback(fn, future))


def settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Settles `future` unless it is done already (cancelled by its owner)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


class Settler:
    """Runs callbacks, one at a time and in order, on a thread of its own (see the module docstring)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Callback]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=SETTLER_THREAD_NAME, daemon=True)
        self.thread.start()

    def put(self, callbacks: list[Callback]) -> None:
        """Queues callbacks, to run after everything queued before them (any thread)."""
        self._queue.put(callbacks)

    def _run(self) -> None:
        while True:
            for callback in self._queue.get():
                try:
                    callback()
                except Exception:
                    log.exception("client_callback_failed")


class IOLoop:
    """An asyncio loop on a daemon thread, shared by every client of the process."""

    _shared: IOLoop | None = None
    _shared_lock = threading.Lock()

    @classmethod
    def shared(cls) -> IOLoop:
        """The process-wide loop, started on first use (and again in a forked child)."""
        with cls._shared_lock:
            loop = cls._shared
            if loop is None or loop.pid != os.getpid() or not loop.thread.is_alive():
                loop = cls._shared = cls()
            return loop

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.context: zmq.Context[Any] = zmq.Context()
        self.loop = asyncio.new_event_loop()
        self.settler = Settler()
        self._peer_check: PeerUserCheck | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name=LOOP_THREAD_NAME, daemon=True)
        self.thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        self.loop.run_forever()

    def check_ipc_peers(self) -> None:
        """Runs the handler that lets ipc connections of this context reach only servers of
        this user or root (see `_peercred`); started once, on the first ipc connection."""
        with self._shared_lock:
            if self._peer_check is None:
                self._peer_check = PeerUserCheck(self.context, "client")

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs `fn(*args)` on the loop, after everything submitted before it (any thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def in_loop(self) -> bool:
        """True when called from the loop's thread itself."""
        return threading.current_thread() is self.thread

    def run_callback(self, fn: Callable[[Future[Any]], object], future: Future[Any]) -> None:
        """Runs a done-callback of `future` on the settler (from any thread)."""
        callbacks: list[Callback] = [lambda: fn(future)]
        if self.in_loop():
            self.run_callbacks(callbacks)
        else:
            self.call_soon(self.run_callbacks, callbacks)

    def run_callbacks(self, callbacks: list[Callback]) -> None:
        """Hands callbacks to the settler, to run in order after those handed over before."""
        self.settler.put(callbacks)
