"""What a lookup reply means for one request: no I/O, no clock, no vLLM.

The scheduler side (`_scheduler.py`) sends the lookups of a scheduling pass as one message; a
request's part of the reply is one result per KV rank, from its ``first_item`` on. Reading it
is pure, and lives here:

- `lookup_status`: whether the reply is in, still worth waiting for, or late (a miss, whose
  leases go back when it lands);
- `read_reply`: the results in, what they mean (`LookupReading`): the hit per rank, the leases
  the server took for it, where the hit chunks lie, their length, and how many of them the
  server had just read back from a tier below RAM. A reply that cannot be this request's hit
  is a miss: the wrong number of results, another server instance than the one asked (its
  slots are in another pool), or slots of mixed lengths (they cannot all be this layout's
  chunks; their leases still go back);
- `outdated`: whether a reply read while its request waited is to be asked again;
- `hit_sources`: a load's tokens split by where the server had them.

The scheduler side feeds the reading to the planner and its counters, and acts on the rest.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from kvdepot.core import RequestTracker
    from kvdepot.transport import LookupResult


class LookupStatus(enum.Enum):
    """Where a request's lookup stands when the scheduler side asks."""

    ANSWERED = "answered"  # the reply (or its error) is in: read it
    WAITING = "waiting"  # not in yet: vLLM is told "not yet", and asks again
    TIMED_OUT = "timed_out"  # not in after the lookup timeout: a miss


def lookup_status(done: bool, waited: float, timeout: float) -> LookupStatus:
    """The status of a lookup sent ``waited`` seconds ago whose reply is ``done`` or not."""
    if done:
        return LookupStatus.ANSWERED
    return LookupStatus.WAITING if waited < timeout else LookupStatus.TIMED_OUT


@attrs.frozen
class LookupReading:
    """A request's lookup reply, read: what the planner and the scheduler side's record take.

    ``hits``: hit chunks per KV rank, counted from the lookup's first chunk; ``leases``: the
    lease ids the server took (0: none), one per rank, all of the instance that answered;
    ``slots``: per rank, the pool offsets of the hit chunks; ``slot_bytes``: their length;
    ``read_back``: the chunk the hit ends at, and how many chunks before that end the server had
    just read back for it from each tier below RAM.
    """

    hits: tuple[int, ...] = (0,)
    leases: tuple[int, ...] = ()
    slots: tuple[tuple[int, ...], ...] = ()
    slot_bytes: int = 0
    read_back: tuple[int, Mapping[str, int]] = (0, {})

    @property
    def hit_chunks(self) -> int:
        """The chunks every rank hit (a chunk is a hit only if every rank has it)."""
        return min(self.hits)


#: A reply that brings no hit and no lease.
MISS = LookupReading()


def read_reply(
    results: Sequence[LookupResult], first_item: int, *, world: int, same_server: bool, lookup_first: int
) -> LookupReading:
    """What the results ``first_item`` to ``first_item + world`` of a lookup reply mean for the
    request whose lookup asked from chunk ``lookup_first`` on. ``same_server``: the instance
    that answered is the one serving now (slots of another are in another pool: a miss)."""
    mine = results[first_item : first_item + world]
    if len(mine) != world or not same_server:
        return MISS
    leases = tuple(r.lease_id for r in mine)
    lengths = {s.length for r in mine for s in r.slots}
    if len(lengths) > 1:
        return LookupReading(leases=leases)
    return LookupReading(
        hits=tuple(r.num_hits for r in mine),
        leases=leases,
        slots=tuple(tuple(s.offset for s in r.slots) for r in mine),
        slot_bytes=lengths.pop() if lengths else 0,
        read_back=(lookup_first + mine[0].num_hits, dict(mine[0].read_back)),
    )


def outdated(
    tracker: RequestTracker,
    *,
    num_tokens: int,
    num_computed_tokens: int,
    chunk_size: int,
    stores_ended_at: float,
    now: float,
    refresh_s: float,
) -> bool:
    """True when a request's lookup reply (its ``tracker``), read while it waited, may no longer
    be what the server holds for it now that vLLM asks again with ``num_computed_tokens`` of its
    ``num_tokens`` in its own prefix cache (it is then looked up again):

    - vLLM's own prefix hit shrank below the chunks the lookup left out (they were in vLLM's
      cache at admission, evicted since): the hit no longer follows on from it;
    - the hit stops short of the prompt's last full chunk, and a step of this engine that
      stored chunks has ended since the lookup went out (at ``stores_ended_at``): a request with
      the same prefix that ran meanwhile may have committed the rest (what a queue of requests
      sharing prefixes does under a small KV cache);
    - its leases are close to expiring: the lookup went out more than ``refresh_s`` ago.
    """
    if num_computed_tokens < tracker.lookup_first * chunk_size:
        return True
    if tracker.hit_chunks < (num_tokens - 1) // chunk_size and stores_ended_at > tracker.hit_at:
        return True
    return now - tracker.hit_at > refresh_s


def hit_sources(
    start: int, num_tokens: int, read_back: tuple[int, Mapping[str, int]], chunk_size: int
) -> dict[str, int]:
    """The ``num_tokens`` a load brings from token ``start`` on, by where the server had them:
    ``"host"`` (its RAM), or the tier it just read them back from (``"disk"``, ``"remote"``).
    Read-back chunks end the hit (``read_back``: see `LookupReading`), the disk's first (the
    tier asked first); the counts sum to ``num_tokens``."""
    if not num_tokens:
        return {}
    end = start + num_tokens
    hit_end, tiers = read_back
    out: dict[str, int] = {}
    at = (hit_end - sum(tiers.values())) * chunk_size
    for kind in sorted(tiers, key=lambda k: (k != "disk", k)):
        span = tiers[kind] * chunk_size
        if (overlap := min(end, at + span) - max(start, at)) > 0:
            out[kind] = overlap
        at += span
    if host := num_tokens - sum(out.values()):
        out["host"] = host
    return out
