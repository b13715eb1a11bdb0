"""Idempotent publish on the real broker: the same file publishes the same uids (so a re-run
after a partial failure adds no second group downstream: the replay buffer folds one group
per uid, see test_replay_buffer_recovery), a new epoch or step publishes new ones, and rows
that break the rules are dead letters that name the row."""

from __future__ import annotations

import json

from rolloutbus.config import Config, with_overrides
from rolloutbus.producers.datasets import make_arithmetic_rows, write_jsonl
from rolloutbus.producers.publish import PromptPublisher
from rolloutbus.topics import Topics, partition_for
from tests.pipeline import dead_letters, read_topic


def test_the_same_file_publishes_the_same_uids_and_a_new_epoch_new_ones(kafka_config, tmp_path):
    cfg = Config(kafka=kafka_config)
    path = write_jsonl(make_arithmetic_rows(4, seed=11), tmp_path / "rows.jsonl")
    publisher = PromptPublisher(cfg)
    first = publisher.publish_file(path, progress=False).uids
    again = publisher.publish_file(
        write_jsonl(make_arithmetic_rows(4, seed=11), tmp_path / "copy.jsonl"), progress=False
    ).uids
    next_epoch = publisher.publish_file(path, epoch=1, progress=False).uids
    next_step = publisher.publish_file(path, global_steps=5, progress=False).uids
    assert first == again and len(set(first or [])) == 4
    assert not set(first or []) & set(next_epoch or []) and not set(first or []) & set(
        next_step or []
    )
    # keyed and partitioned by uid: a re-sent group lands next to its first copy
    records = read_topic(cfg, Topics.from_config(kafka_config).prompts)
    assert all(
        m.partition() == partition_for(m.key().decode(), kafka_config.partitions) for m in records
    )
    assert sorted(m.key().decode() for m in records) == sorted(2 * first + next_epoch + next_step)


def test_rows_breaking_the_rules_are_dead_letters_naming_the_row(kafka_config, tmp_path):
    cfg = with_overrides(Config(kafka=kafka_config), {"limits.max_n": 4})
    good = make_arithmetic_rows(1, seed=12)[0]
    rows = [
        dict(good, uid="named1"),
        dict(good, uid="bad_uid"),
        dict(good, uid="named1"),
        dict(good, prompt="a string"),
        dict(good, __rollout_n__=5),
        good,
    ]
    path = tmp_path / "rules.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = PromptPublisher(cfg).publish_file(path, progress=False)
    assert (report.published, report.dead_lettered) == (2, 4)
    assert report.uids is not None and report.uids[0] == "named1"
    reasons = {d["source"]: d["reason"] for d in dead_letters(cfg)}
    assert "'bad_uid' must be non-empty and contain no '_'" in reasons["rules.jsonl:2"]
    assert "already used by row rules.jsonl:1" in reasons["rules.jsonl:3"]
    assert "list of chat messages" in reasons["rules.jsonl:4"]
    assert "limits.max_n" in reasons["rules.jsonl:5"]
