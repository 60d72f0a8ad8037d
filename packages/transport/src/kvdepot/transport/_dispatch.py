"""The server side of the protocol without I/O: frames of one peer in, reply frames out.

`Dispatcher` owns the peer table (identity, liveness), checks Hello (version, secret),
calls the handler, and guarantees one reply frame per request frame, whatever the handler
or the peer does. The ZMQ and in-memory endpoints only move bytes and call it.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvdepot.core import InvalidArgumentError
from kvdepot.transport._codec import DEFAULT_MAX_FRAME_BYTES, decode_request, encode_reply
from kvdepot.transport._errors import (
    CODE_HELLO_REQUIRED,
    CODE_INTERNAL,
    CODE_INVALID_ARGUMENT,
    CODE_PROTOCOL,
    CODE_TOO_LARGE,
    CODE_UNAUTHORIZED,
    CODE_VERSION_MISMATCH,
    ERROR_CODES,
    FrameTooLargeError,
    RemoteProtocolError,
)
from kvdepot.transport._handler import BadFrame, Deferred, Handler, PeerInfo
from kvdepot.transport._log import get_logger
from kvdepot.transport._messages import (
    PROTOCOL_VERSION,
    REPLY_FOR,
    RESERVED_CLIENT_PREFIX,
    EndSession,
    ErrorReply,
    FieldValue,
    Hello,
    Ping,
    Pong,
    Reply,
    ReplyBody,
    Request,
    RequestBody,
)

log = get_logger(__name__)

# A peer silent for this long is reported gone. Clients ping every second by default, so
# this tolerates several lost heartbeats and a stalled (e.g. swapping) engine process.
DEFAULT_PEER_TIMEOUT = 10.0
# More request frames than this in one message is not a batch any client sends.
MAX_FRAMES_PER_MESSAGE = 4096
# Request bytes handled from one message, and reply bytes built for it (its first frame always
# is handled): the frames past either get `too_large`, so one message cannot hold the loop, and
# every other client, for long, nor make the server build a reply of hundreds of MiB (4,096
# Stats requests of 16 bytes each asked for 150 MiB). An engine step's batch is far smaller (a
# lookup key is 32 bytes, a slot in its reply about 12). A request whose work grows past its size
# (a `changes` reads up to 16,384 changes for 40 bytes) is charged that work too, as the handler's
# `work` says (`Handler`): the budget bounds what a message costs the loop, not only its bytes.
MAX_MESSAGE_BYTES = 4 << 20
# Bad frames logged one by one before logging thins out (the counter keeps counting).
LOGGED_BAD_FRAMES = 100
_PONG = Pong()


def _fields(values: dict[str, Any]) -> dict[str, FieldValue]:
    """Error fields as wire values: primitives stay, everything else becomes its str()."""
    out: dict[str, FieldValue] = {}
    for key, value in values.items():
        if value is None or isinstance(value, (str, int, float, bool)):
            out[str(key)] = value
        else:
            out[str(key)] = str(value)
    return out


def error_reply_from(exc: BaseException) -> ErrorReply:
    """The ErrorReply a handler exception turns into (see `Handler`)."""
    code = getattr(exc, "code", None)
    fields = getattr(exc, "fields", None)
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    if isinstance(code, str) and code in ERROR_CODES:
        return ErrorReply(code=code, message=message, fields=_fields(fields or {}))
    if isinstance(exc, InvalidArgumentError):
        return ErrorReply(code=CODE_INVALID_ARGUMENT, message=message, fields=_fields(fields or {}))
    return ErrorReply(
        code=CODE_INTERNAL,
        message=f"the server failed handling this request ({type(exc).__name__}: {exc}); see its log",
        fields={"exception": type(exc).__name__},
    )


def peek_id(frame: bytes) -> int:
    """The request id at the head of a frame without decoding the rest (0 if unreadable)."""
    if len(frame) < 2 or frame[0] != 0x92:  # fixarray of two: [id, body]
        return 0
    head = frame[1]
    if head < 0x80:
        return head
    width = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}.get(head)
    if width is None or len(frame) < 2 + width:
        return 0
    value = int.from_bytes(frame[2 : 2 + width], "big")
    return value if value < (1 << 63) else 0


@dataclass(slots=True)
class _Budget:
    """What is left of one message's budget: request bytes (and work), and reply bytes."""

    requests: int
    replies: int


