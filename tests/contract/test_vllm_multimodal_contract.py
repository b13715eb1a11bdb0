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
CHECK = ROOT / "tests" / "programs" / "vllm_multimodal_check.py"

pytestmark = pytest.mark.contract

# What VllmGenerateBackend.build_request sends for a call with images (EngineCall.image_urls,
# as LLMClient.generate(image_data=...) fills it), validated by vLLM's own GenerateRequest.
BUILD_REQUEST_CHECK = """
from vllm.entrypoints.scale_out.token_in_token_out import protocol as tito
from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.inference.backends import EngineCall, VllmGenerateBackend
from rolloutbus.streams.inference.multimodal import image_urls

urls = image_urls(["https://example.com/a.png", {"image": "https://example.com/b.jpg"}])
prompt = [1, 151652, 151655, 151653, 2, 151652, 151655, 151653, 3]
call = EngineCall("e-mm", prompt, TurnSamplingParams(logprobs=True), 8, image_urls=urls)
body = VllmGenerateBackend().build_request(call)
parsed = tito.GenerateRequest.model_validate(body)
assert parsed.content_parts == [
    {"type": "image_url", "url": "https://example.com/a.png"},
    {"type": "image_url", "url": "https://example.com/b.jpg"},
], parsed.content_parts
assert parsed.token_ids == prompt and parsed.features is None
text = VllmGenerateBackend().build_request(EngineCall("e-t", prompt, TurnSamplingParams(), 8))
assert tito.GenerateRequest.model_validate(text).content_parts is None
print("build_request with images: vLLM's GenerateRequest accepts it")
"""


def test_images_reach_vllms_generate_request(tmp_path: Path):
    env = {**os.environ, "PYTHON": sys.executable}
    built = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, env=env, timeout=600
    )
    assert built.returncode == 0, f"contract env build failed:\n{built.stderr[-4000:]}"
    site = built.stdout.strip().splitlines()[-1]
    # one subprocess for both checks: importing vLLM's protocol modules takes most of it
    script = f"import runpy; runpy.run_path({str(CHECK)!r}, run_name='__main__')\n"
    result = subprocess.run(
        [sys.executable, "-c", script + BUILD_REQUEST_CHECK],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": site},
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "multimodal contract: all checks passed" in result.stdout
    assert "build_request with images: vLLM's GenerateRequest accepts it" in result.stdout
