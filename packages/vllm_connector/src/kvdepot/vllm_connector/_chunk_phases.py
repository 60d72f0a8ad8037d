"""Where each chunk of the KV events stands, and what each thing seen of it does: no I/O, no clock.

`EventAnnouncer` (`_kv_events.py`) watches the chunks of this engine's requests. Each has a
`Phase` (announced nowhere, in RAM, in the tiers below, in both); what the announcer sees of it
(a planned store, every rank's copy in RAM, a copy gone, a tier's answer, a check coming due) is
a `Seen`. `TRANSITIONS` maps (phase, seen) to a `Move`: the next phase, the events to send, and
when to ask the server about the chunk next, in RAM and in the tiers below. The announcer only
polls the server, feeds what it read here, and carries the moves out. Everything that moves a
chunk between phases lives in this file.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

#: A planned chunk not yet seen committed is asked about after a second, and given up after a
#: minute; one seen go is given up a minute later unless a commit brings it back.
CHECK_AFTER_S = 1.0
PENDING_TTL_S = 60.0
#: An announced chunk is asked about again this often (seconds), whatever the changes said: a
#: bound on how long any announcement can outlive its chunk.
RECHECK_S = 30.0
#: A chunk announced in the tiers below RAM is asked about again this often (seconds): how long
#: a router may believe in a chunk the remote tier's own eviction (Valkey's LRU) took.
STORAGE_CHECK_S = 30.0


class Phase(enum.Enum):
    """What the events say of a watched chunk."""

    PLANNED = "planned"  # announced nowhere: planned, or seen go; given up `PENDING_TTL_S` after that
    IN_RAM = "in_ram"  # announced in RAM (medium CPU)
    BELOW = "below"  # announced in the tiers below RAM alone (medium STORAGE)
    IN_RAM_AND_BELOW = "in_ram_and_below"  # both: back in RAM while a tier below still holds it
    GONE = "gone"  # forgotten: announced nowhere, watched no more


class Seen(enum.Enum):
    """What the announcer learns of a chunk, or what comes due for it."""

    PLANNED = "planned"  # a store of it is planned
    ALL_IN_RAM = "all_in_ram"  # every rank's copy is in RAM (a hit, a commit, a check)
    KEY_GONE = "key_gone"  # a rank's copy left RAM (a change, a check)
    HELD_BELOW = "held_below"  # the tiers below hold every rank's copy (or RAM does)
    NOT_BELOW = "not_below"  # they do not
    RAM_CHECK_DUE = "ram_check_due"  # its RAM check came due: it is asked about in this poll
    EXPIRED = "expired"  # the same, `PENDING_TTL_S` or more after it was planned or seen go
    BELOW_CHECK_DUE = "below_check_due"  # its check in the tiers below came due: asked in this poll
    CHECK_ALL = "check_all"  # the server restarted, or its changes were missed: ask again now
    RAM_CHECK_FAILED = "ram_check_failed"  # the poll that asked about it in RAM failed
    BELOW_CHECK_FAILED = "below_check_failed"  # the poll that asked about it below failed
    RAM_CHECK_AGAIN = "ram_check_again"  # its RAM answer describes another moment than the changes read
    DROPPED = "dropped"  # past the bound of watched chunks, or the engine's keys were reset


class Emit(enum.Enum):
    """An event for the chunk (one per KV-cache group): stored or removed, in RAM or below."""

    STORED_RAM = "stored_ram"
    REMOVED_RAM = "removed_ram"
    STORED_BELOW = "stored_below"
    REMOVED_BELOW = "removed_below"


class Check(enum.Enum):
    """When the server is asked about the chunk next (`check_time`)."""

    KEEP = "keep"  # as it was
    NOW = "now"
    SOON = "soon"  # `CHECK_AFTER_S` from now
    RECHECK = "recheck"  # `RECHECK_S` from now
    STORAGE = "storage"  # `STORAGE_CHECK_S` from now
    GIVE_UP = "give_up"  # a second from now at the soonest, else when it is given up
    NEVER = "never"


@attrs.frozen
class Move:
    """What a (phase, seen) pair does: the next phase, the events, the next checks in RAM and
    below; ``restart``: the chunk's wait for a commit starts again now (its ``since``)."""

    phase: Phase
    emit: tuple[Emit, ...] = ()
    ram: Check = Check.KEEP
    below: Check = Check.KEEP
    restart: bool = False


