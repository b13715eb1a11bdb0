"""Each package's public surface is deliberate and complete (httpx's exported-members test).

Every package of ``rolloutbus`` is found from the source (``tests/source_tree.py``), so a new
package is checked without anyone adding it here: it must say what it exports (``__all__``,
empty when its modules are imported directly), every exported name must resolve (lazy
re-exports included), and every public name it imports must be exported.
"""

from __future__ import annotations
import __future__

import importlib
import inspect

import pytest

from tests.source_tree import modules

PACKAGES = sorted(name for name, path in modules().items() if path.name == "__init__.py")


def test_every_package_is_found():
    expected = {
        "rolloutbus",
        "rolloutbus.cli",
        "rolloutbus.consumers",
        "rolloutbus.consumers.training",
        "rolloutbus.kafka",
        "rolloutbus.models",
        "rolloutbus.monitoring",
        "rolloutbus.producers",
        "rolloutbus.replica",
        "rolloutbus.schemas",
        "rolloutbus.streams",
        "rolloutbus.streams.agent_loop",
        "rolloutbus.streams.assembly",
        "rolloutbus.streams.gateway",
        "rolloutbus.streams.inference",
        "rolloutbus.streams.reward",
        "rolloutbus.streams.sessions",
    }
    assert expected <= set(PACKAGES)


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_resolve_and_every_public_import_is_exported(name):
    module = importlib.import_module(name)
    assert "__all__" in vars(module), f"{name} does not say what it exports (__all__)"
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__), f"{name} exports a name twice"
    missing = {n for n in exported if not hasattr(module, n)}
    assert not missing, f"{name} exports names it does not have: {missing}"
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not inspect.ismodule(v) and _from_here(v, name)
    }
    assert public <= exported, f"{name} has public names it does not export: {public - exported}"


def _from_here(value: object, package: str) -> bool:
    """Whether ``value`` belongs to ``package``'s surface: defined in it or one of its
    modules, or a constant (which says nowhere where it came from). A class or function of
    another package (``typing.Any``, a foundation error the package's code raises) is a tool
    the package uses, not part of what it offers."""
    if isinstance(value, __future__._Feature):  # from __future__ import annotations
        return False
    origin = getattr(value, "__module__", None)
    if origin is None:
        return True
    return origin == package or origin.startswith(package + ".")


def test_design_public_api_paths():
    from rolloutbus.consumers import TrainerClient  # noqa: F401
    from rolloutbus.models import load_causal_lm, load_tokenizer  # noqa: F401
    from rolloutbus.schemas import AgentLoopMetrics, AgentLoopOutput, TokenOutput  # noqa: F401
    from rolloutbus.streams.agent_loop import (  # noqa: F401
        AgentLoopBase,
        SingleTurnAgentLoop,
        ToolAgentLoop,
        register,
    )
