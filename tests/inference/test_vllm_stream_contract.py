"""The streamed ``vllm_completions`` request and event parser against vLLM 0.33.0's own
pydantic models (``CompletionRequest``, ``CompletionStreamResponse``), in the contract
environment of ``tests/contract/`` (vLLM's protocol modules only; no ``vllm serve``: the
events are built with vLLM's models and serialized as its server does, not recorded from a
running vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract.vllm_site import build_contract_site, run_in_contract_site

pytestmark = pytest.mark.contract

CHECK = """
import json
from vllm import __version__
from vllm.entrypoints.openai.completion import protocol as p
from vllm.outputs import WeightVersionSpan
from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.inference.backends import EngineCall, VllmCompletionsBackend

backend = VllmCompletionsBackend()
call = EngineCall(
    engine_request_id="r", prompt_ids=[1, 2, 3], max_tokens=3,
    sampling=TurnSamplingParams(temperature=1.0, logprobs=True, seed=3),
)
request = p.CompletionRequest.model_validate(backend.build_stream_request(call))
assert request.stream and request.return_token_ids and request.logprobs == 0, request


def event(ids, lps, finish=None, versions=None):
    choice = p.CompletionResponseStreamChoice(
        index=0, text="x", token_ids=ids, finish_reason=finish, weight_versions=versions,
        logprobs=p.CompletionLogProbs(
            tokens=[f"token_id:{t}" for t in ids], token_logprobs=lps,
            text_offset=[0] * len(ids), top_logprobs=[None] * len(ids),
        ),
    )
    response = p.CompletionStreamResponse(model="m", choices=[choice])
    wire = response.model_dump_json(exclude_unset=True)
    return backend.parse_stream_event(json.loads(wire))


first = event([5, 6], [-0.1, -0.2])
last = event([7], [-0.3], "length", [WeightVersionSpan(version="4", start=0, end=3)])
assert (first.token_ids, first.log_probs, first.stop_reason) == ([5, 6], [-0.1, -0.2], None)
assert (last.token_ids, last.stop_reason) == ([7], "completed"), last
assert last.extra_fields["finish_reason"] == "length" and last.extra_fields["max_global_steps"] == 4
print("vLLM", __version__, "stream contract ok")
"""


@pytest.fixture(scope="module")
def contract_site() -> str:
    return build_contract_site()


def test_the_streamed_request_and_events_match_vllm_protocol(contract_site: str, tmp_path: Path):
    result = run_in_contract_site(contract_site, ["-c", CHECK], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "vLLM 0.33.0 stream contract ok" in result.stdout
