"""A pytest plugin for ``benchmarks/fault_row_loop.py``: every selected test runs
``$ROLLOUTBUS_REPEAT`` times in one session (one broker, one module-scoped reference run),
as ``name[r0]``, ``name[r1]``, ... Load it with ``-p repeat_items`` (this folder on
PYTHONPATH)."""

from __future__ import annotations

import os

import pytest

REPEAT_ENV = "ROLLOUTBUS_REPEAT"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    times = int(os.environ.get(REPEAT_ENV, "1"))
    if times > 1:
        metafunc.fixturenames.append("repeat_index")
        metafunc.parametrize("repeat_index", range(times), ids=lambda i: f"r{i}")
