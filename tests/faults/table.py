"""One row per fault run, and the table conftest.py prints at the end of the test session."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FaultRow:
    scenario: str
    expected: int
    attempts: int = 0
    lost: int = 0
    duplicated: int = 0
    resumed: int = 0
    resampled: int = 0
    failed: int = 0
    dead_letters: int = 0
    restarts: int = 0
    differ: int | None = None  # None: no reference to compare with
    # seconds from a replay buffer's SIGKILL to the next group released, median over the
    # run's replay-buffer kills (None: none killed); every kill's figure is in the notes
    stall_s: float | None = None
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


ROWS: list[FaultRow] = []  # every row measured in this test session; conftest prints them

COLUMNS = [
    ("fault scenario", 34, "scenario"),
    ("sessions", 8, "expected"),
    ("attempts", 8, "attempts"),
    ("lost", 5, "lost"),
    ("dup", 4, "duplicated"),
    ("resumed", 7, "resumed"),
    ("resampled", 9, "resampled"),
    ("failed", 6, "failed"),
    ("dead letters", 12, "dead_letters"),
    ("restarts", 8, "restarts"),
    ("differ", 6, "differ"),
    ("stall s", 7, "stall_s"),
    ("wall s", 7, "wall_s"),
]
DECIMALS = {"stall_s": 1}  # digits after the point; other floats are whole seconds


def format_table(rows: list[FaultRow]) -> list[str]:
    header = "  ".join(
        title.ljust(width) if i == 0 else title.rjust(width)
        for i, (title, width, _) in enumerate(COLUMNS)
    )
    lines = [header]
    for row in rows:
        cells = []
        for i, (_, width, attr) in enumerate(COLUMNS):
            text = _cell(getattr(row, attr), DECIMALS.get(attr, 0))
            cells.append(text.ljust(width) if i == 0 else text.rjust(width))
        lines.append("  ".join(cells))
    for row in rows:
        for note in row.notes:
            lines.append(f"  {row.scenario}: {note}")
    return lines


def _cell(value: object, decimals: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{decimals}f}"
    return str(value)


__all__ = ["COLUMNS", "ROWS", "FaultRow", "format_table"]
