"""Import-layer contracts: core is pure, the server never touches torch or vLLM.

Two checks per contract: a static scan of every import statement in the package's
source, and a fresh interpreter that imports the package and inspects sys.modules.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ["torch", "numpy", "zmq", "msgspec", "vllm", "triton", "structlog", "prometheus_client"]

# package -> (allowed third-party top-level modules, forbidden modules) ; stdlib always allowed
CONTRACTS = {
    "core": ({"attrs"}, set(HEAVY)),
    "server": (None, {"torch", "vllm", "triton", "kvdepot.gpu", "kvdepot.vllm_connector"}),
    "gpu": (None, {"zmq", "msgspec", "vllm", "kvdepot.transport", "kvdepot.server", "kvdepot.vllm_connector"}),
    "transport": (None, {"torch", "vllm", "triton", "kvdepot.gpu", "kvdepot.server", "kvdepot.vllm_connector"}),
}


def _imports(src: Path) -> set[str]:
    names: set[str] = set()
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return names


def _package_present(name: str) -> bool:
    return (ROOT / "packages" / name / "src" / "kvdepot" / name).is_dir()


@pytest.mark.parametrize("package", sorted(CONTRACTS))
def test_static_imports_respect_contract(package):
    """No import statement in the package's source names a forbidden module."""
    if not _package_present(package):
        pytest.skip(f"packages/{package} does not exist yet")
    allowed, forbidden = CONTRACTS[package]
    for name in _imports(ROOT / "packages" / package / "src"):
        top = name.split(".")[0]
        assert not any(name == f or name.startswith(f + ".") for f in forbidden), f"{package} imports {name}"
        if allowed is not None and top != "kvdepot":
            assert top in sys.stdlib_module_names or top in allowed, f"{package} imports non-stdlib {name}"
        if allowed is not None and top == "kvdepot":
            assert name.startswith(f"kvdepot.{package}"), f"{package} imports sibling package {name}"


def _modules_after_import(module: str) -> list[str]:
    code = f"import sys, json; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("package", sorted(CONTRACTS))
def test_runtime_import_leaves_heavy_modules_out(package):
    """Importing the package in a fresh interpreter loads no forbidden module."""
    if importlib.util.find_spec(f"kvdepot.{package}") is None:
        pytest.skip(f"kvdepot.{package} is not installed")
    forbidden = CONTRACTS[package][1]
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
