"""verl's input rows → dataset rows for prompt groups (pure: no Kafka, no verl import).

verl hands the manager one row per prompt (V1, a TensorDict) or each prompt repeated n
times, interleaved (V0, a DataProto's ``non_tensor_batch``). A prompt group is built from a
plain dataset row, as ``rolloutbus publish`` builds it from a file row: numpy and torch
values become Python values, verl's ``raw_prompt`` (RLHFDataset's chat messages) is the
row's ``prompt``, and the columns that only steer verl's own dispatch are left out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rolloutbus.errors import RolloutBusError

__all__ = ["PromptRequest", "dataset_row", "plain", "v0_requests"]

# columns verl's dataset adds for its own padding, never read by an agent loop
_DROPPED = ("dummy_tensor",)


@dataclass(frozen=True)
class PromptRequest:
    """One prompt group to publish: its uid, its dataset row, its group size."""

    uid: str
    row: dict[str, Any]
    n: int


def plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars and torch tensors as Python lists and
    numbers, inside dicts and lists too (a prompt group is JSON)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "tolist") and hasattr(value, "dim"):  # a torch tensor, duck-typed
        return value.tolist()
    return value


def dataset_row(columns: Mapping[str, Any]) -> dict[str, Any]:
    """One input row (column → value) as a dataset row: plain values, ``raw_prompt`` as
    ``prompt`` when the row has no ``prompt``, verl's padding column dropped."""
    row = {key: plain(value) for key, value in columns.items() if key not in _DROPPED}
    if "prompt" not in row and "raw_prompt" in row:
        row["prompt"] = row.pop("raw_prompt")
    return row


def v0_requests(
    non_tensor_batch: Mapping[str, np.ndarray],
) -> tuple[list[str], list[PromptRequest]]:
    """The uid of every V0 input row, and one request per distinct uid in first-seen order,
    its ``n`` the number of rows that carry it (verl repeats a prompt n times; a validation
    batch padded to the worker count repeats a few more). Rows of one uid must agree on
    ``__do_sample__``: a group samples with one set of parameters."""
    if "uid" not in non_tensor_batch:
        raise RolloutBusError("verl's V0 input has no 'uid' column; RayPPOTrainer adds one")
    uids = [str(u) for u in non_tensor_batch["uid"].tolist()]
    first: dict[str, int] = {}
    counts: dict[str, int] = {}
    for i, uid in enumerate(uids):
        first.setdefault(uid, i)
        counts[uid] = counts.get(uid, 0) + 1
    do_sample = non_tensor_batch.get("__do_sample__")
    requests = []
    for uid, i in first.items():
        if do_sample is not None:
            _same_do_sample(uid, [bool(do_sample[j]) for j, u in enumerate(uids) if u == uid])
        row = dataset_row({key: column[i] for key, column in non_tensor_batch.items()})
        row["__rollout_n__"] = counts[uid]
        requests.append(PromptRequest(uid=uid, row=row, n=counts[uid]))
    return uids, requests


def _same_do_sample(uid: str, values: Sequence[bool]) -> None:
    if len(set(values)) > 1:
        raise RolloutBusError(
            f"uid {uid}: rows disagree on __do_sample__ (REMAX's greedy baseline shares the "
            "uid of its sampled rows); a bus group samples with one set of parameters"
        )
