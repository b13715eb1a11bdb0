"""Run in the verl 0.9.1 side environment: verl's own V0 agent-loop output against
``rolloutbus.verl``'s for the same agent-loop outputs (tests/verl_compat/test_verl_trainer_v0.py).

verl's side is its own code on a stand-in ``self`` (as verl's CPU tests bind trainer
methods): ``AgentLoopWorker._agent_loop_postprocess`` pads each output, ``_postprocess``
builds the batch, and ``AgentLoopManager.generate_sequences``'s last lines
(``DataProto.concat``, ``_performance_metrics``, ``meta_info``) finish it. The bus's side is
what the trainer would get from the topic: each output as the replay buffer writes its
trajectory record, encoded and decoded, grouped by uid, then ``rows_in_input_order``,
``v0_output`` and ``to_data_proto``. Prints one JSON line: per case, the keys compared and
every difference found (key, dtype, shape or value).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopManager,
    AgentLoopMetrics,
    AgentLoopOutput,
    AgentLoopWorker,
)
from verl.protocol import DataProto

from rolloutbus.config import ModelConfig
from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.models.tokenizers import load_tokenizer
from rolloutbus.schemas.agent_loop import AgentLoopMetrics as BusMetrics
from rolloutbus.schemas.trajectories import (
    Trajectory,
    TrajectoryStatus,
    decode_trajectory_batch,
    encode_trajectories,
)
from rolloutbus.topics import trajectory_key
from rolloutbus.verl.v0_batch import rows_in_input_order, v0_output
from rolloutbus.verl.v0_manager import to_data_proto

PROMPT_LENGTH, RESPONSE_LENGTH = 12, 10


def _messages(i: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"question {i}"}]


def _output(seed: int, scored: bool, logprobs: bool, response_len: int) -> dict[str, Any]:
    """One agent-loop output's fields (verl's names), varied by ``seed``."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(10, 5000, size=3 + seed % 6).tolist()
    response = rng.integers(10, 5000, size=response_len).tolist()
    mask = [1] * response_len
    if response_len > 4:  # a tool response in the middle: observation tokens
        mask[2:4] = [0, 0]
    extra: dict[str, Any] = {
        "turn_scores": [],
        "tool_rewards": [0.5] if seed % 2 else [],
        "min_global_steps": 3,
        "max_global_steps": 3 + seed % 2,
    }
    if scored:
        extra["reward_extra_info"] = {"acc": bool(seed % 2), "score": float(seed % 3)}
    return {
        "prompt_ids": prompt,
        "response_ids": response,
        "response_mask": mask,
        "response_logprobs": [float(-0.125 * (k + 1)) for k in range(response_len)]
        if logprobs
        else None,
        "reward_score": float(seed % 3) if scored else None,
        "num_turns": 2 + 2 * (response_len > 4),
        "metrics": {
            "generate_sequences": 0.25 * (seed + 1),
            "tool_calls": 0.125 * (seed % 3),
            "compute_score": 0.0625,
            "num_preempted": seed % 2,
        },
        "extra_fields": extra,
    }


def _inputs(uids: list[str], n: int) -> dict[str, np.ndarray]:
    """A V0 gen batch's non-tensor columns: each prompt repeated n times, interleaved."""
    rows = [(u, i) for i, u in enumerate(uids) for _ in range(n)]
    raw_prompt = np.empty(len(rows), dtype=object)
    raw_prompt[:] = [_messages(i) for _, i in rows]
    reward_model = np.empty(len(rows), dtype=object)
    reward_model[:] = [{"style": "rule", "ground_truth": str(i)} for _, i in rows]
    return {
        "uid": np.array([u for u, _ in rows], dtype=object),
        "raw_prompt": raw_prompt,
        "data_source": np.array(["openai/gsm8k"] * len(rows), dtype=object),
        "reward_model": reward_model,
        "index": np.array([i for _, i in rows], dtype=object),
        "agent_name": np.array(["single_turn_agent"] * len(rows), dtype=object),
    }