class Dispatcher:
    """Peer table and request dispatch shared by every server endpoint."""

    def __init__(
        self,
        handler: Handler,
        *,
        clock: Callable[[], float],
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        peer_timeout: float = DEFAULT_PEER_TIMEOUT,
        auth_secret: str | None = None,
        on_bad_frame: Callable[[BadFrame], None] | None = None,
    ) -> None:
        self.handler = handler
        # Bytes of a message's budget a request uses beyond its frame (see `Handler`); optional.
        self._work: Callable[[RequestBody], int] | None = getattr(handler, "work", None)
        # Told of every refused frame (per-peer metrics); the counters count them either way.
        self.on_bad_frame = on_bad_frame
        self.clock = clock
        self.max_frame_bytes = max_frame_bytes
        self.peer_timeout = peer_timeout
        self._secret = auth_secret.encode() if auth_secret else None
        self.peers: dict[bytes, PeerInfo] = {}
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "messages",
                "requests",
                "errors",
                "bad_frames",
                "too_large",
                "work_refused",
                "version_mismatches",
                "unauthorized",
                "handler_failures",
                "peers_gone",
                "peers_dropped",
                "unread_discarded",
            ),
            0,
        )

    # -- one message ---------------------------------------------------------------------

    def dispatch(self, identity: bytes, frames: list[bytes], *, bad_allowed: int | None = None) -> list[bytes]:
        """Reply frames for one message of request frames, one per frame, in order, less the
        replies the handler deferred (`Deferred`). With ``bad_allowed``, the frames after the
        one that passes that many bad frames (not requests) are left unread and unanswered: the
        endpoint mutes such a peer (`PeerLimits.bad_frames`)."""
        self.counters["messages"] += 1
        now = self.clock()
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = now
        if not frames or len(frames) > MAX_FRAMES_PER_MESSAGE:
            self._count_bad(peer, identity, "frame_count", len(frames))
            return [
                self._encode(0, ErrorReply(CODE_PROTOCOL, f"a message must hold 1 to {MAX_FRAMES_PER_MESSAGE} frames"))
            ]
        budget = _Budget(MAX_MESSAGE_BYTES, MAX_MESSAGE_BYTES)
        out: list[bytes | None] = []
        counters = self.counters
        bad_before = counters["bad_frames"]
        for i, frame in enumerate(frames):
            if bad_allowed is not None and counters["bad_frames"] - bad_before > bad_allowed:
                break
            budget.requests -= len(frame)
            if i == 0 or (budget.requests >= 0 and budget.replies > 0):  # the first frame always is handled
                reply = self._one(identity, frame, now, budget, bounded=i > 0)
                budget.replies -= len(reply) if reply else 0
                out.append(reply)
                continue
            self.counters["too_large"] += 1
            message = (
                f"this message holds more than {MAX_MESSAGE_BYTES} bytes of requests or replies;"
                " send the rest in another"
            )
            out.append(self._encode(peek_id(frame), ErrorReply(CODE_TOO_LARGE, message)))
        return [frame for frame in out if frame is not None]

    def _one(self, identity: bytes, frame: bytes, now: float, budget: _Budget, *, bounded: bool) -> bytes | None:
        """The reply to one frame; its request's work is charged to ``budget``, and refused past
        it when ``bounded`` (every frame of a message but the first)."""
        self.counters["requests"] += 1
        try:
            request = decode_request(frame, max_frame_bytes=self.max_frame_bytes)
        except FrameTooLargeError as exc:
            self.counters["too_large"] += 1
            self._count_bad(self.peers.get(identity), identity, "too_large", len(frame))
            return self._encode(peek_id(frame), ErrorReply(CODE_TOO_LARGE, exc.message, _fields(exc.fields)))
        except RemoteProtocolError as exc:
            request_id = exc.fields.get("request_id") or 0
            if exc.fields.get("tag") == "hello" and exc.fields.get("protocol_version") not in (None, PROTOCOL_VERSION):
                return self._encode(request_id, self._version_mismatch(exc.fields["protocol_version"]))
            self._count_bad(self.peers.get(identity), identity, "malformed", len(frame))
            return self._encode(
                request_id, ErrorReply(CODE_PROTOCOL, f"{exc.message}; is the client the same protocol version?")
            )
        if self._work is not None and (work := self._work(request.body)):
            if bounded and work > budget.requests:
                self.counters["too_large"] += 1
                self.counters["work_refused"] += 1
                # No client of this protocol asks for more work than a message allows, frame after
                # frame: past `PeerLimits.bad_frames` of these, the peer is muted like a flood of
                # malformed frames (its refusals cost the loop a decode and a reply each).
                self._count_bad(self.peers.get(identity), identity, "work", len(frame))
                message = (
                    f"this {type(request.body).__name__} request would do {work} bytes' worth of work, and this"
                    f" message has {max(0, budget.requests)} left of its {MAX_MESSAGE_BYTES}; send it in another"
                    " message (or ask for less)"
                )
                fields: dict[str, FieldValue] = {
                    "work": work,
                    "left": max(0, budget.requests),
                    "budget": MAX_MESSAGE_BYTES,
                }
                return self._encode(request.id, ErrorReply(CODE_TOO_LARGE, message, fields))
            budget.requests -= work
        reply = self._handle(identity, request, now)
        if isinstance(reply, Deferred):
            reply.identity, reply.request_id, reply.request = identity, request.id, type(request.body)
            return None
        return self._encode(request.id, reply)

    def encode_deferred(self, deferred: Deferred, body: ReplyBody) -> bytes:
        """The reply frame that answers a deferred request at last."""
        assert deferred.request is not None, "a Deferred the handler never returned"
        if not isinstance(body, (REPLY_FOR[deferred.request], ErrorReply)):
            log.error("handler_reply_wrong_type", request=deferred.request.__name__, reply=type(body).__name__)
            body = ErrorReply(
                CODE_INTERNAL, f"the server answered {deferred.request.__name__} with {type(body).__name__}"
            )
        if isinstance(body, ErrorReply):
            self.counters["errors"] += 1
        return self._encode(deferred.request_id, body)

    def _handle(self, identity: bytes, request: Request, now: float) -> ReplyBody | Deferred:
        body = request.body
        peer = self.peers.get(identity)
        if isinstance(body, Hello):
            refusal = self._check_hello(body)
            if refusal is not None:
                return refusal
            if peer is None or peer.client_id != body.client_id:
                old, peer = peer, PeerInfo(body.client_id, body.client_name, body.protocol_version, identity, now, now)
                self.peers[identity] = peer
                log.info("peer_connected", peer=body.client_id, client_name=body.client_name)
                if old is not None:  # the same connection under a new client id: the old id's session ends
                    self._gone(old)
        elif peer is None:
            self.counters["errors"] += 1
            return ErrorReply(
                CODE_HELLO_REQUIRED, "this server does not know the client (it may have restarted); send Hello first"
            )
        peer.requests += 1
        if isinstance(body, Ping):
            return _PONG
        try:
            reply = self.handler.handle(peer, body)
        except Exception as exc:  # every failure becomes an ErrorReply, never silence
            reply = error_reply_from(exc)
            if reply.code == CODE_INTERNAL:
                self.counters["handler_failures"] += 1
                log.exception("handler_failed", peer=peer.client_id, request=type(body).__name__)
        if isinstance(reply, Deferred):
            return reply
        if not isinstance(reply, (REPLY_FOR[type(body)], ErrorReply)):
            self.counters["handler_failures"] += 1
            log.error("handler_reply_wrong_type", request=type(body).__name__, reply=type(reply).__name__)
            reply = ErrorReply(
                CODE_INTERNAL, f"the server answered {type(body).__name__} with {type(reply).__name__}; a server bug"
            )
        if isinstance(reply, ErrorReply):
            self.counters["errors"] += 1
        elif isinstance(body, EndSession):
            self.peers.pop(identity, None)
            log.info("peer_ended_session", peer=peer.client_id)
        return reply

    def _check_hello(self, hello: Hello) -> ErrorReply | None:
        if hello.protocol_version != PROTOCOL_VERSION:
            return self._version_mismatch(hello.protocol_version)
        if hello.client_id.startswith(RESERVED_CLIENT_PREFIX):
            self.counters["errors"] += 1
            log.warning("peer_reserved_id", client_id=hello.client_id)
            return ErrorReply(
                CODE_INVALID_ARGUMENT,
                f"client ids starting with {RESERVED_CLIENT_PREFIX!r} are the server's own; choose another "
                "(CacheClient picks random hex)",
            )
        if self._secret is not None and not hmac.compare_digest(hello.auth.encode(), self._secret):
            self.counters["unauthorized"] += 1
            log.warning("peer_unauthorized", peer=hello.client_id)
            return ErrorReply(
                CODE_UNAUTHORIZED, "this server requires a shared secret; pass the server's auth_secret to the client"
            )
        return None

    def _version_mismatch(self, client_version: object) -> ErrorReply:
        self.counters["version_mismatches"] += 1
        self.counters["errors"] += 1
        return ErrorReply(
            CODE_VERSION_MISMATCH,
            f"client speaks kvdepot protocol {client_version}, this server speaks {PROTOCOL_VERSION};"
            " install matching kvdepot-transport versions on both sides",
            {
                "client_version": client_version if isinstance(client_version, int) else None,
                "server_version": PROTOCOL_VERSION,
            },
        )

    def _count_bad(self, peer: PeerInfo | None, identity: bytes, reason: str, size: int) -> None:
        self.counters["bad_frames"] += 1
        self.counters["errors"] += 1
        count = self.counters["bad_frames"]
        label = peer.client_id if peer else identity.hex()
        if count <= LOGGED_BAD_FRAMES or count & (count - 1) == 0:  # a flood logs at powers of two
            log.warning("bad_frame_received", peer=label, reason=reason, size=size, bad_frames=count)
        if self.on_bad_frame is not None:
            try:
                self.on_bad_frame(BadFrame(label, reason, size))
            except Exception:
                log.exception("bad_frame_callback_failed", peer=label)

    def _encode(self, request_id: int, body: ReplyBody) -> bytes:
        try:
            return encode_reply(Reply(request_id, body), max_frame_bytes=self.max_frame_bytes)
        except FrameTooLargeError as exc:
            log.error("reply_too_large", request_id=request_id, size=exc.fields.get("size"))
            return encode_reply(Reply(request_id, ErrorReply(CODE_TOO_LARGE, f"the reply is too large: {exc.message}")))
        except Exception as exc:  # a handler built an unencodable reply
            log.exception("reply_encode_failed", request_id=request_id)
            return encode_reply(Reply(request_id, ErrorReply(CODE_INTERNAL, f"the server built a bad reply: {exc}")))

    # -- liveness ------------------------------------------------------------------------

    def expire(self) -> None:
        """Reports every peer silent for longer than `peer_timeout` as gone, once."""
        deadline = self.clock() - self.peer_timeout
        for identity, peer in list(self.peers.items()):
            if peer.last_seen < deadline:
                del self.peers[identity]
                log.info("peer_gone", peer=peer.client_id, silent_s=round(self.clock() - peer.last_seen, 3))
                self._gone(peer)

    def forgive(self) -> None:
        """The server itself did not run until now (stopped, suspended, swapped out): count every
        peer as heard from now, so that none is taken for gone for the server's own silence.
        What the peers sent meanwhile is read next; a peer that is really gone is gone one
        `peer_timeout` later."""
        now = self.clock()
        for peer in self.peers.values():
            peer.last_seen = max(peer.last_seen, now)

    def drop(self, identity: bytes) -> None:
        """Forget the peer at ``identity`` now (it misbehaved); its session ends as if it left."""
        peer = self.peers.pop(identity, None)
        if peer is not None:
            self._gone(peer)

    def _gone(self, peer: PeerInfo) -> None:
        """Tell the handler that ``peer`` (no longer in the table) is gone: its session ends."""
        self.counters["peers_gone"] += 1
        try:
            self.handler.peer_gone(peer)
        except Exception:
            log.exception("peer_gone_handler_failed", peer=peer.client_id)

    def next_expiry(self) -> float | None:
        """When `expire` may next have something to do (monotonic), or None without peers."""
        if not self.peers:
            return None
        return min(p.last_seen for p in self.peers.values()) + self.peer_timeout
