"""Multimodal requests against vLLM 0.33.0's own protocol models: a turn's images travel as
``content_parts`` of the token-in/token-out generate request, and a token-only backend
refuses them by name. Same contract environment and subprocess as test_vllm_contract.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "ops" / "contract" / "setup_vllm_env.sh"
CHECK = ROOT / "tests" / "fixtures" / "vllm_multimodal_check.py"

pytestmark = pytest.mark.contract


def test_images_reach_vllms_generate_request(tmp_path: Path):
    env = {**os.environ, "PYTHON": sys.executable}
    built = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=600
    )
    assert built.returncode == 0, f"contract env build failed:\n{built.stderr[-4000:]}"
    site = built.stdout.strip().splitlines()[-1]
    result = subprocess.run(
        [sys.executable, str(CHECK)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": site},
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "multimodal contract: all checks passed" in result.stdout