# ---- verl's side -------------------------------------------------------------------------


def _verl_worker(tokenizer: Any, reward_workers: Any) -> Any:
    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # verl's methods on a stand-in self
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.rollout_config = OmegaConf.create(
        {"prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH}
    )
    worker.reward_loop_worker_handles = reward_workers
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = None
    return worker


def verl_output(
    outputs: list[dict[str, Any]], inputs: dict[str, np.ndarray], worker: Any
) -> DataProto:
    async def padded() -> list[Any]:
        done = []
        for i, fields in enumerate(outputs):
            output = AgentLoopOutput(**{**fields, "metrics": AgentLoopMetrics(**fields["metrics"])})
            kwargs = {key: column[i] for key, column in inputs.items()}
            done.append(await worker._agent_loop_postprocess(output, False, **kwargs))
        return done

    chunk = worker._postprocess(
        asyncio.run(padded()), input_non_tensor_batch=inputs, validate=False
    )
    # AgentLoopManager.generate_sequences after its workers answer (one worker here)
    chunks = [chunk]
    output = DataProto.concat(chunks)
    metrics = [c.meta_info.pop("metrics") for c in chunks]
    timing = AgentLoopManager._performance_metrics(None, metrics, output)
    output.meta_info = {"timing": timing, **chunks[0].meta_info}
    return output


# ---- the bus's side ----------------------------------------------------------------------


def _trajectory(uid: str, session: int, n: int, fields: dict[str, Any], i: int) -> Trajectory:
    """What the replay buffer writes for one output (streams/assembly/trajectories.py)."""
    reward = fields["reward_score"]
    rm_scores = None
    if reward is not None:
        rm_scores = [0.0] * len(fields["response_ids"])
        if rm_scores:
            rm_scores[-1] = reward
    extra = fields["extra_fields"]
    return Trajectory(
        key=trajectory_key(uid, session, 0),
        uid=uid,
        session_id=session,
        output_index=0,
        num_outputs=1,
        group_size=n,
        status=TrajectoryStatus.COMPLETED,
        agent_name="single_turn_agent",
        prompts=fields["prompt_ids"],
        responses=fields["response_ids"],
        response_mask=fields["response_mask"],
        rollout_log_probs=fields["response_logprobs"],
        rm_scores=rm_scores,
        reward_score=reward,
        num_turns=fields["num_turns"],
        metrics=BusMetrics(**fields["metrics"]),
        extra_fields=extra,
        reward_extra_info=extra.get("reward_extra_info"),
        data_source="openai/gsm8k",
        raw_prompt=_messages(i),
        min_global_steps=extra["min_global_steps"],
        max_global_steps=extra["max_global_steps"],
    )


def bus_output(
    outputs: list[dict[str, Any]],
    inputs: dict[str, np.ndarray],
    uids: list[str],
    n: int,
    *,
    merge_inputs: bool,
    pad_token_id: int,
) -> DataProto:
    trajectories = [
        _trajectory(uid, session, n, outputs[i * n + session], i)
        for i, uid in enumerate(uids)
        for session in range(n)
    ]
    # sessions arrive in any order: the group's rows are reversed, as a partition may hold them
    groups = {}
    for uid in uids:
        mine = [t for t in trajectories if t.uid == uid][::-1]
        rows = [decode_trajectory_batch(v) for v in encode_trajectories(mine)]
        batch = pa.Table.from_batches(rows).combine_chunks().to_batches()[0]
        groups[uid] = TrajectoryGroup(uid=uid, batch=batch, partition=0, last_offset=0)
    out = v0_output(
        rows_in_input_order([str(u) for u in inputs["uid"]], groups),
        inputs=inputs,
        merge_inputs=merge_inputs,
        prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH,
        pad_token_id=pad_token_id,
    )
    return to_data_proto(out)


# ---- comparing ---------------------------------------------------------------------------


def _differences(path: str, ours: Any, theirs: Any) -> list[str]:
    if type(ours) is not type(theirs):
        return [f"{path}: type {type(ours).__name__} != verl's {type(theirs).__name__}"]
    if isinstance(ours, torch.Tensor):
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return [f"{path}: {ours.dtype}{list(ours.shape)} != {theirs.dtype}{list(theirs.shape)}"]
        return [] if torch.equal(ours, theirs) else [f"{path}: values {ours} != {theirs}"]
    if isinstance(ours, np.ndarray):
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            return [f"{path}: {ours.dtype}{ours.shape} != {theirs.dtype}{theirs.shape}"]
        return [
            d for i in range(len(ours)) for d in _differences(f"{path}[{i}]", ours[i], theirs[i])
        ]
    if isinstance(ours, dict):
        if set(ours) != set(theirs):
            return [f"{path}: keys {sorted(ours)} != {sorted(theirs)}"]
        return [d for k in ours for d in _differences(f"{path}.{k}", ours[k], theirs[k])]
    if isinstance(ours, list | tuple):
        if len(ours) != len(theirs):
            return [f"{path}: length {len(ours)} != {len(theirs)}"]
        return [
            d
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
            for d in _differences(f"{path}[{i}]", a, b)
        ]
    if isinstance(ours, float | np.floating) and math.isnan(ours) and math.isnan(theirs):
        return []
    return [] if ours == theirs else [f"{path}: {ours!r} != {theirs!r}"]


def compare(ours: DataProto, theirs: DataProto) -> dict[str, Any]:
    found = _differences("batch", dict(ours.batch.items()), dict(theirs.batch.items()))
    found += _differences("non_tensor_batch", ours.non_tensor_batch, theirs.non_tensor_batch)
    found += _differences("meta_info", ours.meta_info, theirs.meta_info)
    if ours.batch.batch_size != theirs.batch.batch_size:
        found.append(f"batch_size {ours.batch.batch_size} != {theirs.batch.batch_size}")
    return {
        "batch": sorted(theirs.batch.keys()),
        "non_tensor_batch": sorted(theirs.non_tensor_batch),
        "meta_info": sorted(theirs.meta_info),
        "timing": len(theirs.meta_info["timing"]),
        "differences": found,
    }


CASES = {
    # the bus scores every session, as verl's streaming reward loop does
    "scored_with_reward_workers": {"scored": True, "logprobs": True, "workers": ["reward"]},
    # no reward-loop workers: verl merges the input's columns; nothing scored, no logprobs
    "unscored_without_reward_workers": {"scored": False, "logprobs": False, "workers": None},
    # a response that fills response_length exactly, and an empty one
    "edge_lengths": {"scored": True, "logprobs": True, "workers": ["reward"], "edges": True},
}


def run_case(spec: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    uids, n = ["3f2a9c1e-uid-a", "7b4d0e55-uid-b", "c0ffee00-uid-c"], 2
    lengths = [1 + (3 * k) % RESPONSE_LENGTH for k in range(len(uids) * n)]
    if spec.get("edges"):
        lengths[1], lengths[4] = RESPONSE_LENGTH, 0
    outputs = [
        _output(k, spec["scored"], spec["logprobs"], lengths[k]) for k in range(len(uids) * n)
    ]
    inputs = _inputs(uids, n)
    worker = _verl_worker(tokenizer, spec["workers"])
    theirs = verl_output(outputs, {k: v.copy() for k, v in inputs.items()}, worker)
    ours = bus_output(
        outputs,
        inputs,
        uids,
        n,
        merge_inputs=spec["workers"] is None,
        pad_token_id=tokenizer.pad_token_id,
    )
    return compare(ours, theirs)


def main() -> None:
    tokenizer = load_tokenizer(ModelConfig(name="tiny-qwen3"))
    print(json.dumps({name: run_case(spec, tokenizer) for name, spec in CASES.items()}))


if __name__ == "__main__":
    main()
