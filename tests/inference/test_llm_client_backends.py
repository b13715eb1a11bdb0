"""Pure pieces of the LLM client: the per-turn budget and each backend's build/parse."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from pydantic import ValidationError

from rolloutbus.config import RolloutConfig
from rolloutbus.schemas.inference import TurnSamplingParams
from rolloutbus.streams.inference.backends import (
    EngineCall,
    SglangGenerateBackend,
    VllmCompletionsBackend,
    VllmGenerateBackend,
    backend_for,
    error_message,
    map_finish_reason,
)
from rolloutbus.streams.inference.llm_client import per_turn_max_tokens


@pytest.mark.parametrize(
    ("prompt_len", "requested", "max_model_len", "expected"),
    [
        (100, None, None, 512),  # a fresh trajectory gets the whole response_length
        (1024, None, None, 512),  # a full-length prompt still gets response_length
        (1300, None, None, 236),  # later turns: what is left of prompt+response budget
        (1535, None, None, 1),  # one token left
        (1536, None, None, 1),  # budget spent: clamped up to 1 (the loop stops on length)
        (2000, None, None, 1),  # over budget: still at least 1
        (100, 64, None, 64),  # an explicit smaller max_tokens wins
        (100, 4096, None, 512),  # a larger one does not
        (1300, 300, None, 236),
        (100, None, 300, 200),  # max_model_len - len(prompt) caps it
        (100, None, 4096, 512),
        (299, None, 300, 1),
    ],
)
def test_per_turn_max_tokens(prompt_len, requested, max_model_len, expected):
    rollout = RolloutConfig(prompt_length=1024, response_length=512, max_model_len=max_model_len)
    assert per_turn_max_tokens(prompt_len, rollout, requested) == expected


def test_sampling_params_validation():
    assert TurnSamplingParams.model_validate({"logprobs": 0}).logprobs is True  # vLLM's int form
    assert TurnSamplingParams.model_validate({"logprobs": False}).logprobs is False
    assert TurnSamplingParams.model_validate({"max_new_tokens": 5}).max_tokens == 5
    with pytest.raises(ValidationError, match="do_sampel"):
        TurnSamplingParams.model_validate({"do_sampel": True})


def call(**sampling) -> EngineCall:
    return EngineCall(
        engine_request_id="e1",
        prompt_ids=[1, 2],
        max_tokens=4,
        sampling=TurnSamplingParams.model_validate(sampling),
    )


def test_map_finish_reason_follows_verl():
    assert map_finish_reason("abort") == "aborted"
    assert map_finish_reason("stop") == map_finish_reason("length") == "completed"
    assert map_finish_reason(None) is None
    assert map_finish_reason("error") == "error"


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'tgi'"):
        backend_for("tgi")


def test_optional_fields_are_not_sent():
    body = VllmCompletionsBackend().build_request(call())
    assert {"model", "seed", "stop_token_ids", "logprobs", "priority"}.isdisjoint(body)


# -- vLLM /v1/completions ----------------------------------------------------------------


def completion(**choice):
    return {"id": "c", "model": "m", "choices": [{"index": 0, "text": "", **choice}]}


def test_completions_token_ids_from_logprob_tokens_when_vllm_is_old():
    out = VllmCompletionsBackend().parse_response(
        completion(
            finish_reason="length",
            logprobs={"token_logprobs": [-1.0, -2.0], "tokens": ["token_id:5", "token_id:6"]},
        )
    )
    assert out.token_ids == [5, 6] and out.log_probs == [-1.0, -2.0]


def test_completions_without_any_token_ids_is_an_error():
    with pytest.raises(ValueError, match="no token ids"):
        VllmCompletionsBackend().parse_response(completion(finish_reason="stop"))


def test_completions_null_logprob_and_count_mismatch_are_errors():
    backend = VllmCompletionsBackend()
    with pytest.raises(ValueError, match="no logprob"):
        backend.parse_response(completion(token_ids=[1], logprobs={"token_logprobs": [None]}))
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        backend.parse_response(completion(token_ids=[1, 2], logprobs={"token_logprobs": [-1.0]}))
    with pytest.raises(ValidationError):
        backend.parse_response({"choices": []})


def test_completions_routed_experts_and_weight_version():
    experts = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)
    buf = io.BytesIO()
    np.save(buf, experts)
    out = VllmCompletionsBackend().parse_response(
        completion(
            token_ids=[1, 2, 3],
            finish_reason="stop",
            routed_experts=base64.b64encode(buf.getvalue()).decode(),
            weight_versions=[
                {"version": "3", "start": 0, "end": 1},
                {"version": "4", "start": 1, "end": 3},
            ],
        )
    )
    np.testing.assert_array_equal(out.routed_experts, experts)
    # the turn's last token's version, and verl's min/max over its spans (weights changed)
    assert out.extra_fields == {
        "finish_reason": "stop",
        "weight_version": "4",
        "min_global_steps": 3,
        "max_global_steps": 4,
    }


def test_completions_reported_preemptions_pass_through():
    out = VllmCompletionsBackend().parse_response(
        completion(token_ids=[1], finish_reason="stop", num_preempted=2)
    )
    assert out.num_preempted == 2


# -- vLLM /inference/v1/generate ---------------------------------------------------------


def test_generate_logprob_ids_must_match_the_tokens():
    with pytest.raises(ValueError, match="differ"):
        VllmGenerateBackend().parse_response(
            {
                "choices": [
                    {
                        "index": 0,
                        "token_ids": [1, 2],
                        "logprobs": {
                            "content": [
                                {"token_id": 1, "logprob": -1.0},
                                {"token_id": 9, "logprob": -1.0},
                            ]
                        },
                    }
                ]
            }
        )


def test_generate_request_sends_seed_and_stops_inside_sampling_params():
    body = VllmGenerateBackend().build_request(call(seed=5, stop_token_ids=[0], logprobs=True))
    assert body["sampling_params"]["seed"] == 5
    assert body["sampling_params"]["stop_token_ids"] == [0]
    assert body["sampling_params"]["logprobs"] == 0


# -- SGLang /generate ---------------------------------------------------------------------


def test_sglang_finish_reason_dict_or_string_and_no_logprobs():
    backend = SglangGenerateBackend()
    out = backend.parse_response(
        {"output_ids": [4], "meta_info": {"finish_reason": {"type": "length", "length": 1}}}
    )
    assert out.stop_reason == "completed" and out.log_probs is None
    out = backend.parse_response({"output_ids": [4], "meta_info": {"finish_reason": "abort"}})
    assert out.stop_reason == "aborted"
    assert backend.build_request(call())["return_logprob"] is False


# -- error bodies --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"error": {"message": "too long", "code": 400}}', "too long"),  # vLLM
        ('{"object": "error", "message": "bad model"}', "bad model"),  # older vLLM
        ('{"detail": "Not Found"}', "Not Found"),  # FastAPI
        ("Internal Server Error", "Internal Server Error"),  # plain text
    ],
)
def test_error_message(text, expected):
    assert error_message(text) == expected
