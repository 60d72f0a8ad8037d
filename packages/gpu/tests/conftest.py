"""Fixtures: the engine-shaped KV caches of kvdepot.gpu.testing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvdepot.gpu.testing import LAYOUT_NAMES, Case, build_case


@pytest.fixture
def make_case() -> Callable[..., Case]:
    return build_case


@pytest.fixture(params=LAYOUT_NAMES)
def case(request: pytest.FixtureRequest) -> Case:
    return build_case(request.param, torch.bfloat16)


@pytest.fixture
def triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter (TRITON_INTERPRET=1) for CPU runs of the CUDA kernel; a skip where this
    Triton's interpreter cannot run the kernel's loop (a runtime-bounded `range`): Triton 3.6's cannot
    under NumPy 2.4, while its compiler, on a GPU, can (the `gpu` tests run the kernel there)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kvdepot.gpu import _triton

    words = torch.arange(8, dtype=torch.int64)
    rows = torch.tensor([[0, 2, 4, 2, 2]], dtype=torch.int64)  # block 1 is words 2-3; its slot place, 4-5
    try:
        _triton.copy_blocks(
            words, rows, torch.tensor([1]), torch.tensor([0]), torch.tensor([0]),
            blocks=1, tile_words=2, to_pool=True, programs=1,
        )  # fmt: skip
    except Exception as exc:  # triton.runtime.errors.InterpreterError
        if "0-dimensional" not in str(exc):
            raise
        pytest.skip(f"this Triton's interpreter cannot run a loop with runtime bounds: {exc}")
    assert words[4:6].tolist() == [2, 3]
