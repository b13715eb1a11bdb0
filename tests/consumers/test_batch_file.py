"""``replay --out``'s Arrow file (``consumers/report.py``, ``BatchFile``): written as the
groups' batches arrive, joined into record batches of about ``rows`` rows, and at its path
only once closed without an error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from rolloutbus.consumers.report import BatchFile
from rolloutbus.errors import SchemaError
from rolloutbus.schemas.trajectories import trajectories_to_batch
from tests.builders import make_group


def _groups(count: int) -> list[pa.RecordBatch]:
    return [trajectories_to_batch(make_group(f"g{i}", 4)) for i in range(count)]


def _read(path: Path) -> list[pa.RecordBatch]:
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]


def test_the_rows_are_written_as_they_come_in_batches_of_about_rows(tmp_path: Path) -> None:
    groups = _groups(5)
    path = tmp_path / "out" / "replay.arrow"
    with BatchFile(path, rows=8) as out:
        for i, batch in enumerate(groups):
            out.write(batch)
            # what is held is written once it reaches 8 rows: never more than one batch's worth
            assert out.held == (4 * (i + 1)) % 8
    assert out.rows == 20
    written = _read(path)
    assert [b.num_rows for b in written] == [8, 8, 4]
    assert pa.Table.from_batches(written).equals(pa.Table.from_batches(groups))
    assert list(path.parent.iterdir()) == [path]  # no partial file left beside it


def test_an_error_leaves_no_file_and_no_partial_one(tmp_path: Path) -> None:
    path = tmp_path / "replay.arrow"
    with pytest.raises(RuntimeError, match="broker gone"), BatchFile(path, rows=4) as out:
        for batch in _groups(3):
            out.write(batch)
        raise RuntimeError("broker gone")
    assert list(tmp_path.iterdir()) == []


def test_no_batch_is_an_empty_file_that_reads(tmp_path: Path) -> None:
    path = tmp_path / "replay.arrow"
    with BatchFile(path) as out:
        pass
    assert out.rows == 0 and _read(path) == []


def test_a_batch_of_another_schema_is_refused_by_name_and_leaves_no_file(tmp_path: Path) -> None:
    path = tmp_path / "replay.arrow"
    other = pa.record_batch({"uid": ["g0"]})
    with pytest.raises(SchemaError, match="another schema"), BatchFile(path) as out:
        out.write(_groups(1)[0])
        out.write(other)
    assert list(tmp_path.iterdir()) == []


def test_a_failure_while_closing_leaves_no_truncated_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "replay.arrow"
    out = BatchFile(path)
    out.write(_groups(1)[0])

    def disk_full(batch: pa.RecordBatch) -> None:  # a fault injector: the write fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(out, "_writer", _FailingWriter(out._writer, disk_full))
    with pytest.raises(OSError, match="No space left"), out:
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_cannot_start_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*_: object) -> None:  # a fault injector: pyarrow's writer fails to open
        raise pa.ArrowIOError("cannot write the file header")

    monkeypatch.setattr(pa.ipc, "new_file", refused)
    with pytest.raises(pa.ArrowIOError, match="file header"):
        BatchFile(tmp_path / "replay.arrow")
    assert list(tmp_path.iterdir()) == []


class _FailingWriter:
    """pyarrow's file writer whose ``write_batch`` is replaced (the close still closes it)."""

    def __init__(self, writer: pa.ipc.RecordBatchFileWriter, write_batch: Any):
        self._writer, self.write_batch = writer, write_batch

    def close(self) -> None:
        self._writer.close()
