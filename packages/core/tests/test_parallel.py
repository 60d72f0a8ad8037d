import pytest

from kvdepot.core import ParallelConfigError, ParallelStrategy


def test_single_process():
    """One process is KV rank 0 of a world of 1 and stores."""
    p = ParallelStrategy.single()
    assert (p.kv_world_size, p.kv_rank, p.stores) == (1, 0, True)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 2), (1, 3)])
def test_without_mla_every_rank_is_a_kv_rank(tp, pp):
    """Without MLA each rank holds its own shard and stores it."""
    world = tp * pp
    strategies = [ParallelStrategy.from_config(world, r, tp, pp) for r in range(world)]
    assert [s.kv_rank for s in strategies] == list(range(world))
    assert all(s.kv_world_size == world and s.stores for s in strategies)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (4, 2), (2, 3)])
def test_mla_excludes_tp(tp, pp):
    """Under MLA the KV world counts pipeline stages and only TP rank 0 stores."""
    world = tp * pp
    strategies = [ParallelStrategy.from_config(world, r, tp, pp, use_mla=True) for r in range(world)]
    for s in strategies:
        assert s.kv_world_size == pp
        assert s.kv_rank == s.rank // tp == s.pp_rank
        assert s.stores == (s.tp_rank == 0)
    assert sum(s.stores for s in strategies) == pp


@pytest.mark.parametrize(
    "args",
    [
        (3, 0, 2, 1),
        (4, 4, 2, 2),
        (4, -1, 2, 2),
        (0, 0, 1, 1),
        (2, 0, 0, 2),
        (2, 0, 2, 0),
        (2.0, 0, 2, 1),
        (2, 0, True, 2),
    ],
)
def test_inconsistent_inputs_raise(args):
    """Sizes that do not multiply out, or a rank outside the world, raise ParallelConfigError."""
    with pytest.raises(ParallelConfigError):
        ParallelStrategy.from_config(*args)
