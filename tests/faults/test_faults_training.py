"""Fault rows for the trainer, against the whole pipeline of real processes
(``tests/faults/``: replica, replay buffer, session worker) plus ``rolloutbus
train`` (and ``rolloutbus weight-sync``), all through the command line:

* **trainer SIGKILL before its first checkpoint**: killed during start-up (before its
  step-0 checkpoint) and again after its first step (before that step's checkpoint: a
  version every second step), then let finish;
* **a second run on the same topics**: run 1 trains half the groups and stops; run 2, a
  new run (its own checkpoint folder, the same consumer group), trains the rest while the
  running weight sync follows it from run 1's last version to run 2's version 0 and on.

Each row must lose nothing and duplicate nothing on rollout.trajectories, and every group
on the trajectory topic must be in the trainer's final weights exactly once: the groups of
each trainer incarnation's checkpointed steps (its step log, cut at the checkpoint it
left), put together, are the topic's groups, each once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

import tests.faults as faults
from rolloutbus.config import Config
from rolloutbus.consumers.training.checkpoint import latest_checkpoint, load_state
from rolloutbus.kafka.control import read_control_log
from rolloutbus.topics import uid_of_key
from tests.faults import (
    PLUGINS,
    FaultContext,
    FaultRun,
    ScenarioTimeout,
    Service,
    Workload,
    run_fault_scenario,
)

pytestmark = pytest.mark.slow  # and kafka, added by conftest


@dataclass(frozen=True)
class ScoredWorkload(Workload):
    """The harness's workload, with rows the session workers score (GRPO needs a reward):
    ``reward_model`` set, and the workers' ``custom_reward_function`` pointed at
    ``tests/plugins/text_digest_reward.py`` (``REWARD_ENV``)."""

    def rows(self) -> list[dict[str, Any]]:
        return [
            {**row, "reward_model": {"style": "rule", "ground_truth": ""}} for row in super().rows()
        ]


REWARD_ENV = {
    "ROLLOUTBUS__CUSTOM_REWARD_FUNCTION__PATH": str(PLUGINS / "text_digest_reward.py"),
    "ROLLOUTBUS__CUSTOM_REWARD_FUNCTION__NAME": "compute_score",
}
# 8 groups x 2 sessions, 2 groups per train step: 4 steps. The rows are about the trainer:
# the rollout side only has to keep producing while it is killed and restarted.
WORKLOAD = ScoredWorkload(groups=8, n=2, turns=2, tokens_per_turn=2, tool_delay_s=0.25)
PER_STEP = 2
STEPS = WORKLOAD.groups // PER_STEP
POLL_S = 0.1  # seconds between looks at the trainer's checkpoints and step log
TRAIN_TIMEOUT_S = 300.0  # seconds for one trainer incarnation to finish its steps


@dataclass
class Incarnation:
    log_line: int  # the first step-log line it wrote
    from_step: int  # the newest checkpoint's step when it started (-1: none)
    to_step: int = -1  # ... when it ended


@dataclass
class Trainer:
    """``rolloutbus train`` on a pipeline's topics: one checkpoint folder (a run), restarted
    by hand, with what each incarnation trained."""

    ctx: FaultContext
    name: str
    sync_every: int
    steps: int
    service: Service = field(init=False)
    incarnations: list[Incarnation] = field(default_factory=list)

    def __post_init__(self) -> None:
        workdir = self.ctx.pipeline.workdir
        raw = yaml.safe_load(self.ctx.pipeline.config_path.read_text())
        raw["trainer"] = {
            "group_id": f"{raw['sessions']['app_id']}-trainer",  # the same for every run
            "default_local_dir": str(workdir / self.name / "ckpt"),
            "metrics_log": str(workdir / self.name / "steps.jsonl"),
            "torch_threads": 1,
        }
        raw["async_training"] = {
            "ppo_mini_batch_size": PER_STEP,
            "trigger_parameter_sync_step": self.sync_every,
            # the rows are about the position, not the bound: no group is dropped as stale
            "staleness_threshold": 1000,
        }
        raw["actor"] = {"optim": {"lr": 1e-3}}
        path = workdir / f"{self.name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        self.cfg = Config.model_validate(raw)
        self.service = Service(self.name, ["train", "--steps", str(self.steps)], path, workdir)

    @property
    def steps_log(self) -> Path:
        return Path(str(self.cfg.trainer.metrics_log))

    def start(self) -> None:
        self.incarnations.append(Incarnation(len(self.step_records()), self.saved_step()))
        self.service.start()
        self.ctx.note(f"{self.name}: started at checkpoint step {self.saved_step()}")

    def kill(self) -> None:
        self.ctx.kill(self.service)
        self.incarnations[-1].to_step = self.saved_step()

    def wait(self, condition: Any, what: str) -> None:
        while not condition():
            if self.service.popen is not None and self.service.popen.poll() is not None:
                raise AssertionError(f"{self.name} exited early:\n{self.service.log_tail()}")
            if time.monotonic() > self.ctx.deadline:
                raise ScenarioTimeout(f"{self.name}: {what}")
            time.sleep(POLL_S)

    def finish(self) -> None:
        assert self.service.popen is not None
        code = self.service.popen.wait(TRAIN_TIMEOUT_S)
        assert code == 0, f"{self.name} exited {code}:\n{self.service.log_tail()}"
        self.incarnations[-1].to_step = self.saved_step()
        self.ctx.note(f"{self.name}: finished at step {self.saved_step()}")

    def saved_step(self) -> int:
        ckpt = latest_checkpoint(self.cfg.trainer.default_local_dir)
        return load_state(ckpt).global_step if ckpt is not None else -1

    def step_records(self) -> list[dict[str, Any]]:
        if not self.steps_log.exists():
            return []
        whole = self.steps_log.read_text().split("\n")[:-1]  # a kill may cut the last line
        return [json.loads(line) for line in whole if line.strip()]

    def trained(self) -> list[str]:
        """The groups in the final weights: each incarnation's steps up to the checkpoint
        it left (a step after it was lost with the process and trained again)."""
        records = self.step_records()
        return [
            uid
            for inc in self.incarnations
            for rec in records[inc.log_line :]
            if inc.from_step < rec["global_step"] <= inc.to_step
            for uid in rec["uids"]
        ]


def _assert_every_group_trained_once(run: FaultRun, trained: list[str]) -> None:
    row = run.row
    assert row.lost == 0, f"{row.lost} trajectories lost\n{run.explain()}"
    assert row.duplicated == 0, f"{row.duplicated} keys written twice\n{run.explain()}"
    on_topic = sorted({uid_of_key(key) for key in run.trajectories})
    assert len(on_topic) == WORKLOAD.groups, run.explain()
    twice = [uid for uid, n in Counter(trained).items() if n > 1]
    assert sorted(trained) == on_topic, (
        f"trained {len(trained)} groups for {len(on_topic)} on the topic (twice: {twice}, "
        f"never: {sorted(set(on_topic) - set(trained))})\n{run.explain()}"
    )


# -- trainer SIGKILL before its first checkpoint ---------------------------------------------


@pytest.fixture(autouse=True)
def scored_sessions(monkeypatch):
    """The session workers score every row with the digest reward."""
    for key, value in REWARD_ENV.items():
        monkeypatch.setitem(faults.WORKER_ENV, key, value)


def test_trainer_sigkill_before_its_first_checkpoint(kafka_bootstrap, tmp_path):
    trainers: list[Trainer] = []

    def scenario(ctx: FaultContext) -> None:
        trainer = Trainer(ctx, "trainer", sync_every=2, steps=STEPS)
        trainers.append(trainer)
        trainer.start()  # 1. killed during start-up: before its step-0 checkpoint
        time.sleep(ctx.rng.uniform(1.0, 4.0))
        assert trainer.saved_step() == -1, "the step-0 checkpoint came before the kill"
        trainer.kill()
        trainer.start()  # 2. killed after its first step, before that step's checkpoint
        first = trainer.incarnations[-1].log_line
        trainer.wait(lambda: len(trainer.step_records()) > first, "its first step")
        trainer.kill()
        assert trainer.saved_step() == 0, "only step 0 is saved: the version is every 2 steps"
        trainer.start()  # 3. let finish
        trainer.finish()
        ledger = read_control_log(trainer.cfg)
        assert ledger.current is not None and ledger.current.policy_version == STEPS // 2
        ctx.note(f"run epochs: {ledger.run_epoch} (one per start that reached the topic)")

    try:
        run = run_fault_scenario(
            "trainer SIGKILL before 1st checkpoint",
            bootstrap=kafka_bootstrap,
            workdir=tmp_path,
            workload=WORKLOAD,
            scenario=scenario,
        )
    finally:
        for trainer in trainers:
            trainer.service.stop()
    trained = trainers[0].trained()
    run.row.notes.append(f"trained {len(trained)} groups into the final weights, each once")
    _assert_every_group_trained_once(run, trained)


# -- a second run on the same topics -----------------------------------------------------------


def test_a_second_run_on_the_same_topics(kafka_bootstrap, tmp_path):
    trainers: list[Trainer] = []
    sync: list[Service] = []

    def scenario(ctx: FaultContext) -> None:
        weight_sync = Service(
            "weightsync", ["weight-sync"], ctx.pipeline.config_path, ctx.pipeline.workdir
        )
        sync.append(weight_sync)
        weight_sync.start()
        first = Trainer(ctx, "run1", sync_every=1, steps=STEPS // 2)
        trainers.append(first)
        first.start()
        first.finish()  # half the groups, versions 0..2 of run 1
        second = Trainer(ctx, "run2", sync_every=1, steps=STEPS // 2)
        trainers.append(second)
        second.start()  # a new run: the same group, its own checkpoints, version 0 again
        second.finish()
        ledger = read_control_log(second.cfg)
        state = load_state(latest_checkpoint(second.cfg.trainer.default_local_dir))
        assert ledger.run is not None and ledger.run.run_id == state.run_id
        assert ledger.current is not None and ledger.current.policy_version == STEPS // 2
        # the running weight sync followed run 2 (from run 1's version 2 down to run 2's
        # version 0, then on), so the replica serves run 2's last weights
        last = ledger.current.weights_path
        while _applied(weight_sync) != last:
            if time.monotonic() > ctx.deadline:
                raise ScenarioTimeout(f"the weight sync never applied {last}")
            time.sleep(POLL_S)
        ctx.note(f"weight sync applied {last}")

    try:
        run = run_fault_scenario(
            "a second run on the same topics",
            bootstrap=kafka_bootstrap,
            workdir=tmp_path,
            workload=WORKLOAD,
            scenario=scenario,
        )
    finally:
        for service in [*(t.service for t in trainers), *sync]:
            service.stop()
    applied = _applied_paths(sync[0])
    run_dirs = [str(t.cfg.trainer.default_local_dir) for t in trainers]
    assert any(p.startswith(run_dirs[1]) for p in applied), applied
    # run 2's version 0 was loaded after run 1's last version: a lower number, a newer run
    switch = next(i for i, p in enumerate(applied) if p.startswith(run_dirs[1]))
    assert switch > 0 and applied[switch - 1].startswith(run_dirs[0]), applied
    assert applied[switch].endswith("global_step_0/actor/huggingface"), applied
    trained = trainers[0].trained() + trainers[1].trained()
    run.row.notes.append(
        f"run 1 trained {len(trainers[0].trained())}, run 2 {len(trainers[1].trained())} "
        "groups; the weight sync followed run 2"
    )
    _assert_every_group_trained_once(run, trained)


def _applied_paths(weight_sync: Service) -> list[str]:
    """The folders the weight sync loaded, in order, from its log lines."""
    text = weight_sync.log_tail(chars=1_000_000)
    marker = ") after "
    paths = []
    for line in text.splitlines():
        if "serves policy version" in line and marker in line:
            paths.append(line.split(" (", 1)[1].split(marker, 1)[0])
    return [p for p in paths if p != "initial weights"]


def _applied(weight_sync: Service) -> str:
    paths = _applied_paths(weight_sync)
    return paths[-1] if paths else ""
