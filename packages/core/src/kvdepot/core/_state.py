"""The request state machine: one table from (state, event) to the next state.

Everything that moves a request between states lives in this file. A pair that is
not in the table raises `InvalidTransitionError`; nothing is a silent no-op.
"""

from __future__ import annotations

import enum

from kvdepot.core._errors import InvalidTransitionError


class RequestState(enum.Enum):
    """Where a request stands in its life with the cache."""

    NEW = "new"  # tracked; no lookup sent yet
    PREFETCHING = "prefetching"  # lookup sent, reply pending
    LOOKED_UP = "looked_up"  # hit known, blocks not allocated yet
    WAITING_FOR_LOAD = "waiting_for_load"  # blocks allocated, chunks being loaded
    READY = "ready"  # running, nothing left to load
    PREEMPTED = "preempted"  # blocks taken back by the engine; will look up again
    FINISHED = "finished"
    ABORTED = "aborted"


class Event(enum.Enum):
    """What can happen to a request."""

    LOOKUP_SENT = "lookup_sent"
    LOOKUP_DONE = "lookup_done"
    ALLOCATED_WITH_LOAD = "allocated_with_load"
    ALLOCATED = "allocated"  # allocated, nothing to load
    SCHEDULED = "scheduled"
    LOAD_DONE = "load_done"
    LOAD_FAILED = "load_failed"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


S, E = RequestState, Event

#: The whole state machine. Finishing and aborting are allowed from every live state.
TRANSITIONS: dict[tuple[RequestState, Event], RequestState] = {
    (S.NEW, E.LOOKUP_SENT): S.PREFETCHING,
    (S.NEW, E.ALLOCATED): S.READY,  # the connector chose not to look up (not cacheable)
    (S.PREFETCHING, E.LOOKUP_DONE): S.LOOKED_UP,
    (S.LOOKED_UP, E.ALLOCATED_WITH_LOAD): S.WAITING_FOR_LOAD,
    (S.LOOKED_UP, E.ALLOCATED): S.READY,
    (S.LOOKED_UP, E.LOOKUP_SENT): S.PREFETCHING,  # the hit got old while waiting: ask again
    (S.WAITING_FOR_LOAD, E.SCHEDULED): S.WAITING_FOR_LOAD,
    (S.WAITING_FOR_LOAD, E.LOAD_DONE): S.READY,
    (S.WAITING_FOR_LOAD, E.LOAD_FAILED): S.READY,
    (S.WAITING_FOR_LOAD, E.PREEMPTED): S.PREEMPTED,
    (S.READY, E.SCHEDULED): S.READY,
    (S.READY, E.PREEMPTED): S.PREEMPTED,
    (S.PREEMPTED, E.LOOKUP_SENT): S.PREFETCHING,
    (S.PREEMPTED, E.ALLOCATED): S.READY,
}
for _state in (S.NEW, S.PREFETCHING, S.LOOKED_UP, S.WAITING_FOR_LOAD, S.READY, S.PREEMPTED):
    TRANSITIONS[_state, E.FINISHED] = S.FINISHED
    TRANSITIONS[_state, E.ABORTED] = S.ABORTED

TERMINAL = frozenset({S.FINISHED, S.ABORTED})


def next_state(req_id: str, state: RequestState, event: Event) -> RequestState:
    """The state after ``event``, or `InvalidTransitionError` if the table has no such move."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise InvalidTransitionError(
            f"request {req_id!r} cannot take event {event.value!r} in state {state.value!r}; "
            "this is a bug in the caller's event order",
            req_id=req_id,
            state=state.value,
            event=event.value,
        ) from None
