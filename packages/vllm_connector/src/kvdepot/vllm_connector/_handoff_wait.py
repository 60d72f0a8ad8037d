"""A decode engine's wait for the chunks its prefill engine stored: a small machine, no I/O, no clock.

A handed-over request (`_handoff.py`) names how many chunks its producer stored. Each time vLLM
asks the scheduler side for the request's match, the wait is fed what the last lookup found
(``have`` tokens), the time, and when that lookup went out; `HandoffWait.step` sees one of
`Seen` and moves by `TRANSITIONS` to its next `State`, returning a `Decision`: load what the
hit holds (DONE), tell vLLM "not yet" (WAIT), look again and tell it "not yet" (POLL), or stop
waiting for good because the deadline passed (GIVE_UP: vLLM computes what is missing). The
scheduler side supplies the clock, sends the lookups and counts. Everything that moves the
wait lives in this file.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from kvdepot.vllm_connector._handoff import expected_chunks, poll_interval


class State(enum.Enum):
    """Where a handed-over request's wait stands."""

    WAITING = "waiting"  # it waits whenever the server holds fewer of its chunks than were stored
    LATE = "late"  # its deadline passed: it never waits again (final)


class Seen(enum.Enum):
    """What the wait sees when vLLM asks for the request's match (first that applies)."""

    ARRIVED = "arrived"  # the hit reaches every token the producer stored
    DEADLINE = "deadline"  # it does not, and the deadline has passed
    POLL_DUE = "poll_due"  # ... and the poll interval has passed since the last lookup went out
    NOT_YET = "not_yet"  # ... and it has not


class Decision(enum.Enum):
    """What the scheduler side does with the request now."""

    DONE = "done"  # load what the hit holds
    WAIT = "wait"  # tell vLLM "not yet"
    POLL = "poll"  # look the request up again, and tell vLLM "not yet"
    GIVE_UP = "give_up"  # the deadline passed: say so, and load what the hit holds

    @property
    def waits(self) -> bool:
        """Whether vLLM is told "not yet"."""
        return self in (Decision.WAIT, Decision.POLL)


@attrs.frozen
class Move:
    """What a (state, seen) pair does: the next state, and the decision."""

    state: State
    decision: Decision


S, In, D = State, Seen, Decision

#: The whole machine; a pair missing here is a bug (`move` asserts). Nothing leaves LATE.
TRANSITIONS: dict[tuple[State, Seen], Move] = {
    (S.WAITING, In.ARRIVED): Move(S.WAITING, D.DONE),  # a later lookup (a preemption) may find less: wait again
    (S.WAITING, In.DEADLINE): Move(S.LATE, D.GIVE_UP),
    (S.WAITING, In.POLL_DUE): Move(S.WAITING, D.POLL),
    (S.WAITING, In.NOT_YET): Move(S.WAITING, D.WAIT),
}
for _seen in Seen:
    TRANSITIONS[S.LATE, _seen] = Move(S.LATE, D.DONE)


def move(state: State, seen: Seen) -> Move:
    """What ``seen`` does to a wait in ``state``; a pair missing from `TRANSITIONS` is a bug in this file."""
    found = TRANSITIONS.get((state, seen))
    assert found is not None, f"a handoff wait cannot take {seen.value!r} in state {state.value!r}"
    return found


@attrs.define
class HandoffWait:
    """A handed-over request's wait: the tokens its producer stored that it may load, until when
    (monotonic) it waits for them, its state, and how many lookups it sent again meanwhile."""

    tokens: int
    deadline: float
    state: State = State.WAITING
    polls: int = 0

    @classmethod
    def named_by(
        cls, params: Mapping[str, Any] | None, digest: str, *, num_tokens: int, chunk_size: int, deadline: float
    ) -> tuple[HandoffWait | None, str | None]:
        """The wait of a request whose ``kv_transfer_params`` are ``params`` (None if they name no
        handoff for this engine, or none worth waiting for), and why not when they name one this
        engine cannot use (`expected_chunks`). It waits for at most the prompt's own full chunks,
        less the token vLLM always computes."""
        chunks, why_not = expected_chunks(params, digest)
        tokens = min(min(chunks, num_tokens // chunk_size) * chunk_size, num_tokens - 1)
        return (cls(tokens, deadline) if tokens > 0 else None), why_not

    def seen(self, have: int, now: float, sent_at: float) -> Seen:
        """What the wait sees with ``have`` tokens found, at ``now``, the last lookup sent at ``sent_at``."""
        if have >= self.tokens:
            return Seen.ARRIVED
        if now >= self.deadline:
            return Seen.DEADLINE
        return Seen.POLL_DUE if now - sent_at >= poll_interval(self.polls) else Seen.NOT_YET

    def step(self, have: int, now: float, sent_at: float) -> Decision:
        """Move on what is seen (`seen`), and say what to do."""
        found = move(self.state, self.seen(have, now, sent_at))
        self.state = found.state
        if found.decision is Decision.POLL:
            self.polls += 1
        return found.decision
