"""The package surface: cheap to import, lazy about vLLM, one version."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvdepot.vllm_connector as pkg
from kvdepot.vllm_connector import _version


def test_version_comes_from_one_place():
    """The public version is the one hatchling reads from _version.py."""
    assert pkg.__version__ == _version.__version__


def test_namespace_has_no_init():
    """kvdepot is a PEP 420 namespace: no package ships kvdepot/__init__.py."""
    import kvdepot

    assert kvdepot.__spec__.origin is None


def test_import_does_not_import_vllm_or_torch():
    """Importing the package and its pytest plugin loads neither vLLM nor torch (plugin loaders run everywhere)."""
    code = (
        "import sys, kvdepot.vllm_connector, kvdepot.vllm_connector.testing, kvdepot.vllm_connector._plugin;"
        "print(sorted(m for m in ('vllm', 'torch', 'lmcache', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_connector_is_public_and_lazy():
    """KVDepotConnector is exported, but resolved only on first access."""
    assert "KVDepotConnector" in pkg.__all__
    assert "KVDepotConnector" in dir(pkg)
    assert "KVDepotConnector" not in vars(pkg) or isinstance(vars(pkg)["KVDepotConnector"], type)


def test_unknown_attribute_raises_attribute_error():
    """The lazy lookup does not swallow typos."""
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = pkg.no_such_name
