"""``simple_timer``: verl's accumulating timer (``verl.utils.profiler.simple_timer``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def simple_timer(name: str, timing_raw: dict[str, Any]) -> Iterator[None]:
    """Add the seconds spent in the block to ``timing_raw[name]``.

    It accumulates, as verl's does: a multi-turn loop that times every turn under
    ``generate_sequences`` ends with the total over all turns.
    """
    start = time.perf_counter()
    try:
        yield
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + (time.perf_counter() - start)
