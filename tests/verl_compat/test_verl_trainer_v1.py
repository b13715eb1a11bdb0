"""verl's V1 trainer's agent-loop slot: ``BusAgentLoopManager.generate_sequences`` publishes
verl's own batches (built as ``PPOTrainer`` builds them, in the verl side environment:
tests/programs/verl_v1_publish.py) as prompt groups on the real broker, with verl's uid, n
from ``__rollout_n__`` / ``rollout.n`` / ``val_kwargs.n``, the greedy override,
``global_steps`` and ``validate``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rolloutbus.config import Config, KafkaConfig
from rolloutbus.schemas.prompts import PromptGroup
from rolloutbus.topics import Topics, partition_for
from tests.pipeline import read_topic
from tests.source_tree import ROOT

PROGRAM = ROOT / "tests" / "programs" / "verl_v1_publish.py"

pytestmark = pytest.mark.verl


@pytest.fixture
def published(run_in_verl, kafka_config: KafkaConfig, tmp_path: Path):
    bus = tmp_path / "bus.yaml"
    bus.write_text(yaml.safe_dump({"kafka": kafka_config.model_dump(mode="json")}))
    uids = run_in_verl(str(PROGRAM), str(bus))
    cfg = Config(kafka=kafka_config)
    records = read_topic(cfg, Topics.from_config(kafka_config).prompts)
    groups = {}
    for msg in records:
        group = PromptGroup.model_validate_json(msg.value())
        assert msg.key().decode() == group.uid
        assert msg.partition() == partition_for(group.uid, kafka_config.partitions)
        groups[group.uid] = group
    return uids, groups


def test_every_row_is_one_group_with_verls_uid(published):
    uids, groups = published
    assert sorted(groups) == sorted(uid for batch in uids.values() for uid in batch)


def test_a_training_batch_takes_rollout_n_and_verls_sampling(published):
    uids, groups = published
    for i, uid in enumerate(uids["train"]):
        group = groups[uid]
        assert (group.n, group.validate_, group.global_steps) == (3, False, 7)
        assert group.sampling_params.temperature == 0.9  # verl's rollout.temperature
        assert group.row["prompt"] == [{"role": "user", "content": f"What is {i} + {i}?"}]
        assert group.row["uid"] == uid and group.row["index"] == i
        assert group.row["reward_model"] == {"style": "rule", "ground_truth": str(2 * i)}
        assert not {"dummy_tensor", "raw_prompt", "global_steps", "validate"} & set(group.row)


def test_a_rows_rollout_n_and_do_sample_win(published):
    uids, groups = published
    sampled, greedy = (groups[uid] for uid in uids["per_row"])
    assert (sampled.n, greedy.n) == (4, 1)
    assert sampled.sampling_params.temperature == 0.9
    params = greedy.sampling_params
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, -1)
    assert sampled.global_steps == greedy.global_steps == 8


def test_a_validation_batch_takes_val_kwargs(published):
    uids, groups = published
    [group] = (groups[uid] for uid in uids["val"])
    assert (group.n, group.validate_, group.global_steps) == (2, True, 8)
    assert group.sampling_params.temperature == 0.0
