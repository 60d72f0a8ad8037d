"""The scheduler's record of one request: its lookup in flight, its hit, its handoff."""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs

from kvdepot.core import RequestState

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvdepot.vllm_connector._handoff_wait import HandoffWait

#: The planner's states of a request vLLM runs: its blocks are allocated (and loaded, or loading).
RUNNING = (RequestState.READY, RequestState.WAITING_FOR_LOAD)


@attrs.define
class Record:
    """The connector's one record of a request (the planner's tracker holds the accounting)."""

    request: Request
    #: The lookup in flight: the reply's future once sent, and where this request's items are.
    lookup: Future[Any] | None = None
    first_item: int = 0
    sent_at: float = 0.0
    server_id: str = ""
    #: The server's slot index was asked for this lookup (once: in the pass that sent it; later,
    #: chunks a tier below has read back into RAM meanwhile are the reply's to count).
    index_asked: bool = False
    #: The length of the hit's slots (the server's word; the worker checks it against its chunks).
    slot_bytes: int = 0
    #: A load of this request failed: it is never offered a hit again.
    load_failed: bool = False
    #: Its hit loads before the forward pass of the step that schedules it (`LoadOp.sync`).
    sync_load: bool = False
    #: Of its last lookup's hit: the chunk it ends at, and how many chunks before that end the
    #: server had just read back for it from each tier below RAM (the rest came from RAM).
    read_back: tuple[int, Mapping[str, int]] = (0, {})
    #: The keys of its last lookup, one list per KV rank (for its KV events).
    keys: list[list[bytes]] = attrs.Factory(list)
    #: A handed-over request (prefill elsewhere): its wait for the chunks its producer stored.
    handoff: HandoffWait | None = None
    #: How often a store of this request that a worker skipped was planned again (`STORE_AGAIN_MAX`).
    stores_again: int = 0
