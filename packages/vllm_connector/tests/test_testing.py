"""The registry patch and the test-model builder in kvdepot.vllm_connector.testing."""

from __future__ import annotations

import json
import threading

import pytest

from kvdepot.vllm_connector import testing
from kvdepot.vllm_connector._model import MARKER_FILE


def original():
    return "original"


def test_registry_patch_stubs_and_restores():
    """Stubbed names load the given class; restore() brings back replaced entries and drops added ones."""
    registry = {"A": original}
    sentinel = type("Sentinel", (), {})
    with testing.ConnectorRegistryPatch(registry) as patch:
        patch.stub("A", "B", cls=sentinel)
        assert registry["A"]() is sentinel
        assert patch.loaded == ["A"]
        patch.remove("A")
        assert "A" not in registry
    assert registry == {"A": original}


def test_registry_patch_stub_offloading_covers_every_backend_name():
    """stub_offloading() covers each name kv_offloading_backend can select, and kvdepot's own."""
    registry: dict = {}
    with testing.ConnectorRegistryPatch(registry) as patch:
        patch.stub_offloading(cls=object)
        assert set(registry) == set(testing.OFFLOADING_CONNECTOR_NAMES)
    assert registry == {}


def test_model_cache_dir_honours_env(monkeypatch, tmp_path):
    """KVDEPOT_MODEL_CACHE moves the model cache."""
    monkeypatch.setenv(testing.MODEL_CACHE_ENV, str(tmp_path))
    assert testing.model_cache_dir() == tmp_path


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    path = tmp_path_factory.mktemp("models") / "m"
    return testing.build_tiny_llama(path, num_layers=1, hidden=64, heads=2, kv_heads=1, vocab=512)


def test_build_writes_a_complete_model(small_model):
    """The directory holds config, weights, tokenizer and the completion marker with the parameters."""
    names = {p.name for p in small_model.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER_FILE} <= names
    config = json.loads((small_model / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert config["initializer_range"] == 0.1
    assert config["vocab_size"] == 512
    assert testing.tokenizer_vocab_size(small_model) == 512


def test_build_is_idempotent(small_model):
    """Building again with the same parameters reuses the directory untouched."""
    before = (small_model / "model.safetensors").stat().st_mtime_ns
    testing.build_tiny_llama(small_model, num_layers=1, hidden=64, heads=2, kv_heads=1, vocab=512)
    assert (small_model / "model.safetensors").stat().st_mtime_ns == before


def test_build_is_deterministic(small_model, tmp_path):
    """The same parameters and seed give byte-identical weights."""
    other = testing.build_tiny_llama(tmp_path / "again", num_layers=1, hidden=64, heads=2, kv_heads=1, vocab=512)
    assert (other / "model.safetensors").read_bytes() == (small_model / "model.safetensors").read_bytes()


def test_build_replaces_other_parameters(tmp_path):
    """A directory holding a model with other parameters, or a half-written one, is rebuilt."""
    pytest.importorskip("transformers")
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text("{}")  # half-written: no marker
    testing.build_tiny_llama(path, num_layers=1, hidden=64, heads=2, kv_heads=1, vocab=512, seed=1)
    assert testing.is_complete(path)
    testing.build_tiny_llama(path, num_layers=2, hidden=64, heads=2, kv_heads=1, vocab=512, seed=1)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2


def test_build_rejects_bad_head_counts(tmp_path):
    """Head counts that do not divide fail before anything is written."""
    with pytest.raises(ValueError, match="multiple"):
        testing.build_tiny_llama(tmp_path / "bad", hidden=100, heads=3)
    assert not (tmp_path / "bad").exists()


def test_store_gate_holds_until_its_path_exists(tmp_path):
    """`wait_for_gate` (the hook of ``kvdepot.test.store_gate``) returns only once its file exists."""
    gate = tmp_path / "go"
    waiting = threading.Thread(target=testing.wait_for_gate, args=(str(gate),))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive(), "returned with no gate"  # a slow machine only makes it wait longer
    gate.touch()
    waiting.join(testing.STORE_GATE_MAX_S)
    assert not waiting.is_alive(), "the gate opened and it still waits"


def test_the_store_gate_is_a_hook_only_where_a_test_sets_it(tmp_path):
    """Without ``kvdepot.test.store_gate`` the connector installs no hook before commits."""
    pytest.importorskip("vllm")
    from kvdepot.vllm_connector._connector import _store_gate

    assert _store_gate(None) is None
    hook = _store_gate(str(tmp_path))
    assert hook is not None
    hook()  # the path exists: returns at once
