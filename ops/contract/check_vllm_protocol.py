"""Contract check: our vLLM requests and parsers against vLLM's own protocol models.

Runs inside the contract environment (``ops/contract/setup_vllm_env.sh``): the project's
venv Python with vLLM 0.33.0's protocol modules on PYTHONPATH. For each vLLM backend:

- every request we build validates as vLLM's request model, every key we send is a field
  vLLM declares (its models accept or ignore unknown keys silently, so a renamed field
  would otherwise go unnoticed), the values arrive unchanged, and vLLM can turn the
  request into its ``SamplingParams`` (which runs vLLM's own range checks);
- every response vLLM's response model can serialize parses into the TokenOutput we
  expect, for each finish reason.

Prints one line per check and exits non-zero on the first failure.
"""

from __future__ import annotations

import base64
import io
import json
import sys
from typing import Any

import numpy as np
from vllm import __version__ as vllm_version
from vllm.entrypoints.openai.completion import protocol as completion
from vllm.entrypoints.scale_out.token_in_token_out import protocol as tito
from vllm.outputs import WeightVersionSpan
from vllm.sampling_params import SamplingParams as VllmSamplingParams

from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.inference.backends import (
    EngineCall,
    VllmCompletionsBackend,
    VllmGenerateBackend,
)

CALLS = [
    EngineCall("e-plain", [1, 2, 3], TurnSamplingParams(), max_tokens=16),
    EngineCall(
        "e-full",
        [5, 0, 7, 151643],
        max_tokens=300,
        model="policy",
        priority=-2,
        sampling=TurnSamplingParams(
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            logprobs=True,
            seed=1234,
            stop_token_ids=[151645, 151643],
            ignore_eos=True,
        ),
    ),
    EngineCall("e-verl", [9] * 50, TurnSamplingParams(top_k=-1, logprobs=True), max_tokens=1),
]

TOKENS = [11, 0, 151645]
LOGPROBS = [-0.5, -1.25, -0.0625]


