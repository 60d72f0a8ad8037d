"""Import-layer contracts at run time: importing core or the server loads nothing heavy.

The static contracts (which package may import which, and what core, the server, the
transport and gpu never import) are import-linter's: `[tool.importlinter]` in the root
pyproject.toml, run by `lint-imports` in `nox -s lint`. This file keeps what a static scan
cannot see: the modules a fresh interpreter really holds after the import.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ["torch", "numpy", "zmq", "msgspec", "vllm", "triton", "structlog", "prometheus_client"]

# package -> modules that importing it must not load
FORBIDDEN_AT_RUNTIME = {
    "core": set(HEAVY),
    "server": {"torch", "vllm", "triton", "kvdepot.gpu", "kvdepot.vllm_connector"},
    "gpu": {"zmq", "msgspec", "vllm", "kvdepot.transport", "kvdepot.server", "kvdepot.vllm_connector"},
    "transport": {"torch", "vllm", "triton", "kvdepot.gpu", "kvdepot.server", "kvdepot.vllm_connector"},
}


def _modules_after_import(module: str) -> list[str]:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("package", sorted(FORBIDDEN_AT_RUNTIME))
def test_runtime_import_leaves_heavy_modules_out(package):
    """Importing the package in a fresh interpreter loads no forbidden module."""
    if importlib.util.find_spec(f"kvdepot.{package}") is None:
        pytest.skip(f"kvdepot.{package} is not installed")
    forbidden = FORBIDDEN_AT_RUNTIME[package]
    loaded = _modules_after_import(f"kvdepot.{package}")
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not bad, f"importing kvdepot.{package} loaded {bad}"


def test_kvdepot_is_a_namespace_package():
    """No distribution ships kvdepot/__init__.py, so every package shares the namespace."""
    import kvdepot

    assert kvdepot.__spec__.origin is None
    assert not list(ROOT.glob("packages/*/src/kvdepot/__init__.py"))


@pytest.mark.slow
@pytest.mark.integration
def test_core_alone_in_a_fresh_venv(tmp_path):
    """In a venv holding only kvdepot-core (and attrs), the import works and pulls nothing heavy."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT / "packages" / "core")],
        check=True,
    )
    code = (
        "import sys, json, importlib.metadata as md; import kvdepot.core as c;"
        "c.chunk_keys(c.Namespace(model='m'), list(range(256)));"
        "print(json.dumps([sorted(sys.modules), sorted(d.metadata['Name'] for d in md.distributions())]))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    modules, dists = json.loads(out.stdout)
    assert not [m for m in modules if m.split(".")[0] in HEAVY]
    assert {d.lower() for d in dists} - {"pip", "setuptools"} == {"kvdepot-core", "attrs"}


def _private_imports_of_others(package: str) -> list[str]:
    """`kvdepot.OTHER._module` imports in `package`'s source: another package's internals."""
    import ast

    found = []
    for path in sorted((ROOT / "packages" / package / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if len(parts) > 2 and parts[0] == "kvdepot" and parts[1] != package and parts[2].startswith("_"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    return found


@pytest.mark.parametrize("package", ["core", "transport", "gpu", "server", "vllm_connector"])
def test_packages_use_only_each_others_public_names(package):
    """A package imports another's public API, never its `_private` modules: each has its own
    version and may change its internals in any release."""
    assert _private_imports_of_others(package) == []
