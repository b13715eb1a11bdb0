"""Per-step figures: a JSONL or CSV file, Prometheus, and one progress line: on stderr
when it is a terminal, else a log record (timestamped, in the one log format)."""

from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import IO, Any

from rolloutbus.consumers.training.metrics import TrainerMetrics

log = logging.getLogger(__name__)

# the figures shown on the progress line, in order, with their label and format
PROGRESS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("actor/pg_clipfrac", "clip", "{:.3f}"),
    ("rollout_corr/rollout_is_mean", "is", "{:.3f}"),
    ("rollout_corr/kl", "kl", "{:.4f}"),
    ("staleness/max", "stale", "{:.0f}"),
    ("timing/step_s", "step_s", "{:.2f}"),
    ("timing/wait_s", "wait_s", "{:.2f}"),
    ("perf/tokens_per_s", "tok/s", "{:.0f}"),
)


class StepLog:
    """Writes each step's record to ``path`` (one JSON object a line, or a CSV row when the
    path ends in ``.csv``; a CSV's columns are the first record's keys), sets the Prometheus
    series and prints a progress line. Opened for append: a restarted trainer continues
    the same file (steps after the last checkpoint appear twice, the later one counts)."""

    def __init__(
        self,
        path: Path | None,
        metrics: TrainerMetrics,
        stream: IO[str] | None = None,
        *,
        console: bool = True,  # the progress line (verl's "console" in trainer.logger)
    ):
        self.path = path
        self.metrics = metrics
        # the progress line's destination: the given stream, else stderr on a terminal,
        # else (None) the log
        self.stream = stream if stream is not None else _terminal(sys.stderr)
        self.console = console
        self._file: IO[str] | None = None
        self._csv: csv.DictWriter | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", newline="")

    def write(self, record: dict[str, Any]) -> None:
        self._write_file(record)
        self._export(record)
        if self.console:
            self._print(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write_file(self, record: dict[str, Any]) -> None:
        if self._file is None or self.path is None:
            return
        if self.path.suffix == ".csv":
            row = {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in record.items()}
            if self._csv is None:
                self._csv = csv.DictWriter(self._file, fieldnames=list(row), extrasaction="ignore")
                if self._file.tell() == 0:
                    self._csv.writeheader()
            self._csv.writerow(row)
        else:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def _export(self, record: dict[str, Any]) -> None:
        m = self.metrics
        m.global_step.set(record["global_step"])
        m.policy_version.set(record["policy_version"])
        m.groups.inc(record["groups"])
        m.tokens.inc(record["tokens"])
        m.step_seconds.observe(record["timing/step_s"])
        m.failed_dropped.inc(record.get("dropped/failed_trajectories", 0))
        for key, value in record.items():
            if key.startswith("reward/mean/"):
                m.reward.labels(data_source=key.removeprefix("reward/mean/")).set(value)
            elif key in m.figures and isinstance(value, int | float):
                m.figures[key].set(value)  # one named gauge per figure (TRAINER_GAUGES)

    def _print(self, record: dict[str, Any]) -> None:
        parts = [f"step {record['global_step']} v{record['policy_version']}"]
        for key, label, fmt in PROGRESS:
            if key in record:
                parts.append(f"{label} {fmt.format(record[key])}")
        if self.stream is None:
            log.info(" | ".join(parts))
        else:
            print("[train] " + " | ".join(parts), file=self.stream, flush=True)


def _terminal(stream: IO[str]) -> IO[str] | None:
    isatty = getattr(stream, "isatty", None)
    return stream if isatty is not None and isatty() else None
