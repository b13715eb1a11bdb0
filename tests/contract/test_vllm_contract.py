"""Our HTTP requests and response parsers against vLLM 0.33.0's own pydantic models.

vLLM is not installed in the project's venv (it is a 9.4 GB CUDA install). The contract
environment puts only vLLM's protocol modules and their small imports in a git-ignored
folder (``ops/contract/setup_vllm_env.sh``, about 30 s the first time, instant after);
the check itself runs in a subprocess with that folder on PYTHONPATH, so nothing of vLLM
leaks into this test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "ops" / "contract" / "setup_vllm_env.sh"
CHECK = ROOT / "ops" / "contract" / "check_vllm_protocol.py"

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module")
def contract_site() -> str:
    """Build (or reuse) the contract environment; fails, never skips, when it cannot."""
    env = {**os.environ, "PYTHON": sys.executable}
    built = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=600
    )
    assert built.returncode == 0, f"contract env build failed:\n{built.stderr[-4000:]}"
    return built.stdout.strip().splitlines()[-1]


def test_requests_and_responses_match_vllm_protocol(contract_site: str, tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": contract_site}
    result = subprocess.run(
        [sys.executable, str(CHECK)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    report = result.stdout + result.stderr[-4000:]
    assert result.returncode == 0, report
    assert "vLLM 0.33.0" in result.stdout
    assert "contract: all checks passed" in result.stdout
    assert "FAIL" not in result.stdout
