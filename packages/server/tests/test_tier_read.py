"""The tiered reads' book: its state tables, and the actions each input asks of the loop.

The book touches no index, tier, thread or clock: each test feeds it inputs (with `now`) and
checks the moves and the actions, as the transport's tests do for the client's connection.
"""

from __future__ import annotations

import itertools

import pytest

import kvdepot.server._tier_read as tr
from kvdepot.core import InvalidTransitionError
from kvdepot.server._clear_epochs import ClearEpochs
from kvdepot.server._index import MAX_KEYS_PER_REQUEST
from kvdepot.server._tier_read import (
    MAX_PREFIX_LEASES,
    MAX_READ_KEYS_PER_CLIENT,
    QUERY_TRANSITIONS,
    TRANSITIONS,
    LookupRead,
    Probed,
    QueryRead,
    ReadBook,
    ReadEvent,
    ReadState,
    TierRead,
)
from kvdepot.transport import Deferred

R, V = ReadState, ReadEvent
KINDS = ["disk", "remote"]
KEYS = [bytes([i]) * 32 for i in range(4)]


def read_in(kind: type[TierRead], state: ReadState) -> TierRead:
    extra = {"prefixes": []} if kind is QueryRead else {}
    return kind(
        deferred=Deferred(), client="a", items=[], missing=[], deadline=0.0, overdue_at=0.0, state=state, **extra
    )


def test_table_is_the_life_of_a_lookups_tiered_read():
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
    assert LookupRead.TABLE is TRANSITIONS


def test_a_querys_read_is_only_ever_probed():
    """A Query's read has its own table: no slot is placed or filled for it."""
    assert QUERY_TRANSITIONS == {
        (R.PROBING, V.PROBED): (R.DONE, True),
        (R.PROBING, V.OVERDUE): (R.LATE_PROBING, True),
        (R.LATE_PROBING, V.PROBED): (R.DONE, False),
    }
    assert QueryRead.TABLE is QUERY_TRANSITIONS


TABLES = [(LookupRead, TRANSITIONS), (QueryRead, QUERY_TRANSITIONS)]


@pytest.mark.parametrize(
    ("kind", "state", "event"),
    [(kind, s, e) for kind, table in TABLES for s, e in itertools.product(R, V) if (s, e) not in table],
)
def test_moves_missing_from_the_table_raise_and_leave_the_read_where_it_was(kind, state, event):
    read = read_in(kind, state)
    with pytest.raises(InvalidTransitionError) as info:
        read.advance(event)
    assert (info.value.state, info.value.event) == (state.value, event.value)
    assert read.state is state


def paths(table, state: ReadState, answered: int) -> list[int]:
    """The number of answers along every path from ``state`` to DONE."""
    if state is R.DONE:
        return [answered]
    out = []
    for (old, _), (new, answers) in table.items():
        if old is state:
            out += paths(table, new, answered + answers)
    return out


@pytest.mark.parametrize(("kind", "table"), TABLES)
def test_every_path_answers_exactly_once_and_ends_done(kind, table):
    answers = paths(table, R.PROBING, 0)
    assert answers
    assert set(answers) == {1}


# -- the book: inputs in, actions out -------------------------------------------------------


def book(read_deadline: float = 0.5, per_chunk: float | None = None) -> ReadBook:
    return ReadBook(KINDS, ClearEpochs(), read_deadline, per_chunk)


def kinds_of(actions: list) -> list[type]:
    return [type(a) for a in actions]


def probed_lookup(b: ReadBook, held: list[list[int]], now: float = 0.0) -> LookupRead:
    """A lookup of KEYS, none in RAM, whose probe found ``held`` (each key's tiers) at 100 bytes."""
    read = b.lookup("a", [("s", KEYS)], [0], now)
    assert read is not None
    b.take_actions()
    b.probed(read, Probed([held], [100]), now)
    return read


