"""The plugin's registration logic, against a plain dict standing in for vLLM's registry."""

from __future__ import annotations

import logging
import sys

import pytest

from kvdepot.vllm_connector import _plugin
from kvdepot.vllm_connector._plugin import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    LMCACHE_MP_NAME,
    LMCacheNameOutcome,
    is_kvdepot_loader,
    register_connectors,
)


class ListHandler(logging.Handler):
    """Collects records of the plugin's logger directly: vLLM stops propagation at its "vllm" logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def plugin_log():
    logger = logging.getLogger("vllm.kvdepot.plugin")
    handler = ListHandler()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def vllm_lmcache_loader():
    """Stands in for vLLM's own entry, which would import lmcache."""
    raise AssertionError("the lmcache loader must not be called")


@pytest.fixture
def registry():
    return {LMCACHE_MP_NAME: vllm_lmcache_loader, "ExampleConnector": lambda: object}


def test_registers_kvdepot_name(registry):
    """KVDepotConnector is added, pointing at the connector module and class."""
    register_connectors(registry, lmcache_present=False, take_lmcache=False)
    loader = registry[CONNECTOR_NAME]
    assert is_kvdepot_loader(loader)
    assert getattr(loader, _plugin._KVDEPOT_LOADER_ATTR) == (CONNECTOR_MODULE, CONNECTOR_CLASS)


def test_serves_lmcache_name_when_lmcache_absent(registry):
    """Without lmcache, vLLM's LMCacheMPConnector entry is replaced by kvdepot's loader."""
    outcome = register_connectors(registry, lmcache_present=False, take_lmcache=False)
    assert outcome is LMCacheNameOutcome.SERVED
    assert is_kvdepot_loader(registry[LMCACHE_MP_NAME])
    assert registry["ExampleConnector"] is not None


def test_leaves_lmcache_name_when_lmcache_installed(registry):
    """With lmcache installed and no opt-in, the name keeps loading lmcache's connector."""
    outcome = register_connectors(registry, lmcache_present=True, take_lmcache=False)
    assert outcome is LMCacheNameOutcome.LEFT
    assert registry[LMCACHE_MP_NAME] is vllm_lmcache_loader
    assert is_kvdepot_loader(registry[CONNECTOR_NAME])


def test_takes_lmcache_name_when_asked(registry):
    """With lmcache installed, KVDEPOT_TAKE_LMCACHE makes kvdepot serve the name anyway."""
    outcome = register_connectors(registry, lmcache_present=True, take_lmcache=True)
    assert outcome is LMCacheNameOutcome.TAKEN
    assert is_kvdepot_loader(registry[LMCACHE_MP_NAME])


def test_registration_is_idempotent(registry):
    """A second registration keeps the first entries (vLLM's register_connector would refuse duplicates)."""
    register_connectors(registry, lmcache_present=False, take_lmcache=False)
    first = dict(registry)
    register_connectors(registry, lmcache_present=False, take_lmcache=False)
    assert registry == first


def test_foreign_kvdepot_entry_is_left_alone(registry, plugin_log):
    """A KVDepotConnector entry someone else registered is not overwritten, and that is logged."""

    def foreign():
        return object

    registry[CONNECTOR_NAME] = foreign
    register_connectors(registry, lmcache_present=False, take_lmcache=False)
    assert registry[CONNECTOR_NAME] is foreign
    assert any("already registered" in r.getMessage() for r in plugin_log)


def test_loader_imports_lazily_and_resolves_class(registry):
    """The loader imports its module only when called, and returns the named attribute."""
    register_connectors(registry, module="json", class_name="JSONDecoder", lmcache_present=False, take_lmcache=False)
    import json

    assert registry[CONNECTOR_NAME]() is json.JSONDecoder


def test_loader_for_missing_module_fails_when_touched(registry):
    """A loader for a module that does not exist fails only when vLLM asks for the class."""
    register_connectors(
        registry, module="kvdepot_no_such_module", class_name="X", lmcache_present=False, take_lmcache=False
    )
    with pytest.raises(ModuleNotFoundError):
        registry[CONNECTOR_NAME]()


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("YES", True), ("0", False), ("", False)])
def test_take_lmcache_env_values(value, expected):
    """KVDEPOT_TAKE_LMCACHE accepts the usual spellings of yes."""
    assert _plugin.take_lmcache_requested({_plugin.TAKE_LMCACHE_ENV: value}) is expected


def test_lmcache_probe_never_imports_it(monkeypatch):
    """Finding whether lmcache exists does not import it."""
    monkeypatch.delitem(sys.modules, "lmcache", raising=False)
    _plugin.lmcache_installed()
    assert "lmcache" not in sys.modules


def test_entry_point_logs_one_line_per_outcome(monkeypatch, plugin_log):
    """register() logs which way the LMCacheMPConnector name went, once, even when called twice."""
    fake_registry = {LMCACHE_MP_NAME: vllm_lmcache_loader}
    monkeypatch.setattr(_plugin, "_vllm_registry", lambda: fake_registry)
    monkeypatch.setattr(_plugin, "lmcache_installed", lambda: False)
    monkeypatch.delenv(_plugin.TAKE_LMCACHE_ENV, raising=False)
    monkeypatch.setattr(_plugin, "_state", {})
    _plugin.register()
    _plugin.register()
    lines = [r.getMessage() for r in plugin_log]
    assert len(lines) == 1
    assert "lmcache package is not installed" in lines[0]
    assert is_kvdepot_loader(fake_registry[LMCACHE_MP_NAME])


def test_line_waits_for_a_handler(monkeypatch):
    """Registered before logging is configured, the line is kept and logged by announce() later."""
    fake_registry = {LMCACHE_MP_NAME: vllm_lmcache_loader}
    monkeypatch.setattr(_plugin, "_vllm_registry", lambda: fake_registry)
    monkeypatch.setattr(_plugin, "lmcache_installed", lambda: True)
    monkeypatch.delenv(_plugin.TAKE_LMCACHE_ENV, raising=False)
    monkeypatch.setattr(_plugin, "_state", {})
    logger = logging.getLogger("vllm.kvdepot.plugin")
    monkeypatch.setattr(logger, "propagate", False)  # no handler anywhere: like vLLM before it configures logging
    _plugin.register()
    assert _plugin._state["logged"] is False
    handler = ListHandler()
    logger.addHandler(handler)
    try:
        logger.setLevel(logging.INFO)
        _plugin.announce()
        _plugin.announce()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert [r.getMessage() for r in handler.records] == [
        "kvdepot: registered KVDepotConnector; leaving LMCacheMPConnector to the installed lmcache package "
        "(set KVDEPOT_TAKE_LMCACHE=1 to serve it with kvdepot)"
    ]
