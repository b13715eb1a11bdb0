"""Agent-loop registry and routing by ``agent_name`` (verl's ``@register`` + YAML list).

The registry is a process-local dict, as in verl: ``{name: {"_target_": "module.qualname",
**constructor_kwargs}}``; ``_target_`` takes any form ``rolloutbus.streams.plugins`` accepts
(``module.qualname``, ``module:qualname``, ``file.py:qualname``). Built-in loops register
themselves when ``rolloutbus.streams.agent_loop`` is imported; custom loops come from
``@register`` or from the YAML file named by ``rollout.agent.agent_loop_config_path``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rolloutbus.errors import AgentLoopError, UnknownAgentLoopError
from rolloutbus.streams.plugins import import_object

logger = logging.getLogger(__name__)

_agent_loop_registry: dict[str, dict[str, Any]] = {}

_PACKAGE_ROOT = (
    Path(__file__).resolve().parents[2]
)  # the repo root (verl resolves against its root)

T = TypeVar("T", bound=type)


def register(agent_name: str) -> Callable[[T], T]:
    """Class decorator: route rows with ``agent_name`` to this loop class."""

    def decorator(subclass: T) -> T:
        _agent_loop_registry[agent_name] = {
            "_target_": f"{subclass.__module__}.{subclass.__qualname__}"
        }
        return subclass

    return decorator


def registered_agent_loops() -> list[str]:
    return sorted(_agent_loop_registry)


def load_agent_loop_config(path: str | Path) -> list[str]:
    """Register every ``{name, _target_, kwargs...}`` entry of a YAML list; return the names.

    A relative path resolves against the current directory first, then the repo root
    (verl: the CWD, then the verl root). Extra keys of an entry become constructor kwargs.
    """
    resolved = _resolve_config_path(Path(path))
    try:
        entries = yaml.safe_load(resolved.read_text()) or []
    except yaml.YAMLError as exc:
        raise AgentLoopError(f"agent loop config {resolved} is not valid YAML: {exc}") from exc
    if not isinstance(entries, list):
        raise AgentLoopError(
            f"agent loop config {resolved} must be a YAML list of {{name, _target_}}"
        )
    names = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or "name" not in entry or "_target_" not in entry:
            raise AgentLoopError(
                f"agent loop config {resolved}, entry {i}: needs 'name' and '_target_'"
            )
        spec = {k: v for k, v in entry.items() if k != "name"}
        _agent_loop_registry[str(entry["name"])] = spec
        names.append(str(entry["name"]))
    return names


def _resolve_config_path(path: Path) -> Path:
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, _PACKAGE_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise AgentLoopError(
        f"agent loop config not found: {path} (looked at {', '.join(map(str, candidates))})"
    )


_MISSING = object()


def resolve_agent_name(row: Mapping[str, Any], default: str) -> Any:
    """The row's top-level ``agent_name`` if the key is present (even when null), else ``default``.

    verl fills the default only when the column is absent; ``agent_name: null`` is kept
    and fails at lookup, so a broken mixed dataset is loud rather than silently rerouted.
    """
    value = row.get("agent_name", _MISSING)
    return default if value is _MISSING else value


def create_agent_loop(agent_name: Any, **ctor_kwargs: Any) -> Any:
    """A fresh loop instance for one trajectory (verl hydra-instantiates one per trajectory)."""
    registered = ", ".join(registered_agent_loops()) or "none"
    if agent_name is None:
        raise UnknownAgentLoopError(
            "the row's agent_name is null; an explicit null does not fall back to "
            "agent.default_agent_loop (as in verl): name a loop or drop the field; registered: "
            f"{registered}"
        )
    if agent_name not in _agent_loop_registry:
        raise UnknownAgentLoopError(
            f"agent loop {agent_name!r} is not registered; registered: {registered}"
        )
    spec = dict(_agent_loop_registry[agent_name])
    cls = import_object(spec.pop("_target_"), what=f"agent loop {agent_name!r}", kind="callable")
    return cls(**{**spec, **ctor_kwargs})
