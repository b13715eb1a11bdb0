"""Run one fault row N times in a row while a second job loads the CPU; count the passes.

    python benchmarks/fault_row_loop.py [--file tests/faults/test_faults.py] [--row rebalance]
                                        [--times 20] [--no-load]

    # the broker-restart row of the replay buffer, 20 times under load:
    python benchmarks/fault_row_loop.py --file tests/assembly/test_replay_buffer_released.py \
        --row broker_restart --times 20

One pytest session runs ``FILE -k ROW`` TIMES times (the
``repeat_items`` plugin in this folder: one broker and one fault-free reference run for all
of them), while, unless ``--no-load``, the fast suite (``-m "not kafka and not slow and not
contract"``) runs over and over in a process of its own, as CI's other jobs and a busy
machine would load it. The fault table of every repetition goes to stdout with the pass
count and the wall times (median, max); pytest's own output goes to
``{--log-dir}/rows.log``, the load job's to ``{--log-dir}/load.log``. A row that prints
``... stall: X s ...`` lines (the broker-restart row: from the broker back to the next
release) has them listed with their median and max. Exit code 0 when every repetition
passed, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAST_SUITE = ["-m", "not kafka and not slow and not contract"]
# pytest -rA's summary lines ("PASSED tests/...::name[r3]"): the verbose lines are split
# when a row prints (-s)
RESULT = re.compile(r"^(PASSED|FAILED|ERROR) tests/\S+\.py::(\S+)\[r(\d+)\]$", re.M)
STALL = re.compile(r"stall: ([0-9.]+) s")


def start_load(log_dir: Path) -> subprocess.Popen[bytes]:
    """The fast suite in a loop, in its own process group (stopped as a whole)."""
    fast = " ".join(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(repr, FAST_SUITE)]
    )
    with (log_dir / "load.log").open("wb") as log:
        return subprocess.Popen(
            ["bash", "-c", f"while true; do {fast}; done"],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_rows(test_file: str, row: str, times: int, log_dir: Path) -> tuple[int, str]:
    env = {
        **os.environ,
        "ROLLOUTBUS_REPEAT": str(times),
        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "repeat_items"]
    argv += ["-rA", "-v", "-s", test_file, "-k", row]
    with (log_dir / "rows.log").open("wb") as log:
        code = subprocess.call(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    return code, (log_dir / "rows.log").read_text(errors="replace")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", default="tests/faults/test_faults.py", help="the test file")
    parser.add_argument("--row", default="rebalance", help="pytest -k expression of the row")
    parser.add_argument("--times", type=int, default=20)
    parser.add_argument("--no-load", action="store_true", help="no second job")
    parser.add_argument("--log-dir", type=Path, default=Path("var/fault_row_loop"))
    args = parser.parse_args()
    if args.times < 1:
        parser.error("--times must be at least 1")
    args.log_dir.mkdir(parents=True, exist_ok=True)
    load = None if args.no_load else start_load(args.log_dir)
    started = time.monotonic()
    try:
        code, output = run_rows(args.file, args.row, args.times, args.log_dir)
    finally:
        if load is not None:
            os.killpg(load.pid, signal.SIGTERM)
            load.wait()
    return report(output, args.times, time.monotonic() - started, code)


def report(output: str, times: int, total_s: float, code: int) -> int:
    results = {int(index): status for status, _, index in RESULT.findall(output)}
    passed = sum(status == "PASSED" for status in results.values())
    table = (
        output[output.find("fault injection") :].splitlines() if "fault injection" in output else []
    )
    rows = [line for line in table[2:] if re.match(r"^\S.*\s\d+$", line)]
    walls = [float(line.split()[-1]) for line in rows if not line.startswith("no fault")]
    for line in table:
        print(line)
    print(f"\n{passed} of {times} passed ({len(results)} ran), pytest exit code {code}")
    if walls:
        print(f"row wall time: median {statistics.median(walls):.0f} s, max {max(walls):.0f} s")
    stalls = [float(s) for s in STALL.findall(output)]
    if stalls:
        listed = ", ".join(f"{s:.1f}" for s in stalls)
        print(
            f"stalls (s): {listed}; median {statistics.median(stalls):.1f}, max {max(stalls):.1f}"
        )
    print(f"total {total_s / 60:.1f} min")
    return 0 if passed == times else 1


if __name__ == "__main__":
    sys.exit(main())
