"""How tensor and pipeline parallelism map engine ranks to KV ranks."""

from __future__ import annotations

import attrs

from kvdepot.core._errors import ParallelConfigError


@attrs.frozen
class ParallelStrategy:
    """Which KV shard an engine rank holds, and whether it stores.

    Engine ranks are ordered ``rank = pp_rank * tp_size + tp_rank``, as in vLLM.
    Without MLA every rank holds its own shard of the KV cache: the KV world is
    the whole world. With MLA the latent KV is identical on every rank of a TP
    group, so the KV world counts pipeline stages only, and only the first rank
    of each TP group stores (every rank loads).
    """

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    use_mla: bool
    tp_rank: int
    pp_rank: int
    kv_world_size: int
    kv_rank: int
    stores: bool

    @classmethod
    def from_config(
        cls, world_size: int, rank: int, tp_size: int = 1, pp_size: int = 1, use_mla: bool = False
    ) -> ParallelStrategy:
        values = {"world_size": world_size, "rank": rank, "tp_size": tp_size, "pp_size": pp_size}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ParallelConfigError(f"{name} must be an int, got {value!r}", field=name, got=value)
        if tp_size < 1 or pp_size < 1:
            raise ParallelConfigError(
                f"tp_size and pp_size must be at least 1, got tp_size={tp_size} pp_size={pp_size}", **values
            )
        if world_size != tp_size * pp_size:
            raise ParallelConfigError(
                f"world_size {world_size} must equal tp_size * pp_size = {tp_size * pp_size}; "
                "pass the world of one data-parallel engine",
                **values,
            )
        if not 0 <= rank < world_size:
            raise ParallelConfigError(f"rank {rank} is outside [0, {world_size})", **values)
        tp_rank, pp_rank = rank % tp_size, rank // tp_size
        if use_mla:
            kv_world_size, kv_rank, stores = pp_size, pp_rank, tp_rank == 0
        else:
            kv_world_size, kv_rank, stores = world_size, rank, True
        return cls(
            world_size=world_size,
            rank=rank,
            tp_size=tp_size,
            pp_size=pp_size,
            use_mla=bool(use_mla),
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            kv_world_size=kv_world_size,
            kv_rank=kv_rank,
            stores=stores,
        )

    @classmethod
    def single(cls) -> ParallelStrategy:
        """One process holding the whole KV cache."""
        return cls.from_config(1, 0)
