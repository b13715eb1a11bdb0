"""Checked weight reloads for the embedded replica: ``read_weight_update`` checks a folder of
new weights (``model.save_pretrained`` output, or a plain safetensors state dict) against the
running model, for a reload without a restart. Loading a model is ``rolloutbus.models``'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The old path of load_causal_lm (now rolloutbus.models.causal_lm), re-exported for callers
# outside this branch's reach (tests/faults/test_faults_weight_sync.py, in the fault-harness split
# under way); remove once they import it from rolloutbus.models.
from rolloutbus.models.causal_lm import load_causal_lm
from rolloutbus.replica.generation import WeightsRejectedError

__all__ = ["WeightUpdate", "load_causal_lm", "read_weight_update"]


class WeightUpdate:
    """New values for every parameter of a running model, checked and ready to copy.

    Built in any thread (reading files, comparing names and shapes touches no model
    tensor); ``apply()`` copies in place and must run where nothing else uses the model
    (the engine's decode thread), so a forward pass never sees half-copied weights.
    """

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], source: Path) -> None:
        self.pairs, self.source = pairs, source

    def apply(self) -> None:
        with torch.no_grad():
            for target, value in self.pairs:
                target.copy_(value)  # casts, e.g. a bfloat16 checkpoint into a float32 model


def read_weight_update(model: Any, weights_path: str | Path) -> WeightUpdate:
    """The safetensors in ``weights_path`` as a ``WeightUpdate`` for ``model``.

    Every parameter must be given once, with the same name and shape as in the model;
    a parameter tied to another (``lm_head`` to the embeddings) may be left out, as
    ``save_pretrained`` does. Anything else raises ``WeightsRejectedError`` naming it.
    """
    folder = Path(weights_path)
    tensors = _read_safetensors(folder)
    expected = model.state_dict()
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise WeightsRejectedError(
            f"{folder}: {len(unknown)} tensor(s) the served model does not have, e.g. "
            f"{unknown[:3]} (a checkpoint of another architecture?)"
        )
    wrong = [
        f"{name}: {tuple(value.shape)} in the folder, {tuple(expected[name].shape)} served"
        for name, value in tensors.items()
        if value.shape != expected[name].shape
    ]
    if wrong:
        raise WeightsRejectedError(f"{folder}: shape mismatch for {wrong[:3]}")
    given = {expected[name].data_ptr() for name in tensors}
    # A missing name is fine only when a tensor sharing its storage (a tied weight) is given.
    missing = sorted(
        n for n, t in expected.items() if n not in tensors and t.data_ptr() not in given
    )
    if missing:
        raise WeightsRejectedError(
            f"{folder}: {len(missing)} parameter(s) missing from the folder, e.g. {missing[:3]}"
        )
    pairs = [(expected[name], value) for name, value in tensors.items()]
    return WeightUpdate(pairs, folder)


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not folder.is_dir():
        raise WeightsRejectedError(f"weights_path {str(folder)!r} is not a folder on the replica")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsRejectedError(
            f"weights_path {str(folder)!r} holds no *.safetensors file "
            "(write it with model.save_pretrained or safetensors.torch.save_file)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:  # one file, or the shards of save_pretrained's max_shard_size
        try:
            part = load_file(str(file))
        except Exception as exc:  # safetensors raises its own SafetensorError, and OSError
            raise WeightsRejectedError(f"cannot read {file}: {exc}") from exc
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise WeightsRejectedError(f"{folder}: {twice[:3]} appear in more than one file")
        tensors.update(part)
    return tensors