@attrs.define(eq=False)
class Chunk:
    """One watched chunk of this engine's requests: its key per KV rank, which are committed,
    what its events name, its phase and when it is asked about next."""

    keys: tuple[bytes, ...]
    salt: str
    hashes: list[Any]  # vLLM's hashes of its blocks, as its events name them
    parent: Any
    tokens: tuple[int, ...]
    lora: tuple[int | None, str | None]
    extra: list[tuple[Any, ...] | None] | None
    present: set[bytes] = attrs.Factory(set)
    #: What its events say (`_chunk_phases.TRANSITIONS` moves it).
    phase: Phase = Phase.PLANNED
    #: When it was planned, or last seen go; and when the server is asked about it next (monotonic).
    since: float = 0.0
    check_at: float = 0.0
    #: When the tiers below are asked whether they hold it (never unless it left RAM or is in them).
    storage_check_at: float = float("inf")


def check_time(check: Check, now: float, since: float) -> float:
    """The monotonic time of ``check`` for a chunk planned or seen go at ``since`` (not for KEEP)."""
    assert check is not Check.KEEP
    if check is Check.GIVE_UP:
        return max(now + CHECK_AFTER_S, since + PENDING_TTL_S)
    return now + _DELAY[check]


_DELAY = {
    Check.NOW: 0.0,
    Check.SOON: CHECK_AFTER_S,
    Check.RECHECK: RECHECK_S,
    Check.STORAGE: STORAGE_CHECK_S,
    Check.NEVER: float("inf"),
}

P, In, E, C = Phase, Seen, Emit, Check
LIVE = (P.PLANNED, P.IN_RAM, P.BELOW, P.IN_RAM_AND_BELOW)
#: The next RAM check of a chunk resting in each phase: announced in RAM, every `RECHECK_S`;
#: announced below alone, never (the changes say when it is back, the tiers' check when it goes).
RESTING: dict[Phase, Check] = {
    P.PLANNED: C.GIVE_UP,
    P.IN_RAM: C.RECHECK,
    P.BELOW: C.NEVER,
    P.IN_RAM_AND_BELOW: C.RECHECK,
}

