"""The layout CONTRIBUTING.md describes: a thin package root and no import cycles.

Static (reads source with ``ast``), so it checks lazy imports inside functions too: a cycle
hidden in a function body still ties two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# import-package prefix → folder, as pyproject.toml's [tool.setuptools.package-dir] maps them
PACKAGE_DIRS = {
    "rolloutbus.schemas": ROOT / "schemas",
    "rolloutbus.streams": ROOT / "streams",
    "rolloutbus.producers": ROOT / "producers",
    "rolloutbus.consumers": ROOT / "consumers",
    "rolloutbus": ROOT / "rolloutbus",
}
# config_loading (file, env vars and key=value overrides -> one tree, through OmegaConf) and
# verl_keys (what each key of a verl trainer config means here) are the config's foundation:
# config imports them, they import only errors
ROOT_MODULES = {
    "__init__",
    "__main__",
    "config",
    "config_loading",
    "verl_keys",
    "errors",
    "topics",
    "metrics",
    "demo",
}
# the Kafka boundary, the embedded replica (a second service), the command line, and
# monitoring (the lag exporter, top, inspect: tools that read every layer below the CLI)
ROOT_PACKAGES = {"kafka", "replica", "cli", "monitoring"}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imports(path: Path, name: str, is_package: bool, known: set[str]) -> set[str]:
    targets: set[str] = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    return {t for t in targets if t in known and t != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imports(path, name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _package_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Imports between modules, ignoring a package ``__init__`` re-exporting its own members."""
    return {
        src: {dst for dst in dsts if not dst.startswith(src + ".")} for src, dsts in graph.items()
    }


def test_package_root_holds_only_the_foundation_and_entry_points():
    modules = {p.stem for p in (ROOT / "rolloutbus").glob("*.py")}
    assert modules == ROOT_MODULES, f"unexpected modules in rolloutbus/: {modules - ROOT_MODULES}"
    packages = {p.parent.name for p in (ROOT / "rolloutbus").glob("*/__init__.py")}
    assert packages == ROOT_PACKAGES, f"unexpected packages in rolloutbus/: {packages}"


def test_no_module_imports_in_a_circle():
    graph = _package_edges(_graph())
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]


def test_foundation_does_not_import_upward():
    graph = _graph()
    for name in ("rolloutbus.errors", "rolloutbus.config", "rolloutbus.topics"):
        upward = {
            t
            for t in graph[name]
            if t.startswith(
                (
                    "rolloutbus.streams",
                    "rolloutbus.producers",
                    "rolloutbus.consumers",
                    "rolloutbus.kafka",
                    "rolloutbus.replica",
                    "rolloutbus.cli",
                    "rolloutbus.demo",
                )
            )
        }
        assert not upward, f"{name} imports {upward}"


def test_nothing_imports_the_entry_points():
    graph = _graph()
    importers = {
        src
        for src, dsts in graph.items()
        if dsts & {"rolloutbus.cli", "rolloutbus.demo"}
        and src not in {"rolloutbus.__main__"}
        and not src.startswith("rolloutbus.cli")
    }
    assert not importers, f"modules importing the CLI or demo: {importers}"
