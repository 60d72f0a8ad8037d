"""vLLM's own scheduler classes with kvdepot's connector, built by hand: the harness of the tests
that drive vLLM's scheduling (`test_async_scheduling.py`) and its model runners' connector order
(`test_model_runner_v2.py`) without running a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from kvdepot.core import chunk_keys
from kvdepot.transport import CacheClient

CHUNK = 256
# vLLM's block sizes: its CPU backend's, and the CUDA backends' default. Engines take the block
# size from their attention backend; a scheduler built by hand from the config must be told
# (vLLM 0.33 moved the CPU default out of the config, into the executor).
CPU_BLOCK, CUDA_BLOCK = 128, 16
NUM_BLOCKS = 64
#: Hits load asynchronously (the connector's default loads a hit in RAM synchronously when it fits
#: the step's budget: `_sync_budget.py`).
ASYNC = {"kvdepot.sync_load_bytes": 0}


def make_scheduler(
    model: Path,
    address: str,
    *,
    window: int = 0,
    sync: bool = False,
    num_blocks: int = NUM_BLOCKS,
    block_size: int = CPU_BLOCK,
    kv_role: str = "kv_both",
    connector: dict[str, Any] | None = None,
    **engine: Any,
) -> Any:
    """vLLM's `AsyncScheduler` with the connector (its synchronous `Scheduler` with ``sync``); with
    ``window``, a Gemma-2-like model's two KV-cache groups (layers 0 and 2 slide over ``window``
    tokens) and the synchronous `Scheduler`. ``num_blocks`` counts blocks of `CPU_BLOCK` tokens
    whatever ``block_size`` is, so that every block size holds the same tokens."""
    num_blocks = num_blocks * CPU_BLOCK // block_size
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = EngineArgs(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        block_size=block_size,
        kv_transfer_config={
            "kv_connector": "KVDepotConnector",
            "kv_connector_module_path": "kvdepot.vllm_connector",  # whatever the registry holds
            "kv_role": kv_role,
            # Asynchronous loads unless a test asks for synchronous ones (the default on an idle engine).
            "kv_connector_extra_config": {"kvdepot.address": address, **ASYNC, **(connector or {})},
        },
        **engine,
    ).create_engine_config()
    config.cache_config.num_gpu_blocks = num_blocks
    block = config.cache_config.block_size
    attn = {"block_size": block, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    groups = [KVCacheGroupSpec(layers, FullAttentionSpec(**attn))]
    if window:
        groups = [
            KVCacheGroupSpec(layers[0::2], SlidingWindowSpec(**attn, sliding_window=window)),
            KVCacheGroupSpec(layers[1::2], FullAttentionSpec(**attn)),
        ]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    return (Scheduler if window or sync else AsyncScheduler)(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block,
    )


def sync_loads_up_to_the_cap(scheduler: Any) -> None:
    """Every pass may load up to `kvdepot.sync_load_bytes` synchronously, busy or not: the steps
    driven here take microseconds, so a share of their time would fit no hit (`_sync_budget.py`)."""
    budget = scheduler.connector._scheduler.sync.budget
    budget.step_s, budget.rate = 1.0, float("inf")
    budget.copied = lambda nbytes, seconds: None  # no worker reports a rate here
    budget.step_took = lambda seconds: None


def make_request(scheduler: Any, req_id: str, tokens: list[int], max_tokens: int, *, priority: int = 0) -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from vllm import SamplingParams

    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(
        req_id,
        tokens,
        params,
        None,
        block_hasher=get_request_block_hasher(scheduler.block_size, hash_fn),
        priority=priority,
    )


def store_prefix(scheduler: Any, address: str, tokens: list[int]) -> int:
    """Commit the chunks of ``tokens`` in the server under the connector's own keys (bytes are zeros)."""
    from kvdepot.vllm_connector._connector import layout_name

    side = scheduler.connector._scheduler
    namespace = attrs.evolve(side.planner.namespace, cache_salt="", lora="", extra=(), kv_rank=0).for_rank(0)
    keys = chunk_keys(namespace, tokens, CHUNK)
    with CacheClient(address) as client:
        client.register(layout_name(scheduler.vllm_config), CHUNK, 4096, 1, 0, "m").result(5)
        reply = client.reserve("", keys, 4096).result(5)
        client.commit(reply.reservation_id).result(5)
    return len(keys)


def runner_output(
    scheduled: Any,
    *,
    recving: set[str] = frozenset(),
    sending: set[str] = frozenset(),
    prefilling: Any = None,
    connector_output: Any = None,
) -> Any:
    """What the model runner returns for a step: one sampled token per request past its prompt.

    With ``prefilling`` (the scheduler's requests, synchronous scheduling), none for a request whose
    prompt is not all computed yet (chunked prefill). ``connector_output``: the workers' own
    `KVConnectorOutput` (else one made of ``recving`` and ``sending``).
    """
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    req_ids = list(scheduled.num_scheduled_tokens)

    def sampled(req_id: str) -> list[int]:
        request = (prefilling or {}).get(req_id)
        return [] if request is not None and request.num_computed_tokens < request.num_tokens else [7]

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled(r) for r in req_ids],
        kv_connector_output=connector_output
        or KVConnectorOutput(finished_recving=set(recving), finished_sending=set(sending)),
    )
