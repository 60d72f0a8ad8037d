"""The phases of the KV events' chunks: things seen in, moves out, no clock, no server, no vLLM."""

from __future__ import annotations

import pytest

from kvdepot.vllm_connector._chunk_phases import (
    CHECK_AFTER_S,
    LIVE,
    PENDING_TTL_S,
    RECHECK_S,
    STORAGE_CHECK_S,
    TRANSITIONS,
    Check,
    Emit,
    Move,
    Phase,
    Seen,
    check_time,
    due,
    move,
)

P, In, E, C = Phase, Seen, Emit, Check


def run(phase: Phase, *seen: Seen) -> tuple[Phase, list[Emit]]:
    """Feed ``seen`` in order from ``phase``: the phase reached and every event on the way."""
    emitted: list[Emit] = []
    for what in seen:
        step = move(phase, what)
        phase = step.phase
        emitted += step.emit
    return phase, emitted


def test_every_live_phase_takes_everything_and_gone_takes_nothing() -> None:
    """The table is complete for the watched phases, and nothing leaves GONE (a missing pair asserts)."""
    assert set(LIVE) == set(Phase) - {P.GONE}
    for phase in LIVE:
        assert all((phase, seen) in TRANSITIONS for seen in Seen)
    assert not any(phase is P.GONE for phase, _ in TRANSITIONS)
    with pytest.raises(AssertionError, match="phase 'gone'"):
        move(P.GONE, In.ALL_IN_RAM)


@pytest.mark.parametrize(
    ("phase", "seen", "expected"),
    [
        # planned, then committed: announced in RAM and rechecked every RECHECK_S
        (P.PLANNED, In.PLANNED, Move(P.PLANNED, ram=C.SOON, restart=True)),
        (P.PLANNED, In.ALL_IN_RAM, Move(P.IN_RAM, (E.STORED_RAM,), ram=C.RECHECK)),
        (P.IN_RAM, In.PLANNED, Move(P.IN_RAM)),
        (P.IN_RAM, In.ALL_IN_RAM, Move(P.IN_RAM)),
        # a copy left RAM: removed, waited for again, and the tiers below asked at once
        (P.IN_RAM, In.KEY_GONE, Move(P.PLANNED, (E.REMOVED_RAM,), ram=C.GIVE_UP, below=C.NOW, restart=True)),
        (P.PLANNED, In.KEY_GONE, Move(P.PLANNED)),
        # the tiers below hold it, or stop holding it
        (P.PLANNED, In.HELD_BELOW, Move(P.BELOW, (E.STORED_BELOW,), below=C.STORAGE)),
        (P.BELOW, In.HELD_BELOW, Move(P.BELOW, below=C.STORAGE)),
        (P.BELOW, In.NOT_BELOW, Move(P.PLANNED, (E.REMOVED_BELOW,), ram=C.GIVE_UP, below=C.NEVER, restart=True)),
        (P.PLANNED, In.NOT_BELOW, Move(P.PLANNED, below=C.NEVER)),
        # read back into RAM from a tier that keeps it: announced in both
        (P.BELOW, In.ALL_IN_RAM, Move(P.IN_RAM_AND_BELOW, (E.STORED_RAM,), ram=C.RECHECK)),
        (P.IN_RAM_AND_BELOW, In.KEY_GONE, Move(P.BELOW, (E.REMOVED_RAM,), ram=C.NEVER, below=C.NOW, restart=True)),
        (P.IN_RAM_AND_BELOW, In.NOT_BELOW, Move(P.IN_RAM, (E.REMOVED_BELOW,), below=C.NEVER)),
        # checks coming due: the next is the phase's resting one
        (P.PLANNED, In.RAM_CHECK_DUE, Move(P.PLANNED, ram=C.GIVE_UP)),
        (P.IN_RAM, In.RAM_CHECK_DUE, Move(P.IN_RAM, ram=C.RECHECK)),
        (P.BELOW, In.RAM_CHECK_DUE, Move(P.BELOW, ram=C.NEVER)),
        (P.IN_RAM, In.EXPIRED, Move(P.IN_RAM, ram=C.RECHECK)),
        (P.PLANNED, In.EXPIRED, Move(P.GONE)),
        (P.BELOW, In.BELOW_CHECK_DUE, Move(P.BELOW, below=C.STORAGE)),
        # a restart or a gap: asked again now, below too where announced there
        (P.IN_RAM, In.CHECK_ALL, Move(P.IN_RAM, ram=C.NOW)),
        (P.BELOW, In.CHECK_ALL, Move(P.BELOW, ram=C.NOW, below=C.NOW)),
        # failed or stale polls
        (P.IN_RAM, In.RAM_CHECK_FAILED, Move(P.IN_RAM, ram=C.SOON)),
        (P.BELOW, In.BELOW_CHECK_FAILED, Move(P.BELOW, below=C.SOON)),
        (P.PLANNED, In.RAM_CHECK_AGAIN, Move(P.PLANNED, ram=C.NOW)),
        # dropped: removed wherever it was announced, RAM first
        (P.PLANNED, In.DROPPED, Move(P.GONE)),
        (P.IN_RAM, In.DROPPED, Move(P.GONE, (E.REMOVED_RAM,))),
        (P.BELOW, In.DROPPED, Move(P.GONE, (E.REMOVED_BELOW,))),
        (P.IN_RAM_AND_BELOW, In.DROPPED, Move(P.GONE, (E.REMOVED_RAM, E.REMOVED_BELOW))),
    ],
)
def test_moves(phase: Phase, seen: Seen, expected: Move) -> None:
    """Each (phase, seen) pair moves the chunk, emits and schedules as the table says."""
    assert move(phase, seen) == expected


