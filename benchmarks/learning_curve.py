"""Synchronous vs asynchronous GRPO through the bus, side by side in one invocation.

Starts an embedded broker, then runs the whole loop twice on the same task, seeds and wall
budget, one mode after the other: the replica (SmolLM2-135M-Instruct by default), a session
worker, the replay buffer, the weight sync, the dispatcher and ``rolloutbus train``:

* ``sync``: ``async_training.staleness_threshold: 0`` — rollouts of version v only start
  once the trainer published v, so the trainer waits for them (verl's synchronous PPO);
* ``async``: ``staleness_threshold: 1`` — rollouts of the next batch run while the trainer
  trains, at most one version stale, corrected by the truncated importance weights.

Task: short answers to open questions (benchmarks/short_answer_reward.py, a
``custom_reward_function``). Writes ``docs/learning_curve.png`` (reward against wall time
and against step) and ``docs/learning_curve.md`` (wall time, reward reached, tokens/s,
staleness, the machine). Run: ``python benchmarks/learning_curve.py [--minutes 12]``
(``--quick``: the smallest size, its docs written into the work folder);
matplotlib is needed for the picture only (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean
from typing import Any

import httpx
import yaml

from rolloutbus.broker.embedded import start_broker, stop_broker
from rolloutbus.config import BrokerConfig, Config, KafkaConfig
from rolloutbus.kafka.admin import ensure_topics

ROOT = Path(__file__).resolve().parents[1]
REWARD = ROOT / "benchmarks" / "short_answer_reward.py"
QUESTIONS = [
    "What is the capital of France?",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
    "What is the largest planet in our solar system?",
    "Which animal is known as the king of the jungle?",
    "What do bees make?",
    "What is frozen water called?",
    "Which ocean is the largest?",
    "What gas do plants take in?",
    "What is the opposite of hot?",
    "How many days are in a week?",
    "What is the main language spoken in Brazil?",
]
READY_S = 600.0  # seconds; the first SmolLM2 start dequantizes its GGUF (~15 s idle)
SMOOTH = 5  # steps in the moving average of the plotted reward
ENDS = 5  # steps averaged for "reward at start" and "reward reached"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(argv: list[str], config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "rolloutbus.cli", *argv, "--config", str(config)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def _stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"replica not ready in {READY_S} s")


def _mode_config(args: argparse.Namespace, bootstrap: str, work: Path, staleness: int) -> Config:
    port = _free_port()
    name = f"lc{staleness}x{int(time.time())}"
    return Config.model_validate(
        {
            "kafka": {"bootstrap_servers": bootstrap, "topic_prefix": name, "partitions": 2},
            "model": {"name": args.model},
            "replica_server": {"port": port, "max_batch_size": 32},
            "replicas": {"urls": [f"http://127.0.0.1:{port}"], "request_timeout_s": 600},
            "rollout": {
                "n": args.n,
                "prompt_length": 128,
                "response_length": args.response_length,
                "temperature": 1.0,
            },
            "sessions": {"app_id": f"{name}-sessions", "concurrency": 8},
            "replay_buffer": {"group_id": f"{name}-rb"},
            "custom_reward_function": {"path": str(REWARD), "name": "compute_score"},
            "async_training": {
                "staleness_threshold": staleness,
                "ppo_mini_batch_size": args.groups_per_step,
                "require_batches": 1,
                "trigger_parameter_sync_step": 1,
            },
            "actor": {"optim": {"lr": args.lr}},
            "trainer": {
                "group_id": f"{name}-trainer",
                "default_local_dir": str(work / "ckpt"),
                "metrics_log": str(work / "steps.jsonl"),
                "seed": 0,
            },
        }
    )


def _rows() -> list[dict[str, Any]]:
    suffix = " Answer as briefly as you can."
    return [
        {
            "data_source": "short_answers",
            "prompt": [{"role": "user", "content": q + suffix}],
            "reward_model": {"style": "rule", "ground_truth": ""},
            "extra_info": {"index": i},
        }
        for i, q in enumerate(QUESTIONS)
    ]


def run_mode(args: argparse.Namespace, bootstrap: str, work: Path, staleness: int) -> list[dict]:
    work.mkdir(parents=True, exist_ok=True)
    cfg = _mode_config(args, bootstrap, work, staleness)
    ensure_topics(cfg.kafka)
    data = cfg.model_dump(mode="json")
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    replica = _spawn(["replica", "serve"], config, work / "replica.log")
    procs = [replica]
    try:
        _wait_ready(cfg.replicas.urls[0], replica, work / "replica.log")
        for argv, log in (
            (["sessions", "run"], "sessions.log"),
            (["replay-buffer", "run"], "replay.log"),
            (["weight-sync"], "sync.log"),
            (["dispatch", str(dataset)], "dispatch.log"),
        ):
            procs.append(_spawn(argv, config, work / log))
        trainer = _spawn(["train"], config, work / "train.log")
        procs.append(trainer)
        print(f"[curve] staleness {staleness}: training for {args.minutes} min", file=sys.stderr)
        try:
            trainer.wait(args.minutes * 60)
        except subprocess.TimeoutExpired:
            _stop(trainer, timeout_s=300)  # finishes its step and saves
    finally:
        for proc in reversed(procs):
            _stop(proc)
    steps = [json.loads(line) for line in (work / "steps.jsonl").read_text().splitlines()]
    return steps


def summarize(mode: str, steps: list[dict]) -> dict[str, Any]:
    if not steps:
        return {"mode": mode, "steps": 0}
    wall = sum(s["timing/step_s"] + s["timing/wait_s"] for s in steps)
    rewards = [s["reward/mean"] for s in steps]
    stale = [s.get("staleness/mean", 0.0) for s in steps]
    return {
        "mode": mode,
        "steps": len(steps),
        "wall_s": wall,
        "reward_start": fmean(rewards[:ENDS]),
        "reward_reached": fmean(rewards[-ENDS:]),
        "tokens_per_s": sum(s["tokens"] for s in steps) / wall,
        "trainer_busy": sum(s["timing/step_s"] for s in steps) / wall,
        "staleness_mean": fmean(stale),
        "staleness_max": max(s.get("staleness/max", 0) for s in steps),
        "is_weight_mean": fmean(s.get("rollout_corr/rollout_is_mean", 1.0) for s in steps),
    }


def write_docs(runs: dict[str, list[dict]], out: Path, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = [summarize(mode, steps) for mode, steps in runs.items()]
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}"
    lines = [
        "# Learning curve: synchronous vs asynchronous GRPO through the bus",
        "",
        f"Model `{args.model}`, task: short answers (benchmarks/short_answer_reward.py), "
        f"{args.groups_per_step} prompt group(s) of n={args.n} per step, "
        f"response_length {args.response_length}, lr {args.lr}, {args.minutes} min per mode, "
        f"one mode after the other on {machine}, {time.strftime('%Y-%m-%d')}.",
        "Wall time is the trainer's (waiting for groups + train steps). "
        f"Reward at start/reached: mean of the first/last {ENDS} steps.",
        "",
        "| mode | steps | wall s | reward at start | reward reached | tokens/s trained | "
        "trainer busy | staleness mean | staleness max | IS weight mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["steps"]:
            lines.append(f"| {r['mode']} | 0 | | | | | | | | |")
            continue
        lines.append(
            f"| {r['mode']} | {r['steps']} | {r['wall_s']:.0f} | {r['reward_start']:.3f} | "
            f"{r['reward_reached']:.3f} | {r['tokens_per_s']:.1f} | {r['trainer_busy']:.0%} | "
            f"{r['staleness_mean']:.2f} | {r['staleness_max']} | {r['is_weight_mean']:.3f} |"
        )
    (out / "learning_curve.md").write_text("\n".join(lines) + "\n")
    figures = {
        m: [{k: v for k, v in s.items() if k != "uids"} for s in st] for m, st in runs.items()
    }
    (out / "learning_curve.json").write_text(json.dumps(figures, indent=0))
    print("\n".join(lines))
    _plot(runs, out / "learning_curve.png")


def _plot(runs: dict[str, list[dict]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[curve] matplotlib not installed: no picture", file=sys.stderr)
        return
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, steps in runs.items():
        if not steps:
            continue
        clock, t = [], 0.0
        for s in steps:
            t += s["timing/step_s"] + s["timing/wait_s"]
            clock.append(t / 60)
        rewards = [s["reward/mean"] for s in steps]
        smooth = [fmean(rewards[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(rewards))]
        by_time.plot(clock, smooth, label=mode)
        by_step.plot(range(1, len(steps) + 1), smooth, label=mode)
    by_time.set_xlabel("trainer wall time (min)")
    by_step.set_xlabel("train step")
    for ax in (by_time, by_step):
        ax.set_ylabel(f"reward (moving mean of {SMOOTH} steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GRPO through Rollout Bus: sync (staleness 0) vs async (staleness 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--minutes", type=float, default=12.0, help="trainer wall time per mode")
    parser.add_argument("--n", type=int, default=4, help="rollout.n")
    parser.add_argument("--groups-per-step", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--work", type=Path, default=None, help="logs and checkpoints")
    parser.add_argument("--bootstrap", default=None, help="a running broker (default: start one)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the smallest size (tiny-qwen3, async, 0.5 min, docs into --work): checks it runs",
    )
    args = parser.parse_args()
    if args.quick:
        args.model, args.minutes, args.modes = "tiny-qwen3", 0.5, "async"
        args.n, args.groups_per_step, args.response_length = 2, 1, 8
    # SIGTERM as Ctrl-C: the finally blocks stop the processes and the broker this started
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in background
    work = args.work or Path(tempfile.mkdtemp(prefix="rolloutbus-curve-"))
    if args.quick:
        args.out = work / "docs"  # never over the committed curve
    broker_port, controller_port = _free_port(), _free_port()
    cfg = Config(
        broker=BrokerConfig(
            data_dir=work / "kafka", port=broker_port, controller_port=controller_port
        ),
        kafka=KafkaConfig(bootstrap_servers=args.bootstrap or f"127.0.0.1:{broker_port}"),
    )
    if args.bootstrap is None:
        start_broker(cfg)
    runs: dict[str, list[dict]] = {}
    try:
        for mode in args.modes.split(","):
            staleness = 0 if mode == "sync" else 1
            runs[mode] = run_mode(args, cfg.kafka.bootstrap_servers, work / mode, staleness)
            print(f"[curve] {mode}: {summarize(mode, runs[mode])}", file=sys.stderr)
    finally:
        if args.bootstrap is None:
            stop_broker(cfg)
    write_docs(runs, args.out, args)
    if args.quick and args.work is None:
        shutil.rmtree(work, ignore_errors=True)  # a check's leftovers
    else:
        print(f"[curve] logs and checkpoints in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