#: The whole machine; a pair missing here is a bug (`move` asserts). Nothing leaves GONE.
TRANSITIONS: dict[tuple[Phase, Seen], Move] = {
    # A planned store: a chunk announced nowhere in RAM waits for its commit again.
    (P.PLANNED, In.PLANNED): Move(P.PLANNED, ram=C.SOON, restart=True),
    (P.BELOW, In.PLANNED): Move(P.BELOW, ram=C.SOON, restart=True),
    (P.IN_RAM, In.PLANNED): Move(P.IN_RAM),
    (P.IN_RAM_AND_BELOW, In.PLANNED): Move(P.IN_RAM_AND_BELOW),
    # Every rank's copy in RAM: announced there (and still below, if it was).
    (P.PLANNED, In.ALL_IN_RAM): Move(P.IN_RAM, (E.STORED_RAM,), ram=C.RECHECK),
    (P.BELOW, In.ALL_IN_RAM): Move(P.IN_RAM_AND_BELOW, (E.STORED_RAM,), ram=C.RECHECK),
    (P.IN_RAM, In.ALL_IN_RAM): Move(P.IN_RAM),
    (P.IN_RAM_AND_BELOW, In.ALL_IN_RAM): Move(P.IN_RAM_AND_BELOW),
    # A copy left RAM: removed there, and the tiers below are asked whether they hold it.
    (P.IN_RAM, In.KEY_GONE): Move(P.PLANNED, (E.REMOVED_RAM,), ram=C.GIVE_UP, below=C.NOW, restart=True),
    (P.IN_RAM_AND_BELOW, In.KEY_GONE): Move(P.BELOW, (E.REMOVED_RAM,), ram=C.NEVER, below=C.NOW, restart=True),
    (P.PLANNED, In.KEY_GONE): Move(P.PLANNED),
    (P.BELOW, In.KEY_GONE): Move(P.BELOW),
    # The tiers below hold it: announced there, and asked again every `STORAGE_CHECK_S`.
    (P.PLANNED, In.HELD_BELOW): Move(P.BELOW, (E.STORED_BELOW,), below=C.STORAGE),
    (P.IN_RAM, In.HELD_BELOW): Move(P.IN_RAM_AND_BELOW, (E.STORED_BELOW,), below=C.STORAGE),
    (P.BELOW, In.HELD_BELOW): Move(P.BELOW, below=C.STORAGE),
    (P.IN_RAM_AND_BELOW, In.HELD_BELOW): Move(P.IN_RAM_AND_BELOW, below=C.STORAGE),
    # They do not: removed there; a chunk in no tier at all is given up unless a commit comes.
    (P.PLANNED, In.NOT_BELOW): Move(P.PLANNED, below=C.NEVER),
    (P.IN_RAM, In.NOT_BELOW): Move(P.IN_RAM, below=C.NEVER),
    (P.BELOW, In.NOT_BELOW): Move(P.PLANNED, (E.REMOVED_BELOW,), ram=C.GIVE_UP, below=C.NEVER, restart=True),
    (P.IN_RAM_AND_BELOW, In.NOT_BELOW): Move(P.IN_RAM, (E.REMOVED_BELOW,), below=C.NEVER),
    # A chunk announced nowhere and never seen committed for `PENDING_TTL_S` is given up.
    (P.PLANNED, In.EXPIRED): Move(P.GONE),
}
for _phase in LIVE:
    # Checks coming due are asked about in this poll; the next one is the phase's resting check
    # (RAM) or one `STORAGE_CHECK_S` on, until the answer comes (below).
    TRANSITIONS[_phase, In.RAM_CHECK_DUE] = Move(_phase, ram=RESTING[_phase])
    TRANSITIONS.setdefault((_phase, In.EXPIRED), Move(_phase, ram=RESTING[_phase]))
    TRANSITIONS[_phase, In.BELOW_CHECK_DUE] = Move(_phase, below=C.STORAGE)
    # After a gap or a restart every chunk is asked about at once, below too where it is announced there.
    below_now = C.NOW if _phase in (P.BELOW, P.IN_RAM_AND_BELOW) else C.KEEP
    TRANSITIONS[_phase, In.CHECK_ALL] = Move(_phase, ram=C.NOW, below=below_now)
    # A failed poll's checks are due again a second later; a stale RAM answer is asked again now.
    TRANSITIONS[_phase, In.RAM_CHECK_FAILED] = Move(_phase, ram=C.SOON)
    TRANSITIONS[_phase, In.BELOW_CHECK_FAILED] = Move(_phase, below=C.SOON)
    TRANSITIONS[_phase, In.RAM_CHECK_AGAIN] = Move(_phase, ram=C.NOW)
TRANSITIONS[P.PLANNED, In.DROPPED] = Move(P.GONE)
TRANSITIONS[P.IN_RAM, In.DROPPED] = Move(P.GONE, (E.REMOVED_RAM,))
TRANSITIONS[P.BELOW, In.DROPPED] = Move(P.GONE, (E.REMOVED_BELOW,))
TRANSITIONS[P.IN_RAM_AND_BELOW, In.DROPPED] = Move(P.GONE, (E.REMOVED_RAM, E.REMOVED_BELOW))


def move(phase: Phase, seen: Seen) -> Move:
    """What ``seen`` does to a chunk in ``phase``; a pair missing from `TRANSITIONS` is a bug in this file."""
    found = TRANSITIONS.get((phase, seen))
    assert found is not None, f"a chunk cannot take {seen.value!r} in phase {phase.value!r}"
    return found


def due(since: float, now: float) -> Seen:
    """What a chunk's RAM check coming due at ``now`` is, for a chunk planned or seen go at ``since``."""
    return Seen.EXPIRED if now - since >= PENDING_TTL_S else Seen.RAM_CHECK_DUE
