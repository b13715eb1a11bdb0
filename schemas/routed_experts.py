"""MoE routed experts (verl's R3, rollout routing replay) as they travel on the bus.

An engine started for routing replay returns, with each turn, which experts every token
it fed through the model was routed to: an integer array ``(tokens, layers, top_k)``
(vLLM sends it as base64 ``.npy``; verl keeps it as a numpy array and stores it as int16).
On the turn log it is one field of the generation event, ``RoutedExperts``: the shape and
the little-endian int16 bytes, base64 in JSON (a few bytes per routing decision, not a
JSON number each), equal by value, so events that carry it compare and replay as any
other. In a trajectory it is the ``routed_experts`` column, rows ``[token][layer][k]``.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer

_INT16 = np.dtype("<i2")  # verl's dtype (torch.int16): expert ids below 32768


def _decode_bytes(value: Any) -> Any:
    if isinstance(value, str):
        return base64.b64decode(value.encode("ascii"), validate=True)
    return value


Int16Bytes = Annotated[
    bytes,
    BeforeValidator(_decode_bytes),
    PlainSerializer(
        lambda raw: base64.b64encode(raw).decode("ascii"), return_type=str, when_used="json"
    ),
]


class RoutedExperts(BaseModel):
    """One turn's routed experts: ``shape`` (tokens, layers, top_k) and int16 ``data``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: tuple[int, int, int] = Field(description="(tokens, layers, top_k)")
    data: Int16Bytes

    def model_post_init(self, context: Any) -> None:
        expected = int(np.prod(self.shape)) * _INT16.itemsize
        if any(n < 0 for n in self.shape) or len(self.data) != expected:
            raise ValueError(
                f"routed experts of shape {self.shape} need {expected} bytes of int16, "
                f"got {len(self.data)}"
            )

    @classmethod
    def from_array(cls, experts: Any) -> RoutedExperts:
        """From what an engine returned: a numpy array, a tensor or nested lists, 3-D."""
        array = np.asarray(experts.cpu() if hasattr(experts, "cpu") else experts)
        if array.ndim != 3:
            raise ValueError(
                f"routed experts must be 3-D (tokens, layers, top_k), got shape {array.shape}"
            )
        limits = np.iinfo(_INT16)
        if array.size and (array.min() < limits.min or array.max() > limits.max):
            raise ValueError("routed experts hold expert ids outside int16")
        rows, layers, top_k = (int(n) for n in array.shape)
        return cls(shape=(rows, layers, top_k), data=array.astype(_INT16).tobytes())

    def to_numpy(self) -> np.ndarray:
        """The ``(tokens, layers, top_k)`` int16 array (a copy: writable)."""
        return np.frombuffer(self.data, dtype=_INT16).reshape(self.shape).copy()

    @property
    def num_tokens(self) -> int:
        return self.shape[0]

    def head(self, rows: int) -> RoutedExperts:
        """The first ``rows`` tokens' routing (all of it when it has fewer)."""
        rows = max(0, min(rows, self.shape[0]))
        per_row = self.shape[1] * self.shape[2] * _INT16.itemsize
        return RoutedExperts(shape=(rows, *self.shape[1:]), data=self.data[: rows * per_row])

    def to_lists(self) -> list[list[list[int]]]:
        """Nested lists ``[token][layer][k]``: the trajectory column's row."""
        rows: list[list[list[int]]] = self.to_numpy().astype(np.int64).tolist()
        return rows
