"""Frames to messages and back: msgpack via msgspec, with the frame size bounded first.

Decoding goes into exactly one expected type (`Request` on a server, `Reply` on a client);
anything else raises `RemoteProtocolError`, and a frame above the bound raises
`FrameTooLargeError` before a single byte of it is decoded.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from kvdepot.transport._errors import FrameTooLargeError, RemoteProtocolError
from kvdepot.transport._messages import Reply, Request

T = TypeVar("T")

# 16 MiB: a Lookup of 128 requests x 512 chunks (32 M tokens at 256 per chunk) is ~2.3 MB,
# so this leaves room for large steps while keeping a hostile frame's cost bounded.
DEFAULT_MAX_FRAME_BYTES = 16 << 20
# ZMQ's MAXMSGSIZE on both ends, as a multiple of the frame bound (a client also decodes replies
# up to it): zmq drops (and disconnects) frames above MAXMSGSIZE before handing them to us. Set it
# well above the codec bound so that ordinary oversized frames still get a typed `too_large`
# reply, while a hostile peer still cannot make libzmq allocate without bound.
HARD_LIMIT_FACTOR = 4


class _Envelope(msgspec.Struct, array_like=True):
    """Just the id of an envelope; the body is left undecoded."""

    id: int
    body: msgspec.Raw


class _BodyPeek(msgspec.Struct):
    """The tag of a body and, for Hello, the protocol version; every other field ignored."""

    type: str = ""
    protocol_version: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}
_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_peek_decoder = msgspec.msgpack.Decoder(_BodyPeek)


def _decoder(tp: type[T]) -> msgspec.msgpack.Decoder[T]:
    dec = _decoders.get(tp)
    if dec is None:
        dec = _decoders[tp] = msgspec.msgpack.Decoder(tp)
    return dec


def encode(message: Any, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Encodes a message; raises FrameTooLargeError if the frame would exceed the bound."""
    frame = _encoder.encode(message)
    if len(frame) > max_frame_bytes:
        raise FrameTooLargeError(
            f"a {type(message).__name__} frame of {len(frame)} bytes exceeds the limit of {max_frame_bytes};"
            " split the request into smaller batches",
            size=len(frame),
            limit=max_frame_bytes,
        )
    return frame


def decode(frame: bytes | memoryview, tp: type[T], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> T:
    """Decodes a frame into exactly `tp`, checking its size before decoding anything."""
    size = len(frame)
    if size > max_frame_bytes:
        raise FrameTooLargeError(
            f"received a frame of {size} bytes, above the limit of {max_frame_bytes}",
            size=size,
            limit=max_frame_bytes,
        )
    try:
        return _decoder(tp).decode(frame)
    except Exception as exc:  # DecodeError, ValidationError, and UnicodeDecodeError on bad UTF-8
        request_id, tag, version = peek(frame)
        raise RemoteProtocolError(
            f"malformed {tp.__name__} frame: {exc}",
            request_id=request_id,
            tag=tag,
            protocol_version=version,
        ) from exc


def peek(frame: bytes | memoryview) -> tuple[int | None, str | None, int | None]:
    """Best effort (id, body tag, Hello protocol_version) of a frame that failed to decode."""
    try:
        env = _envelope_decoder.decode(frame)
    except Exception:  # anything undecodable simply has no id
        return None, None, None
    request_id = env.id if 0 <= env.id < (1 << 63) else None
    try:
        body = _peek_decoder.decode(env.body)
    except Exception:  # same as above
        return request_id, None, None
    return request_id, body.type or None, body.protocol_version


def encode_request(request: Request, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """A Request envelope as one frame."""
    return encode(request, max_frame_bytes=max_frame_bytes)


def decode_request(frame: bytes | memoryview, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Request:
    """One frame as a Request envelope, or RemoteProtocolError / FrameTooLargeError."""
    return decode(frame, Request, max_frame_bytes=max_frame_bytes)


def encode_reply(reply: Reply, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """A Reply envelope as one frame."""
    return encode(reply, max_frame_bytes=max_frame_bytes)


def decode_reply(frame: bytes | memoryview, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Reply:
    """One frame as a Reply envelope, or RemoteProtocolError / FrameTooLargeError."""
    return decode(frame, Reply, max_frame_bytes=max_frame_bytes)
