"""Lookups answered from the server's slot index in shared memory, in the pass that asks.

A lookup sent to the server is answered when the server next gets a core: on a node whose
cores the engine keeps busy, 1.4 ms at the median and over 10 ms at worst, and a request
whose reply is late starts a step later. The server also keeps an index of its committed
chunks in shared memory (`kvdepot.core.find_in_index`), offered to its owner's engines on the
node (`HelloReply.slot_index`). The scheduler side reads it for a request whose reply is not in
yet (`IndexReader.read`):

- it takes the index's answer when the index holds every chunk the lookup asked for, or when
  the index is complete (the server has no tier below RAM, so a chunk not in it is a miss);
- otherwise it waits for the reply, as without the index (a tier below may hold the rest).

It asks the index once per lookup, in the pass that sends it: by a later pass a tier below may
have read chunks back into RAM for this very lookup, and the reply says where they came from.

An answer from the index has no lease yet: the reply, when it lands, brings the server's leases,
and the scheduler side holds them with the hit from its next step boundary on
(`Lookups.collect_leases`, `kvdepot.core.Planner.add_leases`). The load checks every slot's
header before and after its copy, as it does for any hit, so a chunk evicted meanwhile fails its
load (recomputed), never loads wrong bytes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvdepot.core import find_in_index, slot_digest
from kvdepot.server import PoolError, PoolMapping
from kvdepot.vllm_connector._lookup_reply import LookupReading

if TYPE_CHECKING:
    from collections.abc import Sequence

    from kvdepot.transport import CacheClient

log = logging.getLogger("vllm.kvdepot.scheduler")


class IndexReader:
    """The slot index of the server instance the client speaks to, mapped read-only."""

    def __init__(self, client: CacheClient) -> None:
        self.client = client
        # (server instance, its index mapped or None when it cannot be, whether it is complete)
        self._mapped: tuple[str, memoryview | None, bool] | None = None
        self._mapping: PoolMapping | None = None

    def read(
        self, salt: str, keys: Sequence[Sequence[bytes]], *, lookup_first: int, server_id: str
    ) -> LookupReading | None:
        """The index's answer to a lookup of ``keys`` (one list per KV rank) sent to
        ``server_id``, or None when the reply must answer it (module docstring)."""
        mapped = self._current()
        if mapped is None or mapped[0] != server_id:
            return None
        _server, index, complete = mapped
        if index is None:
            return None
        hits: list[int] = []
        slots: list[tuple[int, ...]] = []
        lengths: set[int] = set()
        for rank_keys in keys:
            offsets: list[int] = []
            for key in rank_keys:
                found = find_in_index(index, slot_digest(salt, key))
                if found is None:
                    break
                offsets.append(found[0])
                lengths.add(found[1])
            hits.append(len(offsets))
            slots.append(tuple(offsets))
        if len(lengths) > 1:
            return None  # not one layout's chunks: the reply says what they are
        if not complete and any(n < len(rank_keys) for n, rank_keys in zip(hits, keys, strict=True)):
            return None
        return LookupReading(
            hits=tuple(hits),
            leases=(0,) * len(hits),
            slots=tuple(slots),
            slot_bytes=lengths.pop() if lengths else 0,
            read_back=(lookup_first + min(hits, default=0), {}),
        )

    def _current(self) -> tuple[str, memoryview | None, bool] | None:
        """The index of the instance the client last shook hands with, mapped once per instance."""
        hello = self.client.hello_reply
        if hello is None or hello.slot_index is None:
            return None
        if self._mapped is None or self._mapped[0] != hello.server_id:
            self.close()
            try:  # the pool's own checks: this user's file alone, no symlink, the size announced
                self._mapping = PoolMapping(hello.slot_index.path, hello.slot_index.size, writable=False)
                view: memoryview | None = self._mapping.view(0, hello.slot_index.size)
            except PoolError as exc:
                log.info("kvdepot reads no slot index (%s); lookups wait for the server's reply", exc)
                view = None
            self._mapped = (hello.server_id, view, hello.slot_index_complete)
        return self._mapped

    def close(self) -> None:
        """Unmap the index."""
        if self._mapped is not None and self._mapped[1] is not None:
            self._mapped[1].release()
        if self._mapping is not None:
            self._mapping.close()
        self._mapped, self._mapping = None, None
