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


@pytest.mark.parametrize("row, message", [
    ({"data_source": "d"}, "prompt"),
    (_row(prompt=[]), "prompt"),
    (_row(prompt=[{"role": "robot", "content": "x"}]), "robot"),
])
def test_invalid_rows_name_the_field(row, message):
    with pytest.raises(ValueError, match=message):
        build_group(Config(), row)


def test_jsonl_reader_reports_bad_lines_with_their_bytes(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "a"}]}\n\n[1, 2]\n{oops\n')
    items = list(read_rows(path))
    assert isinstance(items[0], RawRow) and items[0].source == "rows.jsonl:1"
    assert isinstance(items[1], BadRow) and "not an object" in items[1].reason
    assert isinstance(items[2], BadRow) and items[2].original == b"{oops" and "line 4" in items[2].reason


def test_parquet_rows_with_numpy_arrays_become_plain_values(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"data_source": ["d"], "prompt": [[{"role": "user", "content": "hi"}]],
                      "reward_model": [{"ground_truth": "1", "style": "rule"}]})
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
