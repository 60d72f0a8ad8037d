"""What the planner hands the engine: chunks to load into a request's blocks, and to store from them."""

from __future__ import annotations

import attrs


@attrs.frozen
class RetrievePlan:
    """Load chunks ``[first_chunk, first_chunk + num_chunks)`` of a request into its blocks.

    ``block_ids`` are the blocks of those chunks, ``blocks_per_chunk`` per chunk in
    order. The first ``skip_blocks`` of them already hold the engine's own
    prefix-cache hit (other requests may be reading them) and must not be written.
    ``keys[r]`` are the chunk keys of KV rank ``r``; ``slots[r]`` where rank ``r``'s chunks
    lie in the pool of server instance ``source``, which leased them under ``lease_ids``.
    The planner holds those leases until `on_load_done` or `on_load_failed`, even if the
    request ends first: a lease is never given back while a copy may still read its slots.
    """

    req_id: str
    cache_salt: str
    first_chunk: int
    num_chunks: int
    keys: tuple[tuple[bytes, ...], ...]
    block_ids: tuple[int, ...]
    skip_blocks: int
    num_tokens: int
    lease_ids: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...] = ()
    source: str = ""


@attrs.frozen
class StorePlan:
    """Store chunks ``[first_chunk, first_chunk + num_chunks)`` of a request from its blocks."""

    req_id: str
    cache_salt: str
    first_chunk: int
    num_chunks: int
    keys: tuple[tuple[bytes, ...], ...]
    block_ids: tuple[int, ...]
