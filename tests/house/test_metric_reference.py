"""docs/reference/metrics.md is what ops/metric_reference.py writes from the code that
declares each series: every metric set of the package is on it, and every series has a unit."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from types import ModuleType

from tests.source_tree import ROOT

SCRIPT = ROOT / "ops" / "metric_reference.py"
PACKAGE_DIRS = ("rolloutbus", "streams", "consumers", "producers", "replica", "schemas")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("metric_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _metric_set_classes() -> set[str]:
    """Every class of the package that extends PerRegistry (a process's metric set)."""
    found = set()
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id == "PerRegistry" for b in node.bases
                ):
                    found.add(node.name)
    return found


def test_the_page_is_what_the_script_writes():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_every_metric_set_of_the_package_is_listed():
    listed = {getattr(s.register, "__name__", "") for s in _script().SETS}
    assert sorted(_metric_set_classes() - listed) == []


def test_every_series_has_a_unit_and_a_meaning():
    script = _script()
    missing = [
        s.name
        for metric_set in script.SETS
        for s in script.series_of(metric_set)
        if not (s.unit and s.meaning)
    ]
    assert missing == [], "help texts must end in '; <unit>' (rolloutbus/metrics.py)"


def test_a_stale_page_is_refused(tmp_path, monkeypatch):
    script = _script()
    page = tmp_path / "metrics.md"
    page.write_text(script.page().replace("| counter |", "| gauge |", 1))
    monkeypatch.setattr(script, "PAGE", page)
    assert script.main(["--check"]) == 1
