"""Request and answer bodies of `kvdepot proxy`, rewritten without being built as Python objects.

The proxy changes only top-level fields of a request (``max_tokens``, ``stream``,
``kv_transfer_params``, ...), so it reads a body as a map from field names to raw JSON values
(`msgspec.Raw`, slices of the body it came in): the values are checked as JSON but never
decoded. A body of 8 MiB is read and written again in tens of milliseconds and in memory about
its own size, where decoding it into Python objects took ten times its size and seconds of the
event loop. JSON nested deeper than Python's recursion limit, or not JSON at all, is a
`BadJSONError` (a 400).
"""

from __future__ import annotations

import msgspec

from kvdepot.core import KVDepotError
from kvdepot.vllm_connector._proxy_guard import BadJSONError

_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENCODER = msgspec.json.Encoder()
_NULL = b"null"
_ONE = msgspec.Raw(b"1")
_FALSE = msgspec.Raw(b"false")
_REMOTE_DECODE = msgspec.Raw(b'{"do_remote_decode":true}')

Fields = dict[str, msgspec.Raw]


class BadAnswerError(KVDepotError):
    """A prefill server's answer that is not a JSON object."""


class _PrefillAnswer(msgspec.Struct):
    kv_transfer_params: msgspec.Raw = msgspec.Raw(_NULL)


_ANSWER = msgspec.json.Decoder(_PrefillAnswer)


def parse_request(body: bytes) -> Fields:
    """The top-level fields of a request body, each value as raw JSON; BadJSONError where it is not an object."""
    try:
        return _FIELDS.decode(body)
    except RecursionError:
        raise BadJSONError("the request body nests JSON arrays or objects too deep to read") from None
    except msgspec.ValidationError:
        raise BadJSONError("the request body is not a JSON object") from None
    except msgspec.DecodeError as exc:
        raise BadJSONError(f"the request body is not JSON: {exc}") from None


def prefill_request(fields: Fields) -> bytes:
    """The request for the prefill server: one token, no stream, and ``do_remote_decode``."""
    out = {name: value for name, value in fields.items() if name not in ("stream_options", "kv_transfer_params")}
    out["max_tokens"] = _ONE
    out["stream"] = _FALSE
    out["kv_transfer_params"] = _REMOTE_DECODE
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = _ONE
    return _ENCODER.encode(out)


def decode_request(fields: Fields, params: msgspec.Raw | None) -> bytes:
    """The client's request for the decode server, with the prefill's ``kv_transfer_params`` (never the client's)."""
    out = {name: value for name, value in fields.items() if name != "kv_transfer_params"}
    if params is not None:
        out["kv_transfer_params"] = params
    return _ENCODER.encode(out)


def transfer_params(answer: bytes) -> msgspec.Raw | None:
    """The ``kv_transfer_params`` of a prefill server's answer, as raw JSON; None where it has none."""
    try:
        params = _ANSWER.decode(answer).kv_transfer_params
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadAnswerError(f"the answer is not a JSON object: {exc!r}") from None
    return None if bytes(params) == _NULL else params
