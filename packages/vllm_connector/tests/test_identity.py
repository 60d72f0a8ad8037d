"""What the keys say of the weights: a model or LoRA adapter directory's fingerprint."""

from __future__ import annotations

import os
from types import SimpleNamespace

from kvdepot.vllm_connector._identity import directory_fingerprint, lora_identity


def adapter(tmp_path, weights: bytes):
    directory = tmp_path / "policy-lora"
    directory.mkdir(exist_ok=True)
    (directory / "adapter_config.json").write_text('{"r": 8}')
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return directory


def test_an_adapter_written_over_in_place_gets_a_new_identity(tmp_path):
    """RL loops write each step's adapter over the last one at the same path and reload it in
    place: the next request's keys must name the new weights, as a fresh engine's would."""
    directory = adapter(tmp_path, b"\x01" * 4096)
    request = SimpleNamespace(lora_request=SimpleNamespace(lora_name="policy", lora_int_id=1, lora_path=str(directory)))
    first = lora_identity(request)
    assert lora_identity(request) == first  # unchanged files: the same identity
    adapter(tmp_path, b"\x02" * 4096)
    second = lora_identity(request)
    assert second != first
    os.rename(directory, tmp_path / "moved")  # the same files elsewhere: the same identity
    assert directory_fingerprint(str(tmp_path / "moved")) in second
