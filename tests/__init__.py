"""The test suite, a package: test modules import the shared helpers by their package path
(``tests.helpers``, ``tests.pipeline``, ``tests.builders``, ...), not by a bare name that
only resolves while pytest happens to have put this folder on ``sys.path``.

Folders: ``plugins/`` (agent loops, tools, reward functions and a vLLM logits processor that
the processes under test load by module name, as a user's own code), ``programs/`` (scripts
the tests run in a subprocess, some in a side environment), ``data/`` (frozen records and
verl's config files); pytest fixtures live in ``conftest.py``.

Still by bare name: the fault harness (``faults_harness.py`` with ``test_faults*.py``, being
split into ``faults/`` on another branch) and the benchmarks that put this folder on
``sys.path``; the harness also names ``tests/fixtures``, the old name of ``plugins/``, kept
as a link to it until the harness says ``plugins``. Until they move to package paths, this
folder stays importable and each shared helper module answers to its bare name as the very
same module object (a helper imported twice would hold its state twice);
``tests/test_layout.py`` lists who may still import by bare name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from pathlib import Path
from types import ModuleType

# the shared helper modules the fault harness and the benchmarks import by bare name
BARE_NAME_HELPERS = frozenset({"cluster", "helpers", "pipeline", "synthetic"})


class _SameModule(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import helpers`` gives the ``tests.helpers`` module itself (imported on first use)."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in BARE_NAME_HELPERS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(f"{__name__}.{spec.name}")

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed, as tests.<name>


if not any(isinstance(finder, _SameModule) for finder in sys.meta_path):
    sys.meta_path.insert(0, _SameModule())
_here = str(Path(__file__).parent)
if _here not in sys.path:
    sys.path.append(_here)  # after everything installed: never shadows a real package
