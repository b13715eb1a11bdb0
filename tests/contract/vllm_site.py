"""The vLLM contract environment that tests/contract/ and the streamed-request contract
test (tests/inference/test_vllm_stream_contract.py) share: vLLM 0.33.0's protocol modules
and their small imports in a git-ignored folder (``ops/contract/setup_vllm_env.sh``, about
30 s the first time, instant after), and a check run in a subprocess with that folder on
PYTHONPATH, so nothing of vLLM leaks into the test process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.source_tree import ROOT

SETUP = ROOT / "ops" / "contract" / "setup_vllm_env.sh"
BUILD_TIMEOUT_S = 600  # seconds; the vLLM wheel alone is 336 MB from an empty pip cache
CHECK_TIMEOUT_S = 300  # seconds; a generous bound on importing vLLM's modules (and torch)


def build_contract_site() -> str:
    """Build (or reuse) the contract environment and return its folder; fails, never skips,
    when it cannot."""
    env = {**os.environ, "PYTHON": sys.executable}
    built = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=BUILD_TIMEOUT_S
    )
    assert built.returncode == 0, f"contract env build failed:\n{built.stderr[-4000:]}"
    return built.stdout.strip().splitlines()[-1]


def run_in_contract_site(site: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``python ARGS`` (a script's path, or ``-c`` and code) in ``cwd`` with the contract
    environment ``site`` on PYTHONPATH."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": site},
        cwd=cwd,
        timeout=CHECK_TIMEOUT_S,
    )
