"""Quotas in the remote tier, counted in Valkey itself so that every server sharing it counts the same bytes.

For a salt with a quota, two keys (TAG: `salt_tag` of the salt, hex; the braces keep both in
one cluster slot, so one script can change both):

    PREFIX + "quota:{TAG}:objects"   a sorted set of "NAME:SIZE", scored by the time written
    PREFIX + "quota:{TAG}:bytes"     the total of their sizes (payload bytes)

After each batch of SETs, one script call per salt adds the batch's objects (an object already
there is not counted again) and pops the salt's oldest until its total is within its quota;
the caller deletes the objects popped (in a cluster they live in other slots than these keys).
An object that Valkey evicted or expired meanwhile stays counted until it is the oldest and is
popped, so the count errs high, never low, and heals as the salt writes. A count evicted apart
from its set is rebuilt from the set's sizes by the next call. A salt without a
quota is not counted (no cost).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvdepot.server._tiers import ChunkWrite, salt_tag

# KEYS: the salt's objects (a sorted set of "NAME:SIZE" by write time) and their byte count.
# ARGV: the salt's quota, then NAME, SIZE for each object just written. Returns the names
# popped to bring the count within the quota, for the caller to delete (in a cluster they
# live in other slots than these keys).
CHARGE_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 0 then
  -- the count was evicted apart from its set (allkeys-lru takes keys one by one): rebuild it
  local total = 0
  for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local sep = string.find(member, ':', 1, true)
    total = total + tonumber(string.sub(member, sep + 1))
  end
  redis.call('SET', KEYS[2], total)
end
local now = redis.call('TIME')
local score = tonumber(now[1]) * 1000000 + tonumber(now[2])
local added = 0
for i = 2, #ARGV, 2 do
  local member = ARGV[i] .. ':' .. ARGV[i + 1]
  if redis.call('ZADD', KEYS[1], score, member) == 1 then
    added = added + tonumber(ARGV[i + 1])
  end
end
local used = redis.call('INCRBY', KEYS[2], added)
local quota = tonumber(ARGV[1])
local popped = {}
while used > quota do
  local oldest = redis.call('ZPOPMIN', KEYS[1])
  if #oldest == 0 then
    redis.call('SET', KEYS[2], 0)
    break
  end
  local sep = string.find(oldest[1], ':', 1, true)
  used = redis.call('DECRBY', KEYS[2], tonumber(string.sub(oldest[1], sep + 1)))
  popped[#popped + 1] = string.sub(oldest[1], 1, sep - 1)
end
return popped
"""


def quotas_of(quota_of: Callable[[str], int | None] | None, items: Sequence[ChunkWrite]) -> dict[str, int]:
    """The quota of each salt in ``items`` that has one."""
    if quota_of is None:
        return {}
    quotas = {salt: quota_of(salt) for salt in {item.salt for item in items}}
    return {salt: quota for salt, quota in quotas.items() if quota is not None}


def charge(
    client: Any, prefix: str, items: Sequence[ChunkWrite], results: Sequence[bool], quotas: dict[str, int]
) -> list[str]:
    """Count the chunks written (``results``) in their salts' totals; the keys to delete.

    Raises what redis-py raises; the totals of the salts before the failing one are counted.
    """
    popped: list[str] = []
    for salt, quota in quotas.items():
        written = [item for item, ok in zip(items, results, strict=True) if ok and item.salt == salt]
        if not written:
            continue
        tag = salt_tag(salt).hex()
        keys = [f"{prefix}quota:{{{tag}}}:objects", f"{prefix}quota:{{{tag}}}:bytes"]
        args: list[str | int] = [quota]
        for item in written:
            args += [item.digest.hex(), item.length]
        names = _script(client)(keys=keys, args=args)
        popped += [prefix + (n.decode() if isinstance(n, bytes) else n) for n in names]
    return popped


def _script(client: Any) -> Any:
    """The charge script, registered once per client (redis-py loads it on its first use)."""
    script = getattr(client, "_kvdepot_charge", None)
    if script is None:
        script = client.register_script(CHARGE_SCRIPT)
        client._kvdepot_charge = script
    return script
