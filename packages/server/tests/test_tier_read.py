"""The tiered read's state table: every move it allows, an error for every other, one answer."""

from __future__ import annotations

import itertools

import pytest

from kvdepot.core import InvalidTransitionError
from kvdepot.server._tier_read import TRANSITIONS, ReadEvent, ReadState, TierRead
from kvdepot.transport import Deferred

R, V = ReadState, ReadEvent


def read_in(state: ReadState) -> TierRead:
    return TierRead(Deferred(), "a", [], [], deadline=0.0, overdue_at=0.0, state=state)


def test_table_is_the_life_of_a_tiered_read():
    assert TRANSITIONS == {
        (R.PROBING, V.PLACED): (R.FILLING, False),
        (R.PROBING, V.NOTHING): (R.DONE, True),
        (R.PROBING, V.OVERDUE): (R.LATE_PROBING, True),
        (R.FILLING, V.FILLED): (R.DONE, True),
        (R.FILLING, V.OVERDUE): (R.LATE_FILLING, True),
        (R.LATE_PROBING, V.PLACED): (R.LATE_FILLING, False),
        (R.LATE_PROBING, V.NOTHING): (R.DONE, False),
        (R.LATE_FILLING, V.FILLED): (R.DONE, False),
    }


@pytest.mark.parametrize(("state", "event"), [p for p in itertools.product(R, V) if p not in TRANSITIONS])
def test_moves_missing_from_the_table_raise_and_leave_the_read_where_it_was(state, event):
    read = read_in(state)
    with pytest.raises(InvalidTransitionError) as info:
        read.advance(event)
    assert (info.value.state, info.value.event) == (state.value, event.value)
    assert read.state is state


def paths(state: ReadState, answered: int) -> list[int]:
    """The number of answers along every path from ``state`` to DONE."""
    if state is R.DONE:
        return [answered]
    out = []
    for (old, _), (new, answers) in TRANSITIONS.items():
        if old is state:
            out += paths(new, answered + answers)
    return out


def test_every_path_answers_the_lookup_exactly_once_and_ends_done():
    answers = paths(R.PROBING, 0)
    assert answers
    assert set(answers) == {1}
