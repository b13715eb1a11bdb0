"""Read dataset rows (parquet or jsonl) and make the bundled arithmetic dataset.

Reading never raises on a bad row: each row comes back either parsed or as a
``BadRow`` with the original bytes and the reason, for the dead-letter topic.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutbus.errors import ConfigError


@dataclass(frozen=True)
class RawRow:
    source: str  # "file:line" or "file#row"
    data: dict[str, Any]


@dataclass(frozen=True)
class BadRow:
    source: str
    original: bytes
    reason: str


def check_dataset(path: str | Path) -> Path:
    """The dataset's path, if it exists and has a format we read; else a ConfigError."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"dataset not found: {path}")
    if path.suffix not in (".parquet", ".jsonl", ".json"):
        raise ConfigError(
            f"dataset {path}: unsupported format {path.suffix!r} (use .parquet or .jsonl)"
        )
    return path


def read_rows(path: str | Path) -> Iterator[RawRow | BadRow]:
    path = check_dataset(path)
    if path.suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        yield from _read_jsonl(path)


def count_rows(path: str | Path) -> int | None:
    path = check_dataset(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def _read_jsonl(path: Path) -> Iterator[RawRow | BadRow]:
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            source = f"{path.name}:{number}"
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                # the location is the source's line; json's own "line 1" would be a second one
                reason = f"not valid JSON: {exc.msg} (column {exc.colno})"
                yield BadRow(source, line.rstrip(b"\n"), reason)
                continue
            if not isinstance(data, dict):
                yield BadRow(
                    source,
                    line.rstrip(b"\n"),
                    f"a JSON {type(data).__name__}, not an object",
                )
                continue
            yield RawRow(source, data)


def _read_parquet(path: Path) -> Iterator[RawRow | BadRow]:
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield RawRow(f"{path.name}#{index}", _numpy_free(row))
            index += 1


def _numpy_free(value: Any) -> Any:
    """verl parquet files hold numpy arrays of messages; make them plain JSON values."""
    if isinstance(value, dict):
        return {k: _numpy_free(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_numpy_free(v) for v in value]
    if hasattr(value, "tolist"):
        return _numpy_free(value.tolist())
    return value


# -- the bundled arithmetic dataset ---------------------------------------------------
_OPS = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
SYSTEM_TOOL_PROMPT = (
    "You are a careful assistant. Use the calculator tool for arithmetic, "
    "then give the final answer as a number."
)


def make_arithmetic_rows(
    count: int,
    *,
    seed: int = 0,
    tool_fraction: float = 0.5,
    data_source: str = "rolloutbus/arithmetic",
) -> list[dict[str, Any]]:
    """verl-format rows: "计算 18 * 7"-style questions with rule-based ground truth.

    A ``tool_fraction`` of the rows name ``agent_name: tool_agent`` and offer the
    calculator; the rest leave agent_name out (so the default loop applies).
    """
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        symbol, fn = rng.choice(_OPS)
        question = f"What is {a} {symbol} {b}? Answer with the number only."
        row: dict[str, Any] = {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": str(fn(a, b))},
            "extra_info": {"index": index, "split": "train", "expression": f"{a} {symbol} {b}"},
        }
        if rng.random() < tool_fraction:
            row["agent_name"] = "tool_agent"
            row["prompt"] = [{"role": "system", "content": SYSTEM_TOOL_PROMPT}, *row["prompt"]]
            row["extra_info"]["tools_kwargs"] = {"calculator": {}}
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path
