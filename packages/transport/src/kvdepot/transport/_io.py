"""The one background I/O thread per process that every client shares.

Only this thread touches client sockets. Other threads hand it work with `call_soon`,
which wakes it through an eventfd only when it is asleep in poll, so a busy loop pays no
system call per submission and an idle one wakes at once.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog
import zmq

log = structlog.get_logger(__name__)

# Upper bound on one poll, so a lost wake-up (there should be none) costs at most this.
MAX_POLL_S = 1.0


class TimerOwner(Protocol):
    """Something with deadlines the loop must honour (a client connection)."""

    def next_timer(self) -> float | None: ...

    def on_timer(self, now: float) -> None: ...


class IOLoop:
    """A daemon thread polling ZMQ sockets and running submitted callables in order."""

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
        self._commands: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._sleeping = False
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._readers: dict[Any, Callable[[], None]] = {}
        self._timers: set[TimerOwner] = set()
        self.thread = threading.Thread(target=self._run, name="kvdepot-transport-io", daemon=True)
        self.thread.start()

    # -- any thread ----------------------------------------------------------------------

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs `fn(*args)` on the I/O thread, after everything submitted before it."""
        self._commands.append((fn, args))
        if self._sleeping:
            os.eventfd_write(self._wake_fd, 1)

    def in_loop(self) -> bool:
        """True when called from the I/O thread itself."""
        return threading.current_thread() is self.thread

    # -- I/O thread only -----------------------------------------------------------------

    def add_reader(self, sock: Any, callback: Callable[[], None]) -> None:
        """Calls `callback()` whenever `sock` (a zmq socket or an fd) is readable."""
        self._readers[sock] = callback
        self._poller.register(sock, zmq.POLLIN)

    def remove_reader(self, sock: Any) -> None:
        """Stops watching `sock`."""
        if self._readers.pop(sock, None) is not None:
            self._poller.unregister(sock)

    def add_timers(self, owner: TimerOwner) -> None:
        """Asks the loop to honour `owner`'s deadlines."""
        self._timers.add(owner)

    def remove_timers(self, owner: TimerOwner) -> None:
        """Forgets `owner`'s deadlines."""
        self._timers.discard(owner)

    def _run(self) -> None:
        commands = self._commands
        while True:
            try:
                while commands:
                    fn, args = commands.popleft()
                    fn(*args)
                timeout = MAX_POLL_S
                if self._timers:
                    now = time.monotonic()
                    for owner in self._timers:
                        due = owner.next_timer()
                        if due is not None and due - now < timeout:
                            timeout = due - now
                self._sleeping = True
                if commands:
                    timeout = 0.0
                events = self._poller.poll(max(0, int(timeout * 1000 + 0.999)))
                self._sleeping = False
                for sock, _ in events:
                    if sock == self._wake_fd:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(self._wake_fd)
                        continue
                    reader = self._readers.get(sock)
                    if reader is not None:
                        reader()
                if self._timers:
                    now = time.monotonic()
                    for owner in list(self._timers):
                        due = owner.next_timer()
                        if due is not None and due <= now:
                            owner.on_timer(now)
            except Exception:  # the loop must outlive any one bad callback
                self._sleeping = False
                log.exception("io_loop_callback_failed")
