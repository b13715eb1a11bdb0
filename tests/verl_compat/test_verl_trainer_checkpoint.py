"""``BusCheckpointCallback``: verl's checkpoint callback writes ``rolloutbus.json`` beside
``global_step_N/`` and commits the bus position only for a synchronous save.

No broker: the position source is a recording double (in a run, the bus sampler's
``BusPosition`` over its ``TrainerClient``, tests/verl_compat/test_verl_trainer_tq.py). The
last test loads the callback through verl 0.9.1's own ``build_checkpoint_callback`` (verl
side environment) and calls it with the keywords verl's trainer uses.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rolloutbus.consumers.position import PartitionPosition, TrainerPosition
from rolloutbus.errors import RolloutBusError
from rolloutbus.verl import BusCheckpointCallback, read_bus_state
from rolloutbus.verl.checkpoint import STATE_FILE

POSITION = TrainerPosition(
    topic="rollout.trajectories",
    partitions={
        0: PartitionPosition(offset=12, yielded={"u1": 15}),
        3: PartitionPosition(offset=4),
    },
)


class RecordingSource:
    """A test double of the bus sampler's trainer client: a fixed position, commits recorded."""

    def __init__(self, run_id: str = "run-a"):
        self.run_id = run_id
        self.commits: list[TrainerPosition] = []

    def position(self) -> TrainerPosition:
        return POSITION

    def commit_position(self, position: TrainerPosition) -> None:
        self.commits.append(position)


def _trainer(source: RecordingSource | None) -> SimpleNamespace:
    return SimpleNamespace() if source is None else SimpleNamespace(rolloutbus_source=source)


def test_a_synchronous_save_writes_the_state_and_commits_its_position(tmp_path):
    source = RecordingSource()
    step_dir = tmp_path / "global_step_7"
    BusCheckpointCallback(config={}).on_save(
        trainer=_trainer(source), global_step=7, checkpoint_dir=str(step_dir), async_save=False
    )
    state = read_bus_state(step_dir)
    assert state is not None
    assert (state.run_id, state.global_step, state.committed) == ("run-a", 7, True)
    assert state.position == POSITION
    assert source.commits == [POSITION]
    assert sorted(p.name for p in step_dir.iterdir()) == [STATE_FILE]  # no partial file left
    raw = json.loads((step_dir / STATE_FILE).read_text())
    assert raw["position"]["partitions"]["0"] == {"offset": 12, "yielded": {"u1": 15}}


def test_an_async_save_writes_the_state_but_commits_nothing(tmp_path):
    source = RecordingSource()
    BusCheckpointCallback().on_save(
        trainer=_trainer(source), global_step=3, checkpoint_dir=str(tmp_path), async_save=True
    )
    state = read_bus_state(tmp_path)
    assert state is not None and state.committed is False and state.position == POSITION
    assert source.commits == []


def test_the_source_is_found_on_verls_replay_buffer(tmp_path):
    """verl's trainer holds the custom sampler as ``replay_buffer``; the bus sampler sets it."""
    source = RecordingSource("run-b")
    trainer = SimpleNamespace(replay_buffer=SimpleNamespace(rolloutbus_source=source))
    step_dir = tmp_path / "global_step_3"
    BusCheckpointCallback(config={}).on_save(
        trainer=trainer, global_step=3, checkpoint_dir=str(step_dir), async_save=False
    )
    state = read_bus_state(step_dir)
    assert state is not None and state.run_id == "run-b"
    assert source.commits == [POSITION]


def test_a_trainer_without_a_bus_source_fails_the_save_and_writes_nothing(tmp_path):
    with pytest.raises(RolloutBusError, match="rolloutbus_source"):
        BusCheckpointCallback().on_save(
            trainer=_trainer(None), global_step=1, checkpoint_dir=str(tmp_path)
        )
    assert read_bus_state(tmp_path) is None


def test_a_later_save_replaces_the_state_of_the_same_folder(tmp_path):
    BusCheckpointCallback().on_save(
        trainer=_trainer(RecordingSource("run-a")), global_step=2, checkpoint_dir=str(tmp_path)
    )
    BusCheckpointCallback().on_save(
        trainer=_trainer(RecordingSource("run-b")), global_step=2, checkpoint_dir=str(tmp_path)
    )
    state = read_bus_state(tmp_path)
    assert state is not None and state.run_id == "run-b"


# In the verl side env: verl's own builder on the config key, called as trainer_base.py does.
VERL_SIDE = """
import json, sys
from types import SimpleNamespace
from omegaconf import OmegaConf
from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback
from rolloutbus.consumers.position import TrainerPosition
from rolloutbus.verl import BusCheckpointCallback, read_bus_state

class Source:
    run_id = "run-v"
    def __init__(self): self.commits = 0
    def position(self): return TrainerPosition(topic="t", partitions={0: {"offset": 5}})
    def commit_position(self, position): self.commits += 1

config = OmegaConf.create(
    {"trainer": {"checkpoint_callback_class": "rolloutbus.verl.BusCheckpointCallback"}}
)
callback = build_checkpoint_callback(config)
source = Source()
callback.on_save(
    trainer=SimpleNamespace(rolloutbus_source=source),
    global_step=4,
    checkpoint_dir=sys.argv[1],
    async_save=False,
)
state = read_bus_state(sys.argv[1])
print(json.dumps({
    "is_ours": isinstance(callback, BusCheckpointCallback),
    "config_kept": callback.config is config,
    "state": state.model_dump(mode="json"),
    "commits": source.commits,
}))
"""


@pytest.mark.verl
def test_verls_builder_loads_the_callback_and_its_call_writes_the_state(run_in_verl, tmp_path):
    step_dir = tmp_path / "global_step_4"
    out = run_in_verl("-c", VERL_SIDE, str(step_dir))
    assert out["is_ours"] and out["config_kept"]
    assert out["commits"] == 1
    assert out["state"]["run_id"] == "run-v" and out["state"]["global_step"] == 4
    assert out["state"]["position"]["partitions"]["0"]["offset"] == 5
