"""Each package's public surface is deliberate and complete (httpx's exported-members test)."""

from __future__ import annotations

import importlib
import inspect

import pytest

PACKAGES = [
    "rolloutbus.schemas",
    "rolloutbus.producers",
    "rolloutbus.consumers",
    "rolloutbus.consumers.training",
    "rolloutbus.streams",
    "rolloutbus.streams.agent_loop",
    "rolloutbus.streams.inference",
    "rolloutbus.streams.sessions",
    "rolloutbus.streams.assembly",
    "rolloutbus.streams.gateway",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_all_names_resolve_and_every_public_import_is_exported(name):
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert all(hasattr(module, n) for n in exported)
    public = {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not inspect.ismodule(v) and n != "annotations"
    }
    assert public <= exported, f"{name} imports names it does not export: {public - exported}"


def test_design_public_api_paths():
    from rolloutbus.consumers import TrainerClient  # noqa: F401
    from rolloutbus.schemas import AgentLoopMetrics, AgentLoopOutput, TokenOutput  # noqa: F401
    from rolloutbus.streams.agent_loop import (  # noqa: F401
        AgentLoopBase,
        SingleTurnAgentLoop,
        ToolAgentLoop,
        register,
    )
