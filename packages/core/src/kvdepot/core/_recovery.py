"""Load-failure recovery with the semantics of vLLM's scheduler."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs


@attrs.frozen
class LoadedRequest:
    """A request that loaded KV in the step that failed.

    ``num_computed_tokens`` already includes the step's ``num_scheduled_tokens``
    (as vLLM counts it once the step has run).
    """

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: Sequence[int]


@attrs.frozen
class Recovery:
    """What to do about failed loads.

    ``num_computed_tokens`` gives the new count for every affected request;
    ``num_recompute_tokens`` the tokens the engine computes again in all;
    ``evict_block_ids`` the blocks whose contents are no longer valid (the failed
    block and every block after it, per truncated request), which must leave the
    engine's prefix cache.
    """

    num_computed_tokens: dict[str, int]
    num_recompute_tokens: int
    evict_block_ids: frozenset[int]


def recover_load_failures(
    requests: Iterable[LoadedRequest], failed_block_ids: Iterable[int], block_size: int
) -> Recovery:
    """Roll requests back to before their first failed block.

    For each request in order: its computed tokens are first reduced by the step's
    scheduled tokens, then truncated at its first failed block. A failed block shared
    by several requests is recomputed by the first request that holds it only; a later
    request whose failed blocks were all claimed that way keeps its computed tokens
    (less the step's scheduled tokens).
    """
    failed = set(failed_block_ids)
    claimed: set[int] = set()
    computed: dict[str, int] = {}
    evict: set[int] = set()
    recompute = 0
    for req in requests:
        before = req.num_computed_tokens - req.num_scheduled_tokens
        num_blocks = -(-before // block_size)
        affected = False
        truncated_at: int | None = None
        for index, block in enumerate(req.block_ids[:num_blocks]):
            if block not in failed:
                continue
            affected = True
            if block in claimed:
                continue
            claimed.add(block)
            if truncated_at is None:
                truncated_at = index
        if not affected:
            continue
        if truncated_at is None:
            computed[req.req_id] = before
        else:
            computed[req.req_id] = truncated_at * block_size
            evict.update(req.block_ids[truncated_at:])
        recompute += req.num_computed_tokens - computed[req.req_id]
    return Recovery(num_computed_tokens=computed, num_recompute_tokens=recompute, evict_block_ids=frozenset(evict))
