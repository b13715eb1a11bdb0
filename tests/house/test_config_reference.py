"""docs/reference/configuration.md (every key) is what ops/config_reference.py writes from
the config model: every key, its type, its default and its description, none missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

from rolloutbus.config import Config, key_tree
from tests.source_tree import ROOT

SCRIPT = ROOT / "ops" / "config_reference.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for name, node in tree.items():
        dotted = f"{prefix}{name}"
        keys += _leaves(node, dotted + ".") if isinstance(node, dict) else [dotted]
    return keys


def test_the_page_is_what_the_script_writes():
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_every_key_has_a_row_with_a_description():
    rows = {
        cells[0].lstrip("| ").strip("`"): cells
        for line in _script().reference().splitlines()
        if line.startswith("| `") and len(cells := line.split(" | ")) == 4
    }
    keys = _leaves(key_tree(Config))
    assert sorted(set(keys) - set(rows)) == [], "keys with no row"
    assert sorted(set(rows) - set(keys)) == [], "rows of no key"
    assert [k for k in keys if not rows[k][3].strip(" |")] == [], "keys with no description"


def test_a_stale_page_is_refused(tmp_path, monkeypatch):
    script = _script()
    current = script.PAGE.read_text()
    stale = current.replace('`"rolloutbus-sessions"`', '`"an old default"`', 1)
    assert stale != current
    page = tmp_path / "configuration.md"
    page.write_text(stale)
    monkeypatch.setattr(script, "PAGE", page)
    assert script.main(["--check"]) == 1
    assert script.main([]) == 0
    assert script.main(["--check"]) == 0
    assert page.read_text() == current
