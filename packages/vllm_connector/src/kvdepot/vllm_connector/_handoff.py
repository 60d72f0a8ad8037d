"""Prefill on one engine, decode on another: the handoff through kvdepot, in vLLM's proxy contract.

A proxy sends a request to the prefill engine (``kv_role: kv_producer``) with ``max_tokens=1``,
and passes the ``kv_transfer_params`` of that response into the same request on the decode
engine (``kv_role: kv_consumer``). The producer stores every full chunk of the prompt, as any
engine with kvdepot does, and answers with parameters naming the handoff: how many chunks the
decode side should find, and a digest of the key namespace they are under. The consumer keys
the prompt itself (same model, layout, salt: same keys), and while the server holds fewer of
those chunks than named (the producer's store may still be under way, or not written behind
to the remote tier yet), it tells vLLM "not yet" and looks again, until the chunks are there
or the deadline (``kvdepot.handoff_timeout``) passes; then it loads what is there and vLLM
computes the rest (a recompute, never a failed request). The chunks themselves never move
between the engines: on one node the decode engine copies them out of the same shared memory
the prefill engine copied them into.

The producer commits its chunks with a pin (``kvdepot.handoff_pin``): the server keeps them
from eviction for that long, so memory pressure between the prefill and the decode engine's
lookup cannot evict them; from the lookup on, the consumer's own lease holds them until loaded.
A decode that never comes costs the pinned bytes for that long, no more.

The last partial chunk of a prompt (its tokens past the last multiple of the chunk size) is
never stored, so the decode engine computes it: at most ``chunk_size - 1`` tokens of prefill.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from kvdepot.core import Namespace

#: The key of kvdepot's part of ``kv_transfer_params``.
PARAMS_KEY = "kvdepot"
#: Its format; a consumer ignores (and logs) a handoff of another version.
HANDOFF_VERSION = 1
#: Seconds a decode engine waits at most for a handoff's chunks (``kvdepot.handoff_timeout``).
DEFAULT_HANDOFF_TIMEOUT = 10.0
#: Seconds a prefill engine's stored chunks are kept from eviction (``kvdepot.handoff_pin``):
#: the time a decode engine may take to look them up; its own lookup's lease holds them after.
DEFAULT_HANDOFF_PIN = 10.0
#: Seconds between two lookups of a handoff whose chunks are not all there yet: the first look
#: again comes soon (on one node the prefill's last stores land within milliseconds of its
#: answer), and each later one twice as late, up to the last figure (a node whose chunks come
#: through Valkey waits for a write-behind and a read-through).
HANDOFF_FIRST_POLL_S = 0.002
HANDOFF_POLL_S = 0.02


def poll_interval(polls: int) -> float:
    """Seconds before the next lookup of a handoff already looked up again ``polls`` times."""
    return min(HANDOFF_POLL_S, HANDOFF_FIRST_POLL_S * (1 << min(polls, 16)))


def namespace_digest(namespace: Namespace, chunk_size: int) -> str:
    """What both engines must share for the consumer to find the producer's chunks: the key
    namespace (model, layout, KV world size, epoch) and the chunk size, as a short digest."""
    return hashlib.sha256(namespace.seed + chunk_size.to_bytes(8, "little")).hexdigest()[:32]


def handoff_params(digest: str, chunks: int) -> dict[str, Any]:
    """The producer's ``kv_transfer_params`` for a request whose first ``chunks`` chunks it stored."""
    return {PARAMS_KEY: {"version": HANDOFF_VERSION, "namespace": digest, "chunks": chunks}}


def expected_chunks(params: Mapping[str, Any] | None, digest: str) -> tuple[int, str | None]:
    """(chunks the producer stored, None) for a handoff meant for this consumer; (0, why not)
    for parameters that name none, or name one this engine cannot use."""
    part = (params or {}).get(PARAMS_KEY)
    if part is None:
        return 0, None
    if not isinstance(part, Mapping) or part.get("version") != HANDOFF_VERSION:
        return 0, f"kv_transfer_params[{PARAMS_KEY!r}] is not a kvdepot handoff of version {HANDOFF_VERSION}"
    if part.get("namespace") != digest:
        return 0, (
            "the prefill engine keys chunks under another namespace (another model, layout, KV world size, "
            "chunk size, or a cache reset)"
        )
    chunks = part.get("chunks")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
        return 0, f"kv_transfer_params[{PARAMS_KEY!r}]['chunks'] is not a count: {chunks!r}"
    return chunks, None
