import pytest

from kvdepot.core import TRANSITIONS, Event, InvalidTransitionError, RequestState
from kvdepot.core._state import TERMINAL, next_state


@pytest.mark.parametrize("state", list(RequestState))
@pytest.mark.parametrize("event", list(Event))
def test_table_is_total_or_raises(state, event):
    """Every (state, event) pair either has a row in the table or raises a typed error."""
    if (state, event) in TRANSITIONS:
        assert next_state("r", state, event) is TRANSITIONS[state, event]
    else:
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