def check(name: str, condition: bool, detail: Any = "") -> None:
    print(f"{'ok  ' if condition else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
    if not condition:
        sys.exit(1)


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def wire(model: Any) -> Any:
    """What vLLM's server puts on the wire for a response model."""
    return json.loads(model.model_dump_json())


# -- /v1/completions ---------------------------------------------------------------------


def check_completion_requests() -> None:
    declared = set(completion.CompletionRequest.model_fields)
    for call in CALLS:
        body = VllmCompletionsBackend().build_request(call)
        name = f"completions request {call.engine_request_id}"
        check(f"{name}: keys declared by vLLM", set(body) <= declared, set(body) - declared)
        req = completion.CompletionRequest.model_validate(json.loads(json.dumps(body)))
        check(f"{name}: prompt is token ids", req.prompt == call.prompt_ids, req.prompt)
        check(f"{name}: request id kept", req.request_id == call.engine_request_id)
        check(f"{name}: token ids returned", req.return_token_ids is True)
        check(f"{name}: tokens as ids", req.return_tokens_as_token_ids is True)
        check(f"{name}: priority", req.priority == call.priority)
        check(f"{name}: model", req.model == call.model)
        sp = req.to_sampling_params(max_tokens=call.max_tokens)
        check_sampling(name, sp, call)


def check_sampling(name: str, sp: VllmSamplingParams, call: EngineCall) -> None:
    s = call.sampling
    check(f"{name}: max_tokens", sp.max_tokens == call.max_tokens, sp.max_tokens)
    check(f"{name}: logprobs 0 iff asked", sp.logprobs == (0 if s.logprobs else None), sp.logprobs)
    check(f"{name}: seed", sp.seed == s.seed)
    check(f"{name}: temperature/top_p", (sp.temperature, sp.top_p) == (s.temperature, s.top_p))
    # vLLM "quietly accepts -1 as disabled"; verl sends -1, so do we.
    check(f"{name}: top_k", sp.top_k == s.top_k, sp.top_k)
    check(
        f"{name}: min_p/penalties",
        (sp.min_p, sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty)
        == (s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty),
    )
    check(f"{name}: stop_token_ids", list(sp.stop_token_ids or []) == (s.stop_token_ids or []))
    check(f"{name}: ignore_eos", sp.ignore_eos == s.ignore_eos)


def check_completion_responses() -> None:
    for finish, expected in (("stop", "completed"), ("length", "completed"), ("abort", "aborted")):
        experts = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
        response = completion.CompletionResponse(
            model="policy",
            usage={"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
            choices=[
                completion.CompletionResponseChoice(
                    index=0,
                    text="x",
                    finish_reason=finish,
                    token_ids=TOKENS,
                    prompt_token_ids=[1, 2, 3],
                    logprobs=completion.CompletionLogProbs(
                        text_offset=[0, 1, 2],
                        token_logprobs=LOGPROBS,
                        tokens=[f"token_id:{t}" for t in TOKENS],
                        top_logprobs=[
                            {f"token_id:{t}": lp} for t, lp in zip(TOKENS, LOGPROBS, strict=True)
                        ],
                    ),
                    routed_experts=npy_b64(experts),
                    weight_versions=[WeightVersionSpan(version="v3", start=0, end=3)],
                )
            ],
        )
        out = VllmCompletionsBackend().parse_response(wire(response))
        name = f"completions response finish={finish}"
        check(f"{name}: token ids", out.token_ids == TOKENS, out.token_ids)
        check(f"{name}: logprobs", out.log_probs == LOGPROBS, out.log_probs)
        check(f"{name}: stop reason", out.stop_reason == expected, out.stop_reason)
        check(f"{name}: routed experts", np.array_equal(out.routed_experts, experts))
        check(f"{name}: weight version", out.extra_fields.get("weight_version") == "v3")
    # Without logprobs (not asked) vLLM sends logprobs: null; the ids come from token_ids.
    bare = completion.CompletionResponse(
        model="policy",
        usage={"prompt_tokens": 1, "total_tokens": 3, "completion_tokens": 2},
        choices=[
            completion.CompletionResponseChoice(
                index=0, text="", finish_reason="stop", token_ids=[4, 5]
            )
        ],
    )
    out = VllmCompletionsBackend().parse_response(wire(bare))
    check(
        "completions response without logprobs",
        (out.token_ids, out.log_probs) == ([4, 5], None),
        out,
    )


# -- /inference/v1/generate --------------------------------------------------------------


def check_generate_requests() -> None:
    declared = set(tito.GenerateRequest.model_fields)
    sp_declared = set(VllmSamplingParams.__struct_fields__)
    for call in CALLS:
        body = VllmGenerateBackend().build_request(call)
        name = f"generate request {call.engine_request_id}"
        check(f"{name}: keys declared by vLLM", set(body) <= declared, set(body) - declared)
        sp_keys = set(body["sampling_params"])
        check(
            f"{name}: sampling keys declared by vLLM", sp_keys <= sp_declared, sp_keys - sp_declared
        )
        req = tito.GenerateRequest.model_validate(json.loads(json.dumps(body)))
        check(f"{name}: token ids", req.token_ids == call.prompt_ids)
        check(f"{name}: request id kept", req.request_id == call.engine_request_id)
        check(f"{name}: tokens only", req.output_mode == "tokens" and not req.stream)
        check(f"{name}: priority", req.priority == call.priority)
        check(f"{name}: model", req.model == call.model)
        check(f"{name}: no detokenize", req.sampling_params.detokenize is False)
        for key in sp_keys:
            check(
                f"{name}: sampling key {key} marked as provided",
                req.is_sampling_param_provided(key),
            )
        check_sampling(name, req.sampling_params, call)


def check_generate_responses() -> None:
    for finish, expected in (("stop", "completed"), ("length", "completed"), ("abort", "aborted")):
        response = tito.GenerateTokensResponse(
            request_id="e1",
            model="policy",
            choices=[
                tito.GenerateTokensChoice(
                    index=0,
                    finish_reason=finish,
                    token_ids=TOKENS,
                    logprobs=tito.GenerateLogProbs(
                        content=[
                            tito.GenerateLogProbsContent(token_id=t, logprob=lp, rank=1)
                            for t, lp in zip(TOKENS, LOGPROBS, strict=True)
                        ]
                    ),
                    weight_versions=[
                        WeightVersionSpan(version="v1", start=0, end=1),
                        WeightVersionSpan(version="v2", start=1, end=3),
                    ],
                )
            ],
        )
        out = VllmGenerateBackend().parse_response(wire(response))
        name = f"generate response finish={finish}"
        check(f"{name}: token ids", out.token_ids == TOKENS, out.token_ids)
        check(f"{name}: logprobs", out.log_probs == LOGPROBS, out.log_probs)
        check(f"{name}: stop reason", out.stop_reason == expected, out.stop_reason)
        check(
            f"{name}: weight version of the last token",
            out.extra_fields.get("weight_version") == "v2",
        )
    bare = tito.GenerateTokensResponse(
        choices=[tito.GenerateTokensChoice(index=0, finish_reason="stop", token_ids=[4])]
    )
    out = VllmGenerateBackend().parse_response(wire(bare))
    check("generate response without logprobs", (out.token_ids, out.log_probs) == ([4], None))


def main() -> None:
    print(f"vLLM {vllm_version}: {completion.__file__}")
    check_completion_requests()
    check_completion_responses()
    check_generate_requests()
    check_generate_responses()
    print("contract: all checks passed")


if __name__ == "__main__":
    main()
