"""`kvdepot demo`, the README's main job, run as a user would."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvdepot.server._kept_pool import kept_pool_path
from kvdepot.server._pool import default_pool_dir

pytestmark = [pytest.mark.vllm, pytest.mark.engine, pytest.mark.integration, pytest.mark.slow]


def test_demo_shows_a_hit_with_identical_output(tmp_path):
    """The demo command finishes, reports a hit with identical outputs, and leaves no server
    behind, nor its pool (a kept pool of an address nothing will serve again would hold memory)."""
    pytest.importorskip("vllm")
    code = "import sys; from kvdepot.server._cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "demo", "--prompt-tokens", "1500", "--model-dir", str(tmp_path / "models")],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "outputs identical          yes" in out.stdout
    assert "hit tokens                 1280 of 1500" in out.stdout
    assert "nothing left running" in out.stdout
    leftover = subprocess.run(["pgrep", "-f", "kvdepot-demo-"], capture_output=True, text=True, check=False)
    assert leftover.stdout.strip() == ""
    (address,) = re.findall(r"starting a kvdepot server at (\S+)", out.stdout)
    assert not kept_pool_path(default_pool_dir(), address).exists()
