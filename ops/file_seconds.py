"""Seconds per test file from a pytest JUnit XML report, as JSON on stdout, for the order
in which pytest-xdist's workers take files (``tests/file_seconds.json``, read by
``tests/conftest.py``: the longest first).

    python -m pytest --junitxml=/tmp/junit.xml ...
    python ops/file_seconds.py /tmp/junit.xml > tests/file_seconds.json
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def file_seconds(junit_xml: str) -> dict[str, float]:
    """``tests/test_x.py`` → the seconds its test cases took (setup and teardown included,
    as JUnit reports them), rounded to a second."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # classname: tests.test_x, tests.contract.test_y, or either with .TestClass after it
        parts = case.get("classname", "").split(".")
        module = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
        if module is None:
            continue
        seconds["/".join(parts[: module + 1]) + ".py"] += float(case.get("time", 0.0))
    return {path: round(s) for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit_xml", help="a report written by pytest --junitxml")
    args = parser.parse_args()
    try:
        found = file_seconds(args.junit_xml)
    except (OSError, ET.ParseError) as exc:
        print(f"file_seconds: cannot read {args.junit_xml}: {exc}", file=sys.stderr)
        return 1
    json.dump(found, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
