"""One vocabulary for the engine APIs: what the LLM client sends, the replica accepts as is;
the replica refuses what it does not know, the client tolerates what it does not need."""

from __future__ import annotations

import enum
import json

import pytest
from pydantic import ValidationError

from rolloutbus.replica.server import HTTPProblem, validate_request_body
from rolloutbus.schemas.inference import (
    SglangGenerateRequest,
    TurnSamplingParams,
    VllmCompletionRequest,
    VllmCompletionResponse,
    VllmGenerateRequest,
)
from rolloutbus.streams.inference.backends import (
    EngineCall,
    SglangGenerateBackend,
    VllmCompletionsBackend,
    VllmGenerateBackend,
)

CALL = EngineCall(
    "e1",
    [5, 6, 7],
    max_tokens=8,
    model="policy",
    priority=-1,
    sampling=TurnSamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        logprobs=True,
        seed=3,
        stop_token_ids=[2],
        ignore_eos=True,
    ),
)
APIS = [
    pytest.param(VllmCompletionsBackend(), VllmCompletionRequest, id="vllm_completions"),
    pytest.param(VllmGenerateBackend(), VllmGenerateRequest, id="vllm_generate"),
    pytest.param(SglangGenerateBackend(), SglangGenerateRequest, id="sglang"),
]


@pytest.mark.parametrize(("backend", "model"), APIS)
def test_what_the_client_sends_the_replica_accepts_unchanged(backend, model):
    body = backend.build_request(CALL)
    received = validate_request_body(model, json.loads(json.dumps(body)))
    assert received.to_json() == body  # every field arrives, none is added or altered


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (VllmCompletionRequest, {"prompt": [1], "temprature": 0.5}, "temprature"),
        (
            VllmGenerateRequest,
            {"token_ids": [1], "sampling_params": {"do_sample": True}},
            "sampling_params.do_sample",
        ),
        (
            SglangGenerateRequest,
            {"input_ids": [1], "return_hidden_states": True},
            "return_hidden_states",
        ),
    ],
)
def test_the_replica_ignores_an_unknown_field_and_names_it(model, body, field, caplog):
    with caplog.at_level("WARNING", logger="rolloutbus.replica.server"):
        parsed = validate_request_body(model, body)
    assert field in caplog.text  # as vLLM does: ignored, with a warning that names it
    assert field.rsplit(".", 1)[-1] not in str(parsed.model_dump())


def test_the_replica_refuses_a_bad_value_of_a_known_field_by_name():
    with pytest.raises(HTTPProblem) as info:
        validate_request_body(VllmCompletionRequest, {"prompt": [1], "temperature": -1})
    assert info.value.status == 400 and info.value.param == "temperature"


def test_the_client_reads_a_response_with_fields_it_does_not_name():
    body = {
        "id": "c",
        "kv_transfer_params": None,
        "choices": [{"index": 0, "token_ids": [4], "finish_reason": "stop", "new_field": 1}],
    }
    with pytest.raises(ValidationError, match="kv_transfer_params"):
        VllmCompletionResponse.model_validate(body)  # strict: what the replica writes
    assert VllmCompletionsBackend().parse_response(body).token_ids == [4]


def test_a_prompt_of_token_ids_takes_integers_only():
    """Plain ints and int subclasses (an IntEnum) are token ids; a bool, a float or a string
    among them is refused, and the message shows the first of them."""

    class Token(enum.IntEnum):
        EOS = 2

    assert VllmCompletionRequest(prompt=[5, Token.EOS]).prompt == [5, 2]
    for bad in ([5, True], [5, 6.0, "7"]):
        with pytest.raises(ValidationError, match="token ids must be integers, got"):
            VllmCompletionRequest(prompt=bad)