def test_a_lookup_leases_its_prefixes_then_probes():
    """A lookup past RAM asks for the prefix leases and a probe, in that order, and counts its keys."""
    b = book()
    read = b.lookup("a", [("s", KEYS)], [1], 10.0)
    assert isinstance(read, LookupRead)
    assert read.missing == [("s", KEYS[1:])]
    assert (read.deadline, read.overdue_at) == (10.0, 10.0 + b.longest_wait())
    assert b.take_actions() == [tr.LeasePrefixes(read), tr.Probe(read)]
    b.leased(read, [7])
    assert (read.prefix_leases, b.prefix_leases) == ([7], 1)
    assert (b.keys_of, b.keys_waiting, list(b.open)) == ({"a": 4}, 4, [read])
    assert b.counters["reads_deferred"] == 1


def test_a_lookup_all_in_ram_is_no_read():
    """Every key in RAM: no read, no action, nothing counted."""
    b = book()
    assert b.lookup("a", [("s", KEYS)], [4], 0.0) is None
    assert b.take_actions() == []
    assert b.counters["reads_deferred"] == 0


def test_past_its_share_of_prefix_leases_a_lookup_reads_without_them():
    b = book()
    b.prefix_leases = MAX_PREFIX_LEASES
    read = b.lookup("a", [("s", KEYS)], [0], 0.0)
    assert b.take_actions() == [tr.Probe(read)]


def test_the_bounds_refuse_a_client_past_its_share_and_a_request_past_the_key_limit():
    b = book()
    assert b.admits("a", [("s", KEYS)])
    assert not b.admits("a", [("s", [b"k"] * (MAX_KEYS_PER_REQUEST + 1))])
    assert b.counters["reads_refused"] == 0  # RAM's answer refuses it with its typed error
    b.keys_of["a"] = MAX_READ_KEYS_PER_CLIENT
    assert not b.admits("a", [("s", KEYS)])
    assert b.admits("b", [("s", KEYS)])
    assert b.counters["reads_refused"] == 1


def test_a_probe_that_found_runs_reserves_slots_for_them_then_fills():
    """Each item's run is reserved at the size the tiers hold; the deadline grows by what it saves."""
    b = book(read_deadline=0.5, per_chunk=0.1)
    read = probed_lookup(b, [[0], [0, 1], [1]])
    assert read.deadline == pytest.approx(0.3)
    assert b.take_actions() == [tr.Reserve(read, [("s", KEYS[:3], 100)])]
    b.placed(read, [(5, [(0, 0, 100), (1, 100, 100), (2, 200, 100)])], 0.1)
    assert read.state is R.FILLING
    assert b.take_actions() == [tr.Fill(read)]


def test_a_filled_read_settles_its_slots_answers_and_gives_back_its_leases():
    b = book()
    read = probed_lookup(b, [[0], [1]])
    b.leased(read, [7])
    b.take_actions()
    b.placed(read, [(5, [(0, 0, 100), (1, 100, 100)])], 0.1)
    b.take_actions()
    b.filled(read, [{0: 0, 1: 1}])
    actions = b.take_actions()
    assert actions == [
        tr.Settle(5, {0, 1}),
        tr.LookupAnswer(read.deferred, "a", [("s", KEYS)], [{0: "disk", 1: "remote"}]),
        tr.Release([7]),
    ]
    assert read.state is R.DONE
    assert (b.keys_of, b.keys_waiting, b.prefix_leases) == ({}, 0, 0)
    assert (b.counters["read_hits"], b.counters["read_misses"]) == (2, 2)


def test_a_probe_that_found_nothing_answers_at_once_with_no_slot():
    b = book()
    read = probed_lookup(b, [])
    assert b.take_actions() == [tr.Reserve(read, [None])]
    b.placed(read, [(0, [])], 0.0)
    assert b.take_actions() == [tr.LookupAnswer(read.deferred, "a", [("s", KEYS)], [{}])]
    assert read.state is R.DONE
    assert b.counters["read_misses"] == 4


