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
