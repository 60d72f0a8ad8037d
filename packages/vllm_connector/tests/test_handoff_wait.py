"""A decode engine's wait for a handoff's chunks: what it sees in, moves and decisions out, no clock."""

from __future__ import annotations

import pytest

from kvdepot.vllm_connector._handoff import HANDOFF_FIRST_POLL_S, HANDOFF_POLL_S, handoff_params
from kvdepot.vllm_connector._handoff_wait import (
    TRANSITIONS,
    Decision,
    HandoffWait,
    Move,
    Seen,
    State,
    move,
)

S, In, D = State, Seen, Decision


def test_the_table_is_complete_and_nothing_leaves_late() -> None:
    """Every state takes everything it can see; a late wait stays late and never waits again."""
    assert set(TRANSITIONS) == {(state, seen) for state in State for seen in Seen}
    assert all(found == Move(S.LATE, D.DONE) for (state, _), found in TRANSITIONS.items() if state is S.LATE)


@pytest.mark.parametrize(
    ("state", "seen", "expected"),
    [
        (S.WAITING, In.ARRIVED, Move(S.WAITING, D.DONE)),
        (S.WAITING, In.NOT_YET, Move(S.WAITING, D.WAIT)),
        (S.WAITING, In.POLL_DUE, Move(S.WAITING, D.POLL)),
        (S.WAITING, In.DEADLINE, Move(S.LATE, D.GIVE_UP)),
        (S.LATE, In.NOT_YET, Move(S.LATE, D.DONE)),
        (S.LATE, In.DEADLINE, Move(S.LATE, D.DONE)),
    ],
)
def test_moves(state: State, seen: Seen, expected: Move) -> None:
    """Each pair moves as the table says."""
    assert move(state, seen) == expected


def test_only_wait_and_poll_tell_vllm_not_yet() -> None:
    """WAIT and POLL hold the request back; DONE and GIVE_UP let it load what is there."""
    assert {d for d in Decision if d.waits} == {D.WAIT, D.POLL}


@pytest.mark.parametrize(
    ("have", "now", "sent_at", "polls", "expected"),
    [
        (16, 99.0, 0.0, 0, In.ARRIVED),  # every stored token found: arrived, even past the deadline
        (8, 10.0, 9.9, 0, In.DEADLINE),  # the deadline (10) comes before a poll
        (8, 1.0, 1.0, 0, In.NOT_YET),
        (8, 1.0 + HANDOFF_FIRST_POLL_S * 1.25, 1.0, 0, In.POLL_DUE),  # the first poll comes soon
        (8, 1.0 + HANDOFF_FIRST_POLL_S * 1.25, 1.0, 1, In.NOT_YET),  # each later one twice as late
        (8, 1.0 + HANDOFF_POLL_S * 1.05, 1.0, 30, In.POLL_DUE),  # up to HANDOFF_POLL_S
    ],
)
def test_what_the_wait_sees(have: int, now: float, sent_at: float, polls: int, expected: Seen) -> None:
    """Found tokens first, then the deadline, then the poll interval since the last lookup went out."""
    wait = HandoffWait(16, 10.0, polls=polls)
    assert wait.seen(have, now, sent_at) is expected


def test_a_wait_polls_backs_off_and_gives_up_at_its_deadline() -> None:
    """Fed a clock: wait, poll (counted), wait, poll, then late for good at the deadline."""
    wait = HandoffWait(tokens=16, deadline=1.0)
    decisions = [
        wait.step(8, 0.0, 0.0),  # the lookup just went out
        wait.step(8, 0.0021, 0.0),  # the first poll is due (2 ms): a new lookup goes out
        wait.step(8, 0.004, 0.0021),  # the second comes twice as late (4 ms)
        wait.step(8, 0.0062, 0.0021),
        wait.step(8, 1.0, 0.9),  # the deadline
        wait.step(8, 1.5, 1.4),  # late: never waits again
    ]
    assert decisions == [D.WAIT, D.POLL, D.WAIT, D.POLL, D.GIVE_UP, D.DONE]
    assert (wait.state, wait.polls) == (S.LATE, 2)


def test_a_wait_that_found_its_chunks_waits_again_if_a_later_lookup_finds_fewer() -> None:
    """Arriving is no end state: a request looked up again (preempted) waits again until its deadline."""
    wait = HandoffWait(tokens=16, deadline=1.0)
    assert wait.step(16, 0.0, 0.0) is D.DONE
    assert wait.step(8, 0.0005, 0.0) is D.WAIT
    assert wait.state is S.WAITING


@pytest.mark.parametrize(
    ("chunks", "num_tokens", "tokens"),
    [
        (2, 20, 16),  # the chunks named
        (5, 20, 16),  # at most the prompt's own full chunks
        (2, 16, 15),  # less the token vLLM always computes
        (0, 20, None),  # nothing stored: no wait
        (1, 1, None),  # no token it may load
    ],
)
def test_a_wait_is_named_by_the_producers_parameters(chunks: int, num_tokens: int, tokens: int | None) -> None:
    """The wait covers the producer's chunks within the prompt, less one token; none for nothing to wait for."""
    wait, why_not = HandoffWait.named_by(
        handoff_params("ns", chunks), "ns", num_tokens=num_tokens, chunk_size=8, deadline=5.0
    )
    assert why_not is None
    assert (wait.tokens if wait is not None else None) == tokens
    assert wait is None or (wait.deadline, wait.state, wait.polls) == (5.0, S.WAITING, 0)


def test_no_wait_for_a_handoff_under_another_namespace_and_why() -> None:
    """Parameters this engine cannot use bring no wait, and a reason to log; none at all bring neither."""
    wait, why_not = HandoffWait.named_by(handoff_params("other", 2), "ns", num_tokens=20, chunk_size=8, deadline=5.0)
    assert wait is None
    assert "namespace" in (why_not or "")
    assert HandoffWait.named_by(None, "ns", num_tokens=20, chunk_size=8, deadline=5.0) == (None, None)
