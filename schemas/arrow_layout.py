"""A record's Arrow columns, derived from its pydantic model: the model is the one definition.

Each model field is one column named by the field's alias, in field order, its Arrow type
from the Python type unless the field says otherwise (``Annotated[..., Arrow(...)]``):

* ``int``: the narrowest of int32/int64 that holds the field's validated range (pydantic's
  ``ge``/``le``: ``tokens.Int32`` is int32, an unbounded ``int`` int64); ``float``: float64;
  ``bool``: bool; ``str``, string enums (their value) and string ``Literal`` types: string;
* ``dict``, ``list[dict]``, ``Any`` and nested models: a JSON string column (sorted keys);
* ``Arrow(type)``: that type (widths, the ragged ``large_list`` token columns);
  ``Arrow(type, codec=...)``: a column built and read by the codec (nested numeric data that
  would be slow as Python lists);
* ``Flatten()`` on a nested model: that model's fields become columns of their own, in
  place, by the same rules.

``Derived`` columns are computed from the record (verl's ``loss_mask``, lengths) and placed
after a named column; they are written, never read back. A ``T | None`` field is a nullable
column; a null read back into a field that is not optional gives the field's default.

Reading is by column name (:meth:`ArrowLayout.records`): a column the batch lacks is not
passed to the model, so its field takes its default; a column the layout does not know is
not read. What that means for records written by other versions is
``docs/schema-evolution.md``'s (``decode_trajectory_batch`` applies it).
"""

from __future__ import annotations

import array
import itertools
import json
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Literal, TypeVar, Union, get_args, get_origin

import numpy as np
import pyarrow as pa
from pydantic import BaseModel
from pydantic.fields import FieldInfo

__all__ = ["Arrow", "ArrowLayout", "Column", "ColumnCodec", "Derived", "Flatten"]

M = TypeVar("M", bound=BaseModel)
INT32_RANGE = (-(2**31), 2**31 - 1)


@dataclass(frozen=True)
class ColumnCodec:
    """Builds a whole column from the field's values, and reads one row's value back."""

    build: Callable[[list[Any]], pa.Array]
    read: Callable[[pa.Array, int], Any]


@dataclass(frozen=True)
class Arrow:
    """``Annotated`` metadata: the field's Arrow type, where the Python type does not say it."""

    type: pa.DataType
    codec: ColumnCodec | None = None


@dataclass(frozen=True)
class Flatten:
    """``Annotated`` metadata on a nested model field: its fields are columns of their own."""


@dataclass(frozen=True)
class Derived:
    """A column computed from the record, written after the column ``after``."""

    name: str
    type: pa.DataType
    after: str
    value: Callable[[Any], Any]


@dataclass(frozen=True)
class Column:
    """One Arrow column and where its value lives in the model."""

    name: str  # the column name: the field's alias
    type: pa.DataType
    kind: str  # "value", "json", "nested" (a flattened field), "codec" or "derived"
    field: str = ""  # the model attribute (for "nested": the sub-model's attribute)
    parent: str = ""  # for "nested": the column name (alias) of the flattened field
    optional: bool = True  # None is a value of the field (else a null reads as its default)
    required: bool = False  # the field has no default: a record without it cannot be read
    codec: ColumnCodec | None = None
    derive: Callable[[Any], Any] | None = None


