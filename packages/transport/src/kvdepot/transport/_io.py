"""The one background I/O thread per process that every client shares.

Other threads hand it work with `call_soon`, which wakes it through an eventfd only when
it is asleep in poll, so a busy loop pays no system call per submission and an idle one
wakes at once.

Plain file descriptors (a DEALER's ZMQ_FD) are watched through an epoll set, which any
thread may change: a caller blocked on its own reply `mute`s the descriptor, reads the
reply itself, and the loop is not woken to fight it for the GIL (see `ZmqLink.wait`).
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog
import zmq

from kvdepot.transport._peercred import PeerUserCheck

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
        self._wake_at = math.inf  # when the loop means to wake from its poll; inf while it computes that
        self._timers_dirty = False  # a deadline came in while the loop computed its sleep
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll = select.epoll()
        self._poller = zmq.Poller()
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self._poller.register(self._epoll.fileno(), zmq.POLLIN)
        self._readers: dict[Any, Callable[[], None]] = {}  # zmq sockets
        self._fd_readers: dict[int, Callable[[], None]] = {}  # fds, in the epoll set
        self._fd_lock = threading.Lock()  # guards _fd_readers with the epoll set
        self._timers: set[TimerOwner] = set()
        self._peer_check: PeerUserCheck | None = None
        self.thread = threading.Thread(target=self._run, name="kvdepot-transport-io", daemon=True)
        self.thread.start()

    # -- any thread ----------------------------------------------------------------------

    def check_ipc_peers(self) -> None:
        """Runs the handler that lets ipc connections of this context reach only servers of
        this user or root (see `_peercred`); started once, on the first ipc connection."""
        with self._shared_lock:
            if self._peer_check is None:
                self._peer_check = PeerUserCheck(self.context, "client")

    def wake_by(self, when: float) -> None:
        """Makes the loop look at its timers again no later than `when` (time.monotonic()).

        A thread that tracks a new deadline without going through the loop calls this: the
        loop may be asleep until a later time it computed before the deadline existed.
        """
        if when < self._wake_at:
            self._timers_dirty = True
            if self._sleeping:
                os.eventfd_write(self._wake_fd, 1)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Runs `fn(*args)` on the I/O thread, after everything submitted before it."""
        self._commands.append((fn, args))
        if self._sleeping:
            os.eventfd_write(self._wake_fd, 1)

    def in_loop(self) -> bool:
        """True when called from the I/O thread itself."""
        return threading.current_thread() is self.thread

    def mute(self, fd: int, muted: bool) -> None:
        """Stops (or resumes) waking the loop when `fd`, added with `add_reader`, is readable.

        The fd's owner calls this, from any thread, and keeps the calls in order itself.
        """
        with self._fd_lock:
            if fd not in self._fd_readers:
                return
            try:  # noqa: SIM105 - contextlib.suppress costs three calls on this hot path
                self._epoll.modify(fd, 0 if muted else select.EPOLLIN)
            except (OSError, ValueError):  # the epoll set closed meanwhile
                pass

    # -- I/O thread only -----------------------------------------------------------------

    def add_reader(self, sock: Any, callback: Callable[[], None]) -> None:
        """Calls `callback()` whenever `sock` (a zmq socket or an fd) is readable."""
        if isinstance(sock, int):
            with self._fd_lock:
                self._fd_readers[sock] = callback
                self._epoll.register(sock, select.EPOLLIN)
            return
        self._readers[sock] = callback
        self._poller.register(sock, zmq.POLLIN)

    def remove_reader(self, sock: Any) -> None:
        """Stops watching `sock`."""
        if isinstance(sock, int):
            with self._fd_lock:
                if self._fd_readers.pop(sock, None) is not None:
                    self._epoll.unregister(sock)
            return
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
                self._wake_at = math.inf
                self._timers_dirty = False
                timeout = MAX_POLL_S
                now = time.monotonic()
                for owner in self._timers:
                    due = owner.next_timer()
                    if due is not None and due - now < timeout:
                        timeout = due - now
                self._wake_at = now + timeout
                self._sleeping = True
                if commands or self._timers_dirty:
                    timeout = 0.0
                events = self._poller.poll(max(0, int(timeout * 1000 + 0.999)))
                self._sleeping = False
                for sock, _ in events:
                    if sock == self._wake_fd:
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(self._wake_fd)
                        continue
                    if sock == self._epoll.fileno():
                        for fd, _ in self._epoll.poll(0):
                            fd_reader = self._fd_readers.get(fd)
                            if fd_reader is not None:
                                fd_reader()
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
