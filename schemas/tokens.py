"""Compact binary encoding of token arrays inside JSON events.

Token ids travel as base64 of little-endian int32, logprobs as base64 of little-endian
float32, masks as base64 of int8: in Python they are plain lists, on the wire a string
about a quarter the size of a JSON list of ids and decoded by numpy in one call
(benchmarks/encoding.py measures the choice). The envelope stays JSON so an operator can
read an event with kcat.

Decoding a string skips pydantic's check of every item: each item of an int32 (int8) array
is an int in the int32 (int8) range by construction, and a float32 array holds floats, so
the check could not fail; it was most of the cost of reading a generation event. A list
(a JSON list in an old log, or a model built in Python) is checked item by item as before.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
from pydantic import Field, PlainSerializer, ValidatorFunctionWrapHandler, WrapValidator

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_I8 = np.dtype("<i1")

# Integers as wide as the wire encoding and the trajectory's Arrow columns that they end in:
# a JSON number outside them is a ValidationError when the event is read, not an
# OverflowError when a worker re-encodes it or builds the Arrow record.
INT32_MAX = 2**31 - 1
Int8 = Annotated[int, Field(ge=-(2**7), le=2**7 - 1)]
Int32 = Annotated[int, Field(ge=-(2**31), le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


def _encoder(dtype: np.dtype[Any]) -> Callable[[list[Any]], str]:
    def encode(values: list[Any]) -> str:
        return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")

    return encode


def _decoder(dtype: np.dtype[Any], kind: type) -> Callable[[Any], Any]:
    def decode(value: Any) -> Any:
        if isinstance(value, str):
            raw = base64.b64decode(value.encode("ascii"), validate=True)
            if len(raw) % dtype.itemsize:
                raise ValueError(f"{len(raw)} bytes is not a whole number of {dtype} values")
            return np.frombuffer(raw, dtype=dtype).tolist()  # Python ints or floats
        if isinstance(value, np.ndarray):
            return value.astype(kind).tolist()
        return value

    return decode


def _validator(dtype: np.dtype, kind: type) -> WrapValidator:
    """A wire string decoded is returned as it is (its items are in range by construction);
    anything else is decoded, then checked item by item by pydantic (``handler``)."""
    decode = _decoder(dtype, kind)

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if isinstance(value, str):
            return decode(value)
        return handler(decode(value))

    return WrapValidator(validate)


encode_token_ids = _encoder(_I32)
decode_token_ids = _decoder(_I32, np.int64)
encode_logprobs = _encoder(_F32)
decode_logprobs = _decoder(_F32, np.float64)

TokenIds = Annotated[
    list[Int32],
    _validator(_I32, np.int64),
    PlainSerializer(encode_token_ids, return_type=str, when_used="json"),
]
Logprobs = Annotated[
    list[float],
    _validator(_F32, np.float64),
    PlainSerializer(encode_logprobs, return_type=str, when_used="json"),
]
Mask = Annotated[
    list[Int8],
    _validator(_I8, np.int64),
    PlainSerializer(_encoder(_I8), return_type=str, when_used="json"),
]