def test_every_stored_event_is_undone_by_one_removal() -> None:
    """Whatever is seen, a chunk's events alternate stored and removed per medium, and a drop
    leaves nothing announced: no router is left believing in a chunk the engine forgot."""
    for phase in LIVE:
        for seen in Seen:
            step = move(phase, seen)
            announced = {E.STORED_RAM: phase in (P.IN_RAM, P.IN_RAM_AND_BELOW)}
            announced[E.STORED_BELOW] = phase in (P.BELOW, P.IN_RAM_AND_BELOW)
            for emit in step.emit:
                stored = emit in (E.STORED_RAM, E.STORED_BELOW)
                medium = E.STORED_RAM if emit in (E.STORED_RAM, E.REMOVED_RAM) else E.STORED_BELOW
                assert announced[medium] is not stored, (phase, seen, emit)
                announced[medium] = stored
            assert announced[E.STORED_RAM] == (step.phase in (P.IN_RAM, P.IN_RAM_AND_BELOW)), (phase, seen)
            assert announced[E.STORED_BELOW] == (step.phase in (P.BELOW, P.IN_RAM_AND_BELOW)), (phase, seen)


def test_a_chunk_that_leaves_ram_for_a_tier_and_comes_back() -> None:
    """Committed, evicted to a tier that holds it, read back, evicted, and dropped by the tier."""
    assert run(P.PLANNED, In.PLANNED, In.ALL_IN_RAM, In.KEY_GONE, In.HELD_BELOW) == (
        P.BELOW,
        [E.STORED_RAM, E.REMOVED_RAM, E.STORED_BELOW],
    )
    assert run(P.BELOW, In.ALL_IN_RAM, In.KEY_GONE, In.NOT_BELOW, In.EXPIRED) == (
        P.GONE,
        [E.STORED_RAM, E.REMOVED_RAM, E.REMOVED_BELOW],
    )


def test_checks_and_what_comes_due() -> None:
    """Check times from now, and a planned chunk's give-up a minute after it was planned or seen go."""
    now, since = 1000.0, 990.0
    assert check_time(C.NOW, now, since) == now
    assert check_time(C.SOON, now, since) == now + CHECK_AFTER_S
    assert check_time(C.RECHECK, now, since) == now + RECHECK_S
    assert check_time(C.STORAGE, now, since) == now + STORAGE_CHECK_S
    assert check_time(C.NEVER, now, since) == float("inf")
    assert check_time(C.GIVE_UP, now, since) == since + PENDING_TTL_S
    assert check_time(C.GIVE_UP, now, now - PENDING_TTL_S) == now + CHECK_AFTER_S  # never sooner than a second
    assert due(since, now) is In.RAM_CHECK_DUE
    assert due(now - PENDING_TTL_S, now) is In.EXPIRED