class ArrowLayout(Generic[M]):
    """The columns of ``model`` (plus ``derived``) and the conversions both ways."""

    def __init__(
        self,
        model: type[M],
        derived: Sequence[Derived] = (),
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.columns = _place_derived(_model_columns(model, parent=""), derived)
        self.schema = pa.schema([pa.field(c.name, c.type) for c in self.columns], metadata=metadata)
        self.names = frozenset(c.name for c in self.columns)
        self.required = tuple(c.name for c in self.columns if c.required)
        self._codecs = {c.name: c for c in self.columns if c.kind == "codec"}
        # decided once, not per column of every batch (a batch is built per released group)
        self._numeric = frozenset(
            c.name
            for c in self.columns
            if c.kind in ("value", "derived") and _is_numeric_list(c.type)
        )
        # every other column is converted in one call, as the fields of one struct column
        # (pyarrow's fixed cost per conversion was most of a small batch's build)
        scalars = [c for c in self.columns if c.kind != "codec" and c.name not in self._numeric]
        # a row of them is the value columns read in one C call, then the others' cells
        valued = [c for c in scalars if c.kind == "value"]
        self._scalars = valued + [c for c in scalars if c.kind != "value"]
        self._scalar_struct = pa.struct([pa.field(c.name, c.type) for c in self._scalars])
        self._read_values = _tuple_getter([c.field for c in valued])
        self._other_cells = [_cell_reader(c) for c in self._scalars[len(valued) :]]
        self._codec_fields = {c.field for c in self._codecs.values()}
        # fields read by attribute when a batch is built: only the others are dumped
        self._not_dumped = self._codec_fields | {c.field for c in self.columns if c.kind == "value"}

    def row(self, record: M) -> dict[str, Any]:
        """The Arrow row of ``record``, codec columns aside (they are built per column)."""
        dumped = record.model_dump(by_alias=True, exclude=self._codec_fields)
        return {c.name: _cell(c, dumped, record) for c in self.columns if c.kind != "codec"}

    def batch(
        self, records: Sequence[M], given: dict[str, pa.Array] | None = None
    ) -> pa.RecordBatch:
        """The records as one batch, built column by column: a numeric list column (the
        token columns) is flattened into one numpy array (a row-wise ``from_pylist``
        converted every token through a Python dict and was most of the replay buffer's
        time); a column derived as the same lists as another is that column's array again;
        the other columns are converted together (``_scalar_columns``).

        ``given``: numeric list columns the caller built itself (the columnar fold's token
        columns, from numpy), by name; they are taken as they are, the records' own values
        of those fields not read."""
        given = given or {}
        dumped = [r.model_dump(by_alias=True, exclude=self._not_dumped) for r in records]
        built: dict[tuple[Any, ...], tuple[list[Any], pa.Array]] = {}
        scalars = self._scalar_columns(records, dumped)
        arrays = [
            given[c.name]
            if c.name in given
            else scalars[c.name]
            if c.name in scalars
            else self._column(c, records, dumped, built)
            for c in self.columns
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=self.schema)

    def _scalar_columns(
        self, records: Sequence[M], dumped: list[dict[str, Any]]
    ) -> dict[str, pa.Array]:
        """The columns that are neither numeric lists nor codecs, by name: one struct array
        converted from a tuple per record, then split into its fields (the same builders
        as a ``pa.array`` per column, so the same buffers, in one call instead of ~30).
        A string enum is converted as the string it is (its value)."""
        read_values, others = self._read_values, self._other_cells
        rows = [
            read_values(r) + tuple(cell(d, r) for cell in others)
            for d, r in zip(dumped, records, strict=True)
        ]
        fields = pa.array(rows, self._scalar_struct).flatten()
        return {c.name: array for c, array in zip(self._scalars, fields, strict=True)}

    def _column(
        self,
        column: Column,
        records: Sequence[M],
        dumped: list[dict[str, Any]],
        built: dict[tuple[Any, ...], tuple[list[Any], pa.Array]],
    ) -> pa.Array:
        if column.kind == "codec":
            return _codec(column).build([getattr(r, column.field) for r in records])
        if column.name in self._numeric:
            values = [_attribute(column, r) for r in records]
            # the same list objects, the same array (loss_mask is response_mask); the entry
            # keeps the lists alive, so no other list can take their ids meanwhile
            source = (column.type, *map(id, values))
            if source not in built:
                built[source] = (values, numeric_list_column(values, column.type))
            return built[source][1]
        raise AssertionError(f"column {column.name} is built with the scalar columns")

    def records(self, batch: pa.RecordBatch | pa.Table) -> list[M]:
        """The batch's rows as models, read by column name (see the module docstring)."""
        present = [c for c in self.columns if c.name in batch.schema.names]
        coded = {c.name: _whole_column(batch, c.name) for c in present if c.kind == "codec"}
        out = []
        for i, row in enumerate(batch.select([c.name for c in present]).to_pylist()):
            values = _field_values(present, row)
            for name, column in coded.items():
                values[name] = _codec(self._codecs[name]).read(column, i)
            out.append(self.model.model_validate(values))
        return out


def _codec(column: Column) -> ColumnCodec:
    assert column.codec is not None  # a "codec" column is made with its codec
    return column.codec


def _cell(column: Column, dumped: dict[str, Any], record: Any) -> Any:
    if column.kind == "derived":
        return column.derive(record)  # type: ignore[misc]
    value = dumped[column.parent][column.name] if column.kind == "nested" else dumped[column.name]
    if column.kind == "json":
        return None if value is None else json.dumps(value, sort_keys=True)
    return value.value if isinstance(value, Enum) else value


def _attribute(column: Column, record: Any) -> Any:
    if column.kind == "derived":
        return column.derive(record)  # type: ignore[misc]
    return getattr(record, column.field)


def _tuple_getter(fields: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    """Reads ``fields`` of a record as one tuple (``attrgetter`` of one name returns the
    value itself)."""
    if not fields:
        return lambda record: ()
    get = operator.attrgetter(*fields)
    return get if len(fields) > 1 else (lambda record: (get(record),))


def _cell_reader(column: Column) -> Callable[[dict[str, Any], Any], Any]:
    """``_cell`` for one column, decided once: the reader of its cell from (dumped, record)."""
    if column.kind == "derived":
        derive = column.derive
        assert derive is not None
        return lambda dumped, record: derive(record)
    name, parent = column.name, column.parent
    if column.kind == "nested":
        return lambda dumped, record: dumped[parent][name]
    if column.kind != "json":  # value columns are read together, by _tuple_getter
        raise AssertionError(f"no cell reader for a {column.kind} column ({name})")
    return lambda dumped, record: _json_cell(dumped[name])


def _json_cell(value: Any) -> str | None:
    if value is None:
        return None
    if not value and type(value) in (dict, list):
        return "{}" if type(value) is dict else "[]"  # most JSON cells: json.dumps costs ~2 us
    return json.dumps(value, sort_keys=True)


def _is_numeric_list(arrow_type: pa.DataType) -> bool:
    if not pa.types.is_large_list(arrow_type):
        return False
    item = arrow_type.value_type
    return bool(pa.types.is_integer(item) or pa.types.is_floating(item))


def numeric_list_column(values: list[Any], arrow_type: pa.LargeListType) -> pa.Array:
    """A ``large_list`` column of numbers from Python lists (None: a null list) through one
    numpy array. An int outside the item type raises ArrowInvalid, as ``pa.array`` does; a
    float beyond float32 becomes inf, as Arrow's own conversion makes it."""
    dtype = arrow_type.value_type.to_pandas_dtype()
    nulls = [v is None for v in values]
    if all(nulls):  # e.g. rm_scores of a group without rewards
        return pa.nulls(len(values), arrow_type)
    lengths = np.fromiter((0 if v is None else len(v) for v in values), np.int64, len(values))
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    try:
        with np.errstate(over="ignore"):
            flat = _flat_items(values, dtype, int(offsets[-1]))
    except OverflowError as exc:
        raise pa.ArrowInvalid(f"a value does not fit {arrow_type.value_type}: {exc}") from exc
    return pa.LargeListArray.from_arrays(
        pa.array(offsets), pa.array(flat), mask=pa.array(nulls) if any(nulls) else None
    )


# numpy item types that ``array.array`` holds with the same bytes (native order, and this
# package runs on little-endian machines only: the wire format is little-endian too)
_ARRAY_CODES = {np.dtype(np.int8): "b", np.dtype(np.int32): "i", np.dtype(np.float32): "f"}


def _flat_items(values: list[Any], dtype: np.dtype[Any], total: int) -> np.ndarray:
    """Every item of the lists (None: none) as one numpy array. ``array.fromlist`` takes a
    list in one C call, ~40% faster per item than ``np.fromiter`` over a chain; both raise
    OverflowError for an int out of range and make a float beyond float32 inf."""
    code = _ARRAY_CODES.get(np.dtype(dtype))
    if code is None or array.array(code).itemsize != np.dtype(dtype).itemsize:
        items = itertools.chain.from_iterable(v for v in values if v is not None)
        return np.fromiter(items, dtype, total)
    flat = array.array(code)
    for v in values:
        if v is not None:
            flat.fromlist(v if isinstance(v, list) else list(v))
    return np.frombuffer(flat, dtype)


def _field_values(columns: list[Column], row: dict[str, Any]) -> dict[str, Any]:
    """The model's input from one row: nulls of non-optional fields left out (defaults)."""
    values: dict[str, Any] = {}
    for c in columns:
        value = row.get(c.name)
        if c.kind in ("derived", "codec") or (value is None and not c.optional):
            continue
        if c.kind == "json" and value is not None:
            value = json.loads(value)
        if c.kind == "nested":
            values.setdefault(c.parent, {})[c.name] = value
        else:
            values[c.name] = value
    return values


def _whole_column(batch: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    column = batch.column(name)
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def _model_columns(model: type[BaseModel], parent: str) -> list[Column]:
    columns: list[Column] = []
    for attribute, info in model.model_fields.items():
        name = info.alias or attribute
        arrow = next((m for m in info.metadata if isinstance(m, Arrow)), None)
        inner, optional = _unwrap_optional(info.annotation)
        if any(isinstance(m, Flatten) for m in info.metadata):
            if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
                raise TypeError(f"{model.__name__}.{attribute}: Flatten needs a nested model")
            columns += [
                Column(c.name, c.type, "nested", c.field, name, c.optional, False)
                for c in _model_columns(inner, parent=name)
            ]
            continue
        column = Column(
            name,
            arrow.type if arrow is not None else _default_type(model, attribute, info, inner),
            _kind(arrow, inner),
            attribute,
            optional=optional,
            required=info.is_required(),
            codec=arrow.codec if arrow is not None else None,
        )
        columns.append(column)
    return columns


def _kind(arrow: Arrow | None, inner: Any) -> str:
    if arrow is not None:
        return "codec" if arrow.codec is not None else "value"
    return "json" if _is_json(inner) else "value"


def _place_derived(columns: list[Column], derived: Sequence[Derived]) -> list[Column]:
    out = list(columns)
    for d in derived:
        index = next((i for i, c in enumerate(out) if c.name == d.after), None)
        if index is None:
            raise TypeError(f"derived column {d.name} follows {d.after}, which is not a column")
        out.insert(index + 1, Column(d.name, d.type, "derived", derive=d.value))
    return out


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) < len(get_args(annotation))
    return annotation, False


_SCALARS: dict[type, pa.DataType] = {bool: pa.bool_(), float: pa.float64(), str: pa.string()}


def _default_type(model: type, attribute: str, info: FieldInfo, inner: Any) -> pa.DataType:
    if inner is int:
        return pa.int32() if _within(info, INT32_RANGE) else pa.int64()
    if isinstance(inner, type) and issubclass(inner, Enum) and issubclass(inner, str):
        return pa.string()
    if get_origin(inner) is Literal and all(isinstance(a, str) for a in get_args(inner)):
        return pa.string()
    if inner in _SCALARS:
        return _SCALARS[inner]
    if _is_json(inner):
        return pa.string()
    raise TypeError(
        f"{model.__name__}.{attribute}: no Arrow column type for {inner!r}; "
        "annotate it with Arrow(<pyarrow type>)"
    )


def _within(info: FieldInfo, bounds: tuple[int, int]) -> bool:
    low = max((m.ge for m in info.metadata if hasattr(m, "ge")), default=None)
    high = min((m.le for m in info.metadata if hasattr(m, "le")), default=None)
    return low is not None and high is not None and low >= bounds[0] and high <= bounds[1]


def _is_json(inner: Any) -> bool:
    if inner is Any or inner is dict or get_origin(inner) is dict:
        return True
    if isinstance(inner, type) and issubclass(inner, BaseModel):
        return True
    if get_origin(inner) is list:
        (item,) = get_args(inner) or (Any,)
        return _is_json(item)
    return False
