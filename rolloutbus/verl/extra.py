"""What the plug-ins need from ``pip install rolloutbus[verl]``, and the error that says so.

The package imports without verl: only a plug-in that verl itself loads (the agent-loop
managers) needs verl's ``DataProto`` and ``TensorDict``, and it asks for them here.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from rolloutbus.errors import RolloutBusError

__all__ = ["INSTALL_HINT", "VerlNotInstalledError", "require_verl"]

INSTALL_HINT = "pip install rolloutbus[verl]"


class VerlNotInstalledError(RolloutBusError, ImportError):
    """A ``rolloutbus.verl`` plug-in was used where verl (or what it needs) is missing."""


def require_verl(module: str, *, what: str) -> ModuleType:
    """``module`` (``verl.protocol``, ``tensordict``, ...), or VerlNotInstalledError naming
    ``what`` needed it and the command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise VerlNotInstalledError(
            f"{what} needs {module!r}, which is not installed ({exc}): {INSTALL_HINT} "
            "(verl 0.9.1 and what it needs; docs/verl-trainer.md)"
        ) from exc
