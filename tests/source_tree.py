"""The package's source as files: every module of ``rolloutbus`` by its dotted name, and what
each imports (read with ``ast``, so imports inside functions count too). Used by the layout
and code-size tests; nothing here imports the package itself.
"""

from __future__ import annotations

import ast
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PLUGINS = TESTS / "plugins"  # what the tested processes load by module name
PROGRAMS = TESTS / "programs"  # scripts the tests run in a subprocess
TEST_DATA = TESTS / "data"  # frozen samples and verl's own files


@cache
def package_dirs() -> dict[str, Path]:
    """Import-package prefix → folder, as pyproject.toml's [tool.setuptools.package-dir]
    maps them, longest prefix first (so ``rolloutbus.schemas`` wins over ``rolloutbus``)."""
    with (ROOT / "pyproject.toml").open("rb") as handle:
        mapping = tomllib.load(handle)["tool"]["setuptools"]["package-dir"]
    dirs = {package: ROOT / folder for package, folder in mapping.items()}
    return dict(sorted(dirs.items(), key=lambda item: -len(item[0])))


@cache
def modules() -> dict[str, Path]:
    """Every module of the package: dotted name → file (a package is its ``__init__.py``)."""
    found: dict[str, Path] = {}
    dirs = package_dirs()
    for package, folder in dirs.items():
        for path in folder.rglob("*.py"):
            owner = _owning_package(path, dirs)
            if owner != package:
                continue  # a folder mapped to a subpackage of its own
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _owning_package(path: Path, dirs: dict[str, Path]) -> str:
    return next(package for package, folder in dirs.items() if path.is_relative_to(folder))


def imports_of(name: str) -> set[str]:
    """The package's modules that module ``name`` imports, lazily or not (itself excluded)."""
    path = modules()[name]
    known = set(modules())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
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
    return {target for target in targets if target in known and target != name}


def import_graph() -> dict[str, set[str]]:
    return {name: imports_of(name) for name in modules()}
