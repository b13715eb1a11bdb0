"""Our HTTP requests and response parsers against vLLM 0.33.0's own pydantic models.

vLLM is not installed in the project's venv (it is a 9.4 GB CUDA install). The contract
environment puts only vLLM's protocol modules and their small imports in a git-ignored
folder (``ops/contract/setup_vllm_env.sh``, about 30 s the first time, instant after);
the check itself runs in a subprocess with that folder on PYTHONPATH, so nothing of vLLM
leaks into this test process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract.vllm_site import build_contract_site, run_in_contract_site
from tests.source_tree import ROOT

CHECK = ROOT / "ops" / "contract" / "check_vllm_protocol.py"

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module")
def contract_site() -> str:
    return build_contract_site()


def test_requests_and_responses_match_vllm_protocol(contract_site: str, tmp_path: Path):
    result = run_in_contract_site(contract_site, [str(CHECK)], tmp_path)
    report = result.stdout + result.stderr[-4000:]
    assert result.returncode == 0, report
    assert "vLLM 0.33.0" in result.stdout
    assert "contract: all checks passed" in result.stdout
    assert "FAIL" not in result.stdout
