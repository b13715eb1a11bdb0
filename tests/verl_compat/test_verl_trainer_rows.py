"""``rolloutbus.verl`` without verl: the package imports, its plug-ins say what to install,
and the pure halves of the V0 adapter (verl's input rows → prompt requests; groups → one row
per input row) and the bus config a plug-in reads."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from rolloutbus.consumers.groups import TrajectoryGroup
from rolloutbus.errors import RolloutBusError
from rolloutbus.schemas.trajectories import TrajectoryStatus, trajectories_to_batch
from rolloutbus.verl import INSTALL_HINT, VerlNotInstalledError, require_verl, rows_in_input_order
from rolloutbus.verl.rows import dataset_row, v0_requests
from rolloutbus.verl.settings import bus_config, config_paths, verl_rollout_overrides
from tests.builders import make_trajectory


def test_the_package_imports_without_verl_and_loads_none_of_it():
    code = (
        "import sys, rolloutbus.verl as v\n"
        "v.BusAgentLoopManager, v.BusAgentLoopManagerV0, v.v0_output\n"
        "heavy = ('verl', 'tensordict', 'ray', 'transfer_queue')\n"
        "print(','.join(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == ""


def test_a_missing_verl_names_the_extra():
    with pytest.raises(VerlNotInstalledError, match=r"pip install rolloutbus\[verl\]") as caught:
        require_verl("verl_that_is_not_installed", what="BusAgentLoopManagerV0.generate_sequences")
    assert isinstance(caught.value, ImportError | RolloutBusError)
    assert INSTALL_HINT == "pip install rolloutbus[verl]"


def _objects(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def test_v0_rows_become_one_request_per_uid_with_n_from_the_repeats():
    messages = [{"role": "user", "content": "2+2?"}]
    batch = {
        "uid": _objects(["a", "a", "b", "b", "a"]),  # a validation batch padded with a's row
        "raw_prompt": _objects([messages, messages, messages, messages, messages]),
        "index": np.array([0, 0, 1, 1, 0]),
        "reward_model": _objects([{"ground_truth": np.int64(4)}] * 5),
    }
    uids, requests = v0_requests(batch)
    assert uids == ["a", "a", "b", "b", "a"]
    assert [(r.uid, r.n) for r in requests] == [("a", 3), ("b", 2)]
    row = requests[0].row
    assert row["prompt"] == messages and "raw_prompt" not in row
    assert row["index"] == 0 and type(row["index"]) is int
    assert row["reward_model"] == {"ground_truth": 4} and row["__rollout_n__"] == 3


def test_rows_of_one_uid_must_agree_on_do_sample():
    batch = {
        "uid": _objects(["a", "a"]),
        "raw_prompt": _objects([[{"role": "user", "content": "q"}]] * 2),
        "__do_sample__": np.array([True, False]),
    }
    with pytest.raises(RolloutBusError, match="__do_sample__"):
        v0_requests(batch)


def test_dataset_row_drops_verls_padding_column_and_keeps_a_prompt_column():
    row = dataset_row({"prompt": [{"role": "user", "content": "q"}], "dummy_tensor": np.zeros(1)})
    assert row == {"prompt": [{"role": "user", "content": "q"}]}


def _group(uid: str, trajectories: list) -> TrajectoryGroup:
    return TrajectoryGroup(
        uid=uid, batch=trajectories_to_batch(trajectories), partition=0, last_offset=0
    )


def test_rows_come_back_in_input_order_whatever_order_sessions_arrived_in():
    a = [make_trajectory("a", s, group_size=2, responses=[10 + s]) for s in (1, 0)]
    b = [make_trajectory("b", s, group_size=2, responses=[20 + s]) for s in (0, 1)]
    rows = rows_in_input_order(["b", "a", "b", "a"], {"a": _group("a", a), "b": _group("b", b)})
    assert isinstance(rows, pa.RecordBatch)
    assert rows.column("key").to_pylist() == ["b_0_0", "a_0_0", "b_1_0", "a_1_0"]
    assert rows.column("responses").to_pylist() == [[20], [10], [21], [11]]


def test_a_failed_session_or_several_outputs_are_refused_for_v0():
    failed = [
        make_trajectory("a", 0, group_size=2),
        make_trajectory("a", 1, group_size=2, status=TrajectoryStatus.FAILED, error="boom"),
    ]
    with pytest.raises(RolloutBusError, match="session 1 failed"):
        rows_in_input_order(["a", "a"], {"a": _group("a", failed)})
    multi = [make_trajectory("a", 0, output_index=i, num_outputs=2, group_size=2) for i in (0, 1)]
    with pytest.raises(RolloutBusError, match="2 outputs"):
        rows_in_input_order(["a"], {"a": _group("a", multi)})
    with pytest.raises(RolloutBusError, match="has 1 sessions"):
        rows_in_input_order(["a", "a"], {"a": _group("a", [make_trajectory("a", 0)])})


def test_the_bus_config_takes_verls_rollout_settings(tmp_path):
    bus_file = tmp_path / "bus.yaml"
    bus_file.write_text("kafka:\n  topic_prefix: fromfile\nrollout:\n  n: 2\n  temperature: 0.7\n")
    verl = {
        "rolloutbus": {"config": str(bus_file)},
        "actor_rollout_ref": {
            "rollout": {"n": 5, "response_length": 64, "val_kwargs": {"n": 3, "temperature": 0.0}}
        },
    }
    assert config_paths(verl, env={}) == [str(bus_file)]
    assert config_paths({}, env={"ROLLOUTBUS_CONFIG": f"x.yaml:{bus_file}"}) == [
        "x.yaml",
        str(bus_file),
    ]
    assert verl_rollout_overrides(verl)["rollout.n"] == 5
    cfg = bus_config(verl, env={})
    assert cfg.kafka.topic_prefix == "fromfile"  # the bus's own file
    assert (cfg.rollout.n, cfg.rollout.response_length, cfg.rollout.temperature) == (5, 64, 0.7)
    assert (cfg.rollout.val_kwargs.n, cfg.rollout.val_kwargs.temperature) == (3, 0.0)