def test_a_probe_back_past_the_deadline_takes_no_slot():
    """No time left for a transfer: no Reserve (slots might evict), the run counted late."""
    b = book(read_deadline=0.5)
    read = probed_lookup(b, [[0], [0]], now=0.0)
    b.take_actions()
    late = b.lookup("a", [("t", KEYS)], [0], 0.0)
    b.take_actions()
    b.probed(late, Probed([[[0], [0]]], [100]), 1.0)
    assert b.take_actions() == [tr.LookupAnswer(late.deferred, "a", [("t", KEYS)], [{}])]
    assert b.counters["read_late"] == 2
    assert read.state is R.PROBING  # the other read goes on


def test_an_expired_probe_counts_and_answers():
    b = book()
    read = b.lookup("a", [("s", KEYS)], [0], 0.0)
    b.take_actions()
    b.probed(read, Probed([[]], [0], expired=True), 0.0)
    assert kinds_of(b.take_actions()) == [tr.LookupAnswer]
    assert b.counters["reads_expired"] == 1


def test_a_fill_read_before_a_clear_of_its_salt_publishes_nothing():
    b = book()
    read = probed_lookup(b, [[0]])
    b.take_actions()
    b.placed(read, [(5, [(0, 0, 100)])], 0.0)
    b.take_actions()
    b.clears.mark("s", below=True)
    b.filled(read, [{0: 0}])
    assert b.take_actions()[0] == tr.Settle(5, set())
    assert b.counters["read_hits"] == 0


def test_an_overdue_read_is_answered_once_and_settled_when_the_reader_is_done():
    """Past its longest wait a read is answered from RAM (with a warning); its fill, later,
    settles the slots without a second answer."""
    b = book()
    read = probed_lookup(b, [[0]])
    b.take_actions()
    b.placed(read, [(5, [(0, 0, 100)])], 0.0)
    b.take_actions()
    b.timer(read.overdue_at - 0.001)
    assert b.take_actions() == []
    b.timer(read.overdue_at)
    actions = b.take_actions()
    assert kinds_of(actions) == [tr.Warn, tr.LookupAnswer]
    assert actions[1].read_back == [{}]
    assert read.state is R.LATE_FILLING
    assert b.counters["reads_overdue"] == 1
    assert b.keys_waiting == 4  # still held by the reader
    b.filled(read, [{0: 0}])
    assert b.take_actions() == [tr.Settle(5, {0})]
    assert (read.state, b.keys_waiting) == (R.DONE, 0)


def test_a_query_probed_on_the_loop_is_answered_and_never_counted():
    b = book()
    read = b.query("r", [("s", KEYS)], [1], 0.0)
    assert isinstance(read, QueryRead)
    answer = b.probed_now(read, Probed([[[0, 1], [1]]], [100]))
    assert answer == tr.QueryAnswer(read.deferred, [(1, 2, {"disk": 1, "remote": 2})])
    assert (b.take_actions(), b.keys_waiting, list(b.open)) == ([], 0, [])
    assert (b.counters["queries_probed"], b.counters["queries_deferred"]) == (1, 0)


def test_a_deferred_query_is_probed_by_the_reader_then_answered():
    b = book()
    read = b.query("r", [("s", KEYS)], [0], 0.0)
    b.defer(read)
    assert b.take_actions() == [tr.Probe(read)]
    assert b.keys_of == {"r": 4}
    b.probed(read, Probed([[[0]]], [100]), 0.0)
    assert b.take_actions() == [tr.QueryAnswer(read.deferred, [(0, 1, {"disk": 1, "remote": 0})])]
    assert (read.state, b.keys_of) == (R.DONE, {})
    assert b.counters["queries_deferred"] == 1


def test_an_overdue_query_is_answered_with_ram_alone():
    b = book()
    read = b.query("r", [("s", KEYS)], [2], 0.0)
    b.defer(read)
    b.take_actions()
    b.timer(read.overdue_at)
    actions = b.take_actions()
    assert actions[1] == tr.QueryAnswer(read.deferred, [(2, 0, {"disk": 0, "remote": 0})])
    b.probed(read, Probed([[[0]]], [100]), 9.0)
    assert b.take_actions() == []
    assert read.state is R.DONE
