"""One importer for plug-ins named by a path: agent loops, tools, tool parsers, reward functions.

Accepted forms:

* ``package.module.Name`` — the longest importable prefix is the module, the rest are
  attributes (so nested classes work: ``package.module.Outer.Inner``);
* ``package.module:Name`` — the module and the attribute path, split explicitly;
* ``path/to/file.py:Name`` — a Python file loaded by path (relative to the current
  directory), then the attribute.

``import_module`` loads a whole module by dotted name or ``.py`` file (function tools).
Every failure is one error of the caller's choice (``AgentLoopError`` by default) that
names what was being loaded, the path, and what failed.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from rolloutbus.errors import AgentLoopError, RolloutBusError

__all__ = ["import_module", "import_object"]

Kind = Literal["any", "callable", "class"]


def import_object(
    path: str,
    *,
    what: str,
    kind: Kind = "any",
    error: type[RolloutBusError] = AgentLoopError,
) -> Any:
    """The object that ``path`` names; ``kind`` checks it is callable or a class.

    ``what`` says what is being loaded, for the error: ``"agent loop 'my_loop'"``.
    """
    if not isinstance(path, str) or not path.strip():
        raise error(f"cannot load {what}: expected a path like 'package.module.Name', got {path!r}")
    module_part, sep, attr_part = path.rpartition(":")
    if sep:
        if not module_part or not attr_part:
            raise error(
                f"cannot load {what} from {path!r}: expected 'module:Name' or 'file.py:Name'"
            )
        module = _load_module(module_part, path, what, error)
        obj = _get_attributes(module, attr_part.split("."), path, what, error)
    elif path.endswith(".py"):
        raise error(
            f"cannot load {what} from {path!r}: a file path needs the object's name, "
            f"as in '{path}:Name'"
        )
    else:
        obj = _import_dotted(path, what, error)
    _check_kind(obj, kind, path, what, error)
    return obj


def import_module(
    path: str, *, what: str, error: type[RolloutBusError] = AgentLoopError
) -> ModuleType:
    """A module by dotted name, or a ``.py`` file by path (loaded once per process)."""
    return _load_module(path, path, what, error)


def _load_module(
    module_path: str, path: str, what: str, error: type[RolloutBusError]
) -> ModuleType:
    """``module_path`` is the module part of ``path``, which the error message quotes whole."""
    if module_path.endswith(".py"):
        return _import_file(Path(module_path), path, what, error)
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as exc:
        if _is_missing(module_path, exc):
            raise error(f"cannot load {what} from {path!r}: no module named {exc.name!r}") from exc
        raise _import_failed(module_path, path, what, error, exc) from exc
    except Exception as exc:  # the plug-in's own code failed at import; re-raised with context
        raise _import_failed(module_path, path, what, error, exc) from exc


def _import_dotted(path: str, what: str, error: type[RolloutBusError]) -> Any:
    """``a.b.C.D``: try ``a.b.C``, then ``a.b``, then ``a`` as the module."""
    parts = path.split(".")
    if len(parts) < 2 or not all(parts):
        raise error(
            f"cannot load {what} from {path!r}: expected 'package.module.Name' or 'module:Name'"
        )
    missing: ModuleNotFoundError | None = None
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if _is_missing(module_name, exc):
                missing = exc
                continue  # a shorter prefix may be the module, the rest attributes
            raise _import_failed(module_name, path, what, error, exc) from exc
        except Exception as exc:  # the plug-in's own code failed at import; re-raised with context
            raise _import_failed(module_name, path, what, error, exc) from exc
        if missing is not None and hasattr(module, "__path__") and not hasattr(module, parts[cut]):
            # 'pkg.typo.Cls' in a package: "no module pkg.typo" says more than "no attribute"
            raise error(
                f"cannot load {what} from {path!r}: no module named {missing.name!r}"
            ) from missing
        return _get_attributes(module, parts[cut:], path, what, error)
    name = missing.name if missing is not None else parts[0]
    raise error(f"cannot load {what} from {path!r}: no module named {name!r}") from missing


def _import_failed(
    module_name: str, path: str, what: str, error: type[RolloutBusError], exc: BaseException
) -> RolloutBusError:
    return error(
        f"cannot load {what} from {path!r}: importing module {module_name!r} failed: "
        f"{type(exc).__name__}: {exc}"
    )


def _is_missing(module_name: str, exc: ModuleNotFoundError) -> bool:
    """True when ``module_name`` itself (or a parent package) is absent, not one of its imports."""
    name = exc.name
    if not name:
        return False
    return module_name == name or module_name.startswith(name + ".")


def _import_file(file: Path, path: str, what: str, error: type[RolloutBusError]) -> ModuleType:
    if not file.is_file():
        raise error(f"cannot load {what} from {path!r}: file {str(file)!r} not found")
    resolved = file.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"rolloutbus_plugin_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise error(
            f"cannot load {what} from {path!r}: {str(file)!r} is not a loadable Python file"
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec, so dataclasses and pickling can find it
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # the plug-in file failed to run; re-raised with context
        del sys.modules[name]
        raise error(
            f"cannot load {what} from {path!r}: executing {str(file)!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    return module


def _get_attributes(
    module: ModuleType, names: list[str], path: str, what: str, error: type[RolloutBusError]
) -> Any:
    obj: Any = module
    owner = module.__name__
    for name in names:
        try:
            obj = getattr(obj, name)
        except AttributeError as exc:
            raise error(
                f"cannot load {what} from {path!r}: {owner!r} has no attribute {name!r}"
            ) from exc
        owner = f"{owner}.{name}"
    return obj


def _check_kind(obj: Any, kind: Kind, path: str, what: str, error: type[RolloutBusError]) -> None:
    if kind == "class" and not inspect.isclass(obj):
        raise error(f"cannot load {what} from {path!r}: it is a {type(obj).__name__}, not a class")
    if kind == "callable" and not callable(obj):
        raise error(f"cannot load {what} from {path!r}: a {type(obj).__name__} is not callable")
