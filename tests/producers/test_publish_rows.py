"""Pure tests of how a dataset row becomes a prompt group (no broker)."""

from __future__ import annotations

import pytest

from rolloutbus.config import Config
from rolloutbus.producers.datasets import BadRow, RawRow, read_rows
from rolloutbus.producers.publish import build_group


def _row(**extra):
    return {"data_source": "d", "prompt": [{"role": "user", "content": "q"}], **extra}


def test_rollout_n_default_override_and_validation():
    cfg = Config.model_validate({"rollout": {"n": 4, "temperature": 0.7, "val_kwargs": {"n": 2}}})
    assert build_group(cfg, _row()).n == 4
    assert build_group(cfg, _row(__rollout_n__=8)).n == 8
    group = build_group(cfg, _row(__rollout_n__=8))
    assert "__rollout_n__" not in group.row
    val = build_group(cfg, _row(), validate=True)
    assert val.n == 2 and val.validate_ and val.sampling_params.temperature == 0.0  # greedy
    assert build_group(cfg, _row()).sampling_params.temperature == 0.7
    assert build_group(cfg, _row(__do_sample__=False)).sampling_params.temperature == 0.0


def test_uid_has_no_key_separator_and_agent_name_presence_is_kept():
    cfg = Config()
    g = build_group(cfg, _row())
    assert "_" not in g.uid and "agent_name" not in g.row  # absent stays absent (default applies)
    assert build_group(cfg, _row(agent_name=None)).row["agent_name"] is None  # null stays null


@pytest.mark.parametrize(
    "row, message",
    [
        ({"data_source": "d"}, "prompt"),
        (_row(prompt=[]), "prompt"),
        (_row(prompt=[{"role": "robot", "content": "x"}]), "robot"),
    ],
)
def test_invalid_rows_name_the_field(row, message):
    with pytest.raises(ValueError, match=message):
        build_group(Config(), row)


def test_jsonl_reader_reports_bad_lines_with_their_bytes(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "a"}]}\n\n[1, 2]\n{oops\n')
    items = list(read_rows(path))
    assert isinstance(items[0], RawRow) and items[0].source == "rows.jsonl:1"
    assert isinstance(items[1], BadRow) and "not an object" in items[1].reason
    assert (
        isinstance(items[2], BadRow)
        and items[2].original == b"{oops"
        and items[2].source == "rows.jsonl:4"  # the line number is the location's alone
        and "not valid JSON" in items[2].reason
    )


def test_parquet_rows_with_numpy_arrays_become_plain_values(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "data_source": ["d"],
            "prompt": [[{"role": "user", "content": "hi"}]],
            "reward_model": [{"ground_truth": "1", "style": "rule"}],
        }
    )
    pq.write_table(table, tmp_path / "rows.parquet")
    [item] = list(read_rows(tmp_path / "rows.parquet"))
    group = build_group(Config(), item.data)
    assert group.row["prompt"] == [{"role": "user", "content": "hi"}]


def test_data_prompt_key_names_the_messages_column():
    cfg = Config.model_validate({"data": {"prompt_key": "question"}})
    messages = [{"role": "user", "content": "q"}]
    group = build_group(cfg, {"data_source": "d", "question": messages})
    assert group.row["prompt"] == messages and "question" not in group.row
    with pytest.raises(ValueError, match="no 'question' column"):
        build_group(cfg, _row())
    with pytest.raises(ValueError, match="both 'question'"):
        build_group(cfg, _row(question=messages))


# -- idempotent uids, validation where rows enter, size limits ------------------------------


def test_derived_uids_are_stable_and_change_with_epoch_steps_validate_and_row():
    from rolloutbus.producers.publish import derive_uid

    uid = derive_uid("d" * 64, 3)
    assert uid == derive_uid("d" * 64, 3) and len(uid) == 32 and "_" not in uid
    others = {
        derive_uid("d" * 64, 3, epoch=1),
        derive_uid("d" * 64, 3, global_steps=7),
        derive_uid("d" * 64, 3, validate=True),
        derive_uid("d" * 64, 4),
        derive_uid("e" * 64, 3),
    }
    assert uid not in others and len(others) == 5


def test_dataset_identity_is_the_content_not_the_path(tmp_path):
    from rolloutbus.producers.publish import dataset_identity

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "rows.jsonl").write_text('{"prompt": []}\n')
    (tmp_path / "b" / "copy.jsonl").write_text('{"prompt": []}\n')
    (tmp_path / "b" / "edited.jsonl").write_text('{"prompt": [] }\n')
    ids = [
        dataset_identity(tmp_path / p) for p in ("a/rows.jsonl", "b/copy.jsonl", "b/edited.jsonl")
    ]
    assert ids[0] == ids[1] != ids[2]


def test_a_row_may_name_its_own_uid_which_is_checked():
    assert build_group(Config(), _row(uid="mine42"), uid="derived").uid == "mine42"
    assert build_group(Config(), _row(), uid="derived").uid == "derived"
    for bad in ("a_b", "", 5):
        with pytest.raises(ValueError, match="uid"):
            build_group(Config(), _row(uid=bad))


def test_a_string_prompt_is_refused_with_a_clear_reason_by_the_row_and_the_group_schema():
    from rolloutbus.schemas.prompts import GroupSamplingParams, PromptGroup

    with pytest.raises(ValueError, match="list of chat messages"):
        build_group(Config(), _row(prompt="What is 2 + 2?"))
    # a group written by another producer is refused where it is read (the session worker)
    with pytest.raises(ValueError, match="row.prompt"):
        PromptGroup(
            uid="u1", row=_row(prompt="What is 2 + 2?"), n=1, sampling_params=GroupSamplingParams()
        )
    with pytest.raises(ValueError, match="uid"):
        PromptGroup(uid="u_1", row=_row(), n=1, sampling_params=GroupSamplingParams())


def test_n_is_bounded_by_limits_max_n():
    cfg = Config.model_validate({"limits": {"max_n": 8}})
    assert Config().limits.max_n == 256
    assert build_group(cfg, _row(__rollout_n__=8)).n == 8
    for n in (9, 0):
        with pytest.raises(ValueError, match=r"limits.max_n"):
            build_group(cfg, _row(__rollout_n__=n))
    with pytest.raises(ValueError, match="limits.max_n"):
        build_group(Config.model_validate({"rollout": {"n": 300}}), _row())
    for bad in ("eight", True, 2.5):
        with pytest.raises(ValueError, match="__rollout_n__ must be an integer"):
            build_group(cfg, _row(__rollout_n__=bad))


def test_a_group_over_the_record_size_limit_is_refused_before_it_reaches_the_broker():
    from rolloutbus.producers.publish import encode_group

    cfg = Config.model_validate({"kafka": {"max_message_bytes": 2048}})
    assert len(encode_group(cfg, build_group(cfg, _row()))) < 2048
    big = build_group(cfg, _row(prompt=[{"role": "user", "content": "x" * 4096}]))
    with pytest.raises(ValueError, match="kafka.max_message_bytes"):
        encode_group(cfg, big)
