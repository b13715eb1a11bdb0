"""The embedded replica over real HTTP, with the tiny random-weight Qwen3 (fast)."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from rolloutbus.config import Config, ModelConfig, ReplicaServerConfig
from rolloutbus.models.causal_lm import load_causal_lm
from rolloutbus.replica.server import replica_in_thread

MAX_MODEL_LEN = 256
EOS = 151645  # <|im_end|>


def _config(**replica: object) -> Config:
    settings = {"port": 0, "max_batch_size": 16, "max_model_len": MAX_MODEL_LEN, "torch_threads": 1}
    settings.update(replica)
    return Config(
        model=ModelConfig(name="tiny-qwen3", seed=0), replica_server=ReplicaServerConfig(**settings)
    )


@pytest.fixture(scope="module")
def replica():
    with replica_in_thread(_config()) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(replica):
    with httpx.Client(base_url=replica.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference_model():
    """The same weights, loaded again: seeded weights must not depend on the process."""
    model, _ = load_causal_lm(ModelConfig(name="tiny-qwen3", seed=0))
    return model


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(150_000) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


PROMPT = _prompts(1, seed=42)[0]


def _complete(client: httpx.Client, **fields: object) -> dict:
    body = {
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    body.update(fields)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


# -- shapes -------------------------------------------------------------------------------


def test_completions_shape(client):
    out = _complete(client, model="tiny-qwen3", request_id="r1", priority=3)
    assert out["object"] == "text_completion" and out["model"] == "tiny-qwen3"
    assert out["id"].startswith("cmpl") and isinstance(out["created"], int)
    (choice,) = out["choices"]
    assert choice["index"] == 0 and isinstance(choice["text"], str)
    assert choice["prompt_token_ids"] == PROMPT
    ids, lp = choice["token_ids"], choice["logprobs"]
    assert (
        len(ids)
        == len(lp["token_logprobs"])
        == len(lp["tokens"])
        == len(lp["top_logprobs"])
        == len(lp["text_offset"])
    )
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(
        top == {f"token_id:{t}": x}
        for t, x, top in zip(ids, lp["token_logprobs"], lp["top_logprobs"], strict=True)
    )
    assert choice["finish_reason"] in {"stop", "length"}
    assert out["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(ids),
        "total_tokens": len(PROMPT) + len(ids),
    }


def test_completions_top_logprobs_and_text_tokens(client):
    out = _complete(client, logprobs=3, return_tokens_as_token_ids=False)
    lp = out["choices"][0]["logprobs"]
    assert all(3 <= len(top) <= 4 for top in lp["top_logprobs"])  # top 3 + the sampled token
    for token, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))


def test_completions_without_logprobs(client):
    out = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert out["choices"][0]["logprobs"] is None and out["choices"][0]["token_ids"] is None


def test_vllm_generate_shape(client):
    body = {
        "token_ids": PROMPT,
        "request_id": "g1",
        "model": "tiny-qwen3",
        "sampling_params": {"max_tokens": 6, "temperature": 0.0, "logprobs": 0},
    }
    out = client.post("/inference/v1/generate", json=body).json()
    assert (
        out["request_id"] == "g1"
        and out["model"] == "tiny-qwen3"
        and isinstance(out["created"], int)
    )
    (choice,) = out["choices"]
    content = choice["logprobs"]["content"]
    assert len(choice["token_ids"]) == len(content) == 6 and choice["finish_reason"] == "length"
    assert [c["token_id"] for c in content] == choice["token_ids"]
    assert all(c["logprob"] <= 0 for c in content)
    assert out["usage"]["completion_tokens"] == 6
    same = _complete(client, max_tokens=6)["choices"][0]
    assert choice["token_ids"] == same["token_ids"]


def test_sglang_generate_shape(client):
    body = {
        "input_ids": PROMPT,
        "rid": "s1",
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
    }
    out = client.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert (
        meta["id"] == "s1"
        and meta["prompt_tokens"] == len(PROMPT)
        and meta["completion_tokens"] == 5
    )
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert [row[1] for row in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(row[0] <= 0 and row[2] is None for row in meta["output_token_logprobs"])
    assert isinstance(out["text"], str)


def test_health_and_models(client):
    assert client.get("/health").status_code == 200
    (entry,) = client.get("/v1/models").json()["data"]
    assert entry["id"] == "tiny-qwen3" and entry["owned_by"] == "rolloutbus"
    assert entry["max_model_len"] == MAX_MODEL_LEN


# -- sampling semantics -----------------------------------------------------------------------


def test_greedy_logprobs_equal_a_plain_forward_pass(client, reference_model):
    choice = _complete(client, max_tokens=6)["choices"][0]
    ids = choice["token_ids"]
    with torch.no_grad():
        logits = reference_model(torch.tensor([PROMPT + ids])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    assert ids == logprobs.argmax(-1).tolist()
    expected = logprobs.gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_same_seed_same_tokens_different_seed_different_tokens(client):
    def sample(seed: int) -> list[int]:
        return _complete(client, temperature=1.0, seed=seed, max_tokens=8)["choices"][0][
            "token_ids"
        ]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)  # 8 draws from a ~uniform 152k vocabulary


def test_top_k_1_is_greedy_with_processed_logprob_zero(client):
    greedy = _complete(client)["choices"][0]["token_ids"]
    choice = _complete(client, temperature=1.0, top_k=1, seed=1)["choices"][0]
    assert choice["token_ids"] == greedy
    assert choice["logprobs"]["token_logprobs"] == pytest.approx([0.0] * len(greedy))


def test_temperature_changes_processed_logprobs(client):
    hot = _complete(client, temperature=2.0, top_p=0.5, seed=3)["choices"][0]["logprobs"][
        "token_logprobs"
    ]
    assert all(x <= 0 for x in hot) and len(hot) == 8


def test_stop_token_ids_end_the_sequence_and_are_included(client):
    free = _complete(client, temperature=1.0, seed=11, max_tokens=12)["choices"][0]["token_ids"]
    cut = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)
    out = _complete(client, temperature=1.0, seed=11, max_tokens=12, stop_token_ids=[free[cut]])
    choice = out["choices"][0]
    assert choice["token_ids"] == free[: cut + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == free[cut]


def test_max_tokens_is_honoured_with_finish_reason_length(client):
    choice = _complete(client, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True)["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"


async def test_concurrent_requests_are_batched_and_match_solo_runs(replica, client):
    prompts = _prompts(16, seed=1)

    def body(prompt: list[int]) -> dict:
        return {
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": 0,
            "return_token_ids": True,
        }

    solo = [client.post("/v1/completions", json=body(p)).json()["choices"][0] for p in prompts]
    steps_before = dict(replica.engine.stats.batch_sizes)
    async with httpx.AsyncClient(base_url=replica.url, timeout=60) as aclient:
        responses = await asyncio.gather(
            *[aclient.post("/v1/completions", json=body(p)) for p in prompts]
        )
    together = [r.json()["choices"][0] for r in responses]
    steps_after = dict(replica.engine.stats.batch_sizes)
    new_steps = {size: n - steps_before.get(size, 0) for size, n in steps_after.items()}
    assert max(size for size, n in new_steps.items() if n > 0) > 1
    for alone, batched in zip(solo, together, strict=True):
        assert batched["token_ids"] == alone["token_ids"]
        assert batched["logprobs"]["token_logprobs"] == pytest.approx(
            alone["logprobs"]["token_logprobs"], abs=1e-4
        )
    histogram = _metric_samples(client, "rolloutbus_replica_batch_size")
    assert (
        histogram["rolloutbus_replica_batch_size_count"]
        > histogram['rolloutbus_replica_batch_size_bucket{le="1.0"}']
    )


# -- client mistakes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": [1, 2], "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": [1, 2], "n": 2}, "n="),
        ("/inference/v1/generate", {"token_ids": [1], "stream": True}, "stream"),
        ("/v1/completions", {"prompt": [1, 2], "stop": ["\n"]}, "stop"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": [1, "x"]}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": [[1], [2]]}, "prompt"),
        ("/v1/completions", {"prompt": [1, 2], "seed": "abc"}, "seed"),
        ("/v1/completions", {"prompt": [10**9]}, "token ids"),
        ("/v1/completions", {"prompt": [-1]}, "token ids"),
        ("/v1/completions", {"prompt": [1] * 250, "max_tokens": 10}, "maximum context length"),
        ("/inference/v1/generate", {"token_ids": []}, "token_ids"),
        (
            "/inference/v1/generate",
            {"token_ids": [1], "sampling_params": {"top_k": -5}},
            "sampling_params.top_k",
        ),
        (
            "/generate",
            {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        ("/generate", {"sampling_params": {}}, "input_ids"),
    ],
)
def test_bad_fields_are_400_naming_the_field(client, path, body, field):
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]


def test_body_that_is_not_json_is_400(client):
    response = client.post(
        "/v1/completions", content=b"{nope", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    assert client.post("/generate", json=[1, 2]).status_code == 400


def test_unknown_model_is_404(client):
    response = client.post("/v1/completions", json={"prompt": [1], "model": "gpt-9"})
    assert response.status_code == 404 and "gpt-9" in response.json()["error"]["message"]


# -- metrics ------------------------------------------------------------------------------------


def _metric_samples(client: httpx.Client, family: str) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == family:
            for s in fam.samples:
                le = s.labels.get("le")
                out[s.name + (f'{{le="{le}"}}' if le else "")] = s.value
    return out


def test_metrics_are_valid_prometheus_text(client):
    _complete(client, max_tokens=2)
    response = client.get("/metrics")
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert all(name.startswith("rolloutbus_replica_") for name in families)
    expected = {
        "requests_running": "gauge",
        "requests_waiting": "gauge",
        "generation_tokens": "counter",
        "prompt_tokens": "counter",
        "request_success": "counter",
        "num_preemptions": "counter",
        "e2e_request_latency_seconds": "histogram",
        "time_to_first_token_seconds": "histogram",
        "batch_size": "histogram",
    }
    for name, kind in expected.items():
        assert families[f"rolloutbus_replica_{name}"].type == kind, name
    success = families["rolloutbus_replica_request_success"].samples
    assert any(s.labels["finished_reason"] == "length" and s.value >= 1 for s in success)
    promtool = shutil.which("promtool")
    if promtool:  # the real linter where Debian's prometheus package is installed
        lint = subprocess.run(
            [promtool, "check", "metrics"], input=response.text, text=True, capture_output=True
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr


def test_two_replicas_in_one_process_have_separate_metrics(replica, client):
    with (
        replica_in_thread(_config(max_batch_size=2)) as other,
        httpx.Client(base_url=other.url) as c2,
    ):
        assert c2.get("/health").status_code == 200
        before = _metric_samples(client, "rolloutbus_replica_prompt_tokens")
        c2.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
        assert _metric_samples(client, "rolloutbus_replica_prompt_tokens") == before
        assert (
            _metric_samples(c2, "rolloutbus_replica_prompt_tokens")[
                "rolloutbus_replica_prompt_tokens_total"
            ]
            == 3
        )


# -- slow: the real small model and the blocking server command ------------------------------


@pytest.mark.slow
def test_smollm2_answers_a_chat_prompt_sensibly():
    from rolloutbus.models.tokenizers import load_tokenizer

    cfg = Config(
        model=ModelConfig(name="smollm2-135m"),
        replica_server=ReplicaServerConfig(port=0, max_model_len=512, torch_threads=2),
    )
    tokenizer = load_tokenizer(cfg.model)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    with replica_in_thread(cfg) as handle, httpx.Client(base_url=handle.url, timeout=120) as client:
        body = {
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "logprobs": 0,
            "return_token_ids": True,
        }
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert "Paris" in choice["text"], choice["text"]
    assert (
        choice["finish_reason"] == "stop" and choice["token_ids"][-1] == tokenizer.eos_token_id
    )  # <|im_end|>
    assert all(x <= 0 for x in choice["logprobs"]["token_logprobs"])


@pytest.mark.slow
def test_serve_replica_logs_ready_and_stops_on_sigterm(tmp_path):
    import os
    import re
    import signal
    import sys

    script = (
        "from rolloutbus.config import Config, ModelConfig, ReplicaServerConfig\n"
        "from rolloutbus.replica.server import serve_replica\n"
        "serve_replica(Config(model=ModelConfig(name='tiny-qwen3'), "
        "replica_server=ReplicaServerConfig(port=0, torch_threads=1)))\n"
    )
    with subprocess.Popen(  # on leaving: its stderr pipe closed, the process waited for
        [sys.executable, "-c", script],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    ) as proc:
        try:
            url = None
            assert proc.stderr is not None
            for line in proc.stderr:
                match = re.search(r"replica ready on (http://\S+)", line)
                if match:
                    url = match.group(1)
                    break
            assert url, "no ready line"
            assert httpx.get(f"{url}/health").status_code == 200
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
