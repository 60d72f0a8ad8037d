"""What keeps a synchronous load's blocks from other requests until the load is known good.

vLLM adds a request's blocks to its prefix cache when it allocates them. For a hit loaded
before the forward pass (`LoadOp.sync`) that means another request admitted in the same
scheduling pass, or in the next one while the step still runs, can take those blocks as its
own prefix hit before anyone knows whether the copy succeeded. If it then failed, that request
would compute over bytes that were never loaded, and vLLM's recovery (it cuts the loading
request's computed tokens back and recomputes) does not reach it.

So, from its allocation until its step has ended, a sync-loaded request's blocks from the
first loaded one on are *unsettled*: a request whose prefix hit in vLLM's own cache reaches
one of them is asked again at the next pass (the scheduler answers vLLM "not yet", None),
instead of being scheduled over it. When a load fails, its blocks leave vLLM's prefix cache
at once (the connector evicts them through vLLM's KV-cache manager): the loading request
recomputes into them, and no later request, even after the loading one was aborted, can
find them.

Requests share a block only by sharing every token before it (vLLM's block hashes chain), so
the check reads the hashes of the asking request's own hit, and only while a sync load is in
flight.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import attrs


@attrs.define
class SyncGuard:
    """Unsettled blocks by vLLM block hash, and each loading request's own."""

    _owner: dict[Hashable, str] = attrs.Factory(dict)  # block hash -> the request loading it
    _hashes: dict[str, list[Hashable]] = attrs.Factory(dict)
    _blocks: dict[str, list[int]] = attrs.Factory(dict)

    def loading(self, req_id: str, hashes: Sequence[Hashable], block_ids: Sequence[int]) -> None:
        """``req_id`` loads into ``block_ids`` (hashes ``hashes``) before this step's forward pass."""
        self._hashes[req_id] = list(hashes)
        self._blocks[req_id] = list(block_ids)
        for block_hash in hashes:
            self._owner[block_hash] = req_id

    def reaches(self, req_id: str, hashes: Sequence[Hashable], num_hit_blocks: int) -> bool:
        """Whether a prefix hit of ``num_hit_blocks`` blocks (of a request with these block
        hashes) takes a block another request is loading, or whose load is not known yet."""
        if not self._owner:
            return False
        return any(self._owner.get(block_hash, req_id) != req_id for block_hash in hashes[:num_hit_blocks])

    def failed(self, req_id: str) -> list[int]:
        """The blocks of ``req_id``'s failed load: to leave vLLM's prefix cache."""
        return self._blocks.get(req_id, [])

    def settle(self, req_id: str) -> None:
        """``req_id``'s step has ended (its failure, if any, is handled): its blocks are free to share."""
        for block_hash in self._hashes.pop(req_id, ()):
            if self._owner.get(block_hash) == req_id:
                del self._owner[block_hash]
        self._blocks.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._hashes)
