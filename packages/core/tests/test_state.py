import pytest

from kvdepot.core import TRANSITIONS, Event, InvalidTransitionError, RequestState
from kvdepot.core._state import TERMINAL, next_state

S, E = RequestState, Event
LIVE = [S.NEW, S.PREFETCHING, S.LOOKED_UP, S.WAITING_FOR_LOAD, S.READY, S.PREEMPTED]

# The lifecycle written out independently of the implementation's table.
EXPECTED = {
    (S.NEW, E.LOOKUP_SENT): S.PREFETCHING,
    (S.NEW, E.ALLOCATED): S.READY,
    (S.PREFETCHING, E.LOOKUP_DONE): S.LOOKED_UP,
    (S.LOOKED_UP, E.ALLOCATED_WITH_LOAD): S.WAITING_FOR_LOAD,
    (S.LOOKED_UP, E.ALLOCATED): S.READY,
    (S.LOOKED_UP, E.LOOKUP_SENT): S.PREFETCHING,
    (S.WAITING_FOR_LOAD, E.SCHEDULED): S.WAITING_FOR_LOAD,
    (S.WAITING_FOR_LOAD, E.LOAD_DONE): S.READY,
    (S.WAITING_FOR_LOAD, E.LOAD_FAILED): S.READY,
    (S.WAITING_FOR_LOAD, E.PREEMPTED): S.PREEMPTED,
    (S.READY, E.SCHEDULED): S.READY,
    (S.READY, E.PREEMPTED): S.PREEMPTED,
    (S.PREEMPTED, E.LOOKUP_SENT): S.PREFETCHING,
    (S.PREEMPTED, E.ALLOCATED): S.READY,
    **{(state, E.FINISHED): S.FINISHED for state in LIVE},
    **{(state, E.ABORTED): S.ABORTED for state in LIVE},
}


def test_table_is_the_documented_lifecycle():
    """The state table holds exactly the documented transitions."""
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize("state", list(RequestState))
@pytest.mark.parametrize("event", list(Event))
def test_every_other_pair_raises(state, event):
    """An event the lifecycle does not allow raises a typed error naming state and event."""
    if (state, event) in EXPECTED:
        assert next_state("r", state, event) is EXPECTED[state, event]
        return
    with pytest.raises(InvalidTransitionError) as info:
        next_state("r", state, event)
    assert info.value.state == state.value
    assert info.value.event == event.value


@pytest.mark.parametrize("state", sorted(TERMINAL, key=lambda s: s.value))
def test_terminal_states_accept_nothing(state):
    """Finished and aborted requests take no further event."""
    assert not [e for e in Event if (state, e) in TRANSITIONS]


@pytest.mark.parametrize("state", [s for s in RequestState if s not in TERMINAL])
def test_abort_and_finish_allowed_from_every_live_state(state):
    """A request can be aborted or finished from any live state."""
    assert TRANSITIONS[state, Event.ABORTED] is RequestState.ABORTED
    assert TRANSITIONS[state, Event.FINISHED] is RequestState.FINISHED
