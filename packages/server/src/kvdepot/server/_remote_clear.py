"""Clearing the remote tier: every object of one salt, or every object, whichever server wrote it.

Valkey cannot list a salt's objects by name (a name is a digest that mixes the salt in), so
each object carries its salt's tag (`salt_tag`) at the start of its header's fingerprint, and
a clear walks the prefix's keys: one SCAN pass (on every primary of a cluster), a pipelined
GETRANGE of the 16 tag bytes of each object found, and a pipelined UNLINK of those that
match. Nothing is kept per write beyond those 16 bytes, so a clear costs nothing until it
runs, finds objects whose accounting Valkey evicted, and reaches objects other servers wrote.
It reads 16 bytes per object of every salt under the prefix: see docs/server.md for a
measured rate. The salt's quota accounting keys go with its objects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from kvdepot.server._tier_format import FIXED_HEADER_BYTES
from kvdepot.server._tiers import SALT_TAG_BYTES, salt_tag

#: Keys asked of each SCAN call, and looked at per pipeline.
SCAN_BATCH = 1000
#: Hex digits of an object's name (`object_name`).
NAME_DIGITS = 64


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Valkey glob pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def clear_objects(client: Any, prefix: str, salt: str | None) -> int:
    """Delete the objects of ``salt`` under ``prefix`` (None: every object), and its quota
    accounting; how many objects went. Raises what redis-py raises."""
    tag = None if salt is None else salt_tag(salt)
    removed = 0
    for found in _batches(client.scan_iter(match=glob_escape(prefix) + "?" * NAME_DIGITS, count=SCAN_BATCH)):
        if tag is not None:
            found = [key for key, head in zip(found, _tags(client, found), strict=True) if head == tag]  # noqa: PLW2901
        removed += _unlink(client, found)
    if tag is None:
        accounting = list(client.scan_iter(match=glob_escape(prefix) + "quota:*", count=SCAN_BATCH))
    else:
        accounting = [f"{prefix}quota:{{{tag.hex()}}}:{part}" for part in ("objects", "bytes")]
    _unlink(client, accounting)
    return removed


def _batches(keys: Iterable[Any]) -> Iterator[list[Any]]:
    it = iter(keys)
    while batch := list(islice(it, SCAN_BATCH)):
        yield batch


def _tags(client: Any, keys: list[Any]) -> list[Any]:
    """The salt tag in each object's header (a short or absent value gives something else)."""
    pipe = client.pipeline(transaction=False)
    try:
        for key in keys:
            pipe.getrange(key, FIXED_HEADER_BYTES, FIXED_HEADER_BYTES + SALT_TAG_BYTES - 1)
        return list(pipe.execute(raise_on_error=False))  # a key of another type: an error, never a tag
    finally:
        pipe.reset()


def _unlink(client: Any, keys: list[Any]) -> int:
    """UNLINK each key (one by one in a pipeline: a cluster's keys live in different slots)."""
    if not keys:
        return 0
    pipe = client.pipeline(transaction=False)
    try:
        for key in keys:
            pipe.unlink(key)
        return sum(int(n) for n in pipe.execute(raise_on_error=True))
    finally:
        pipe.reset()
