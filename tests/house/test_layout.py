"""The layout CONTRIBUTING.md describes: the rooms of the package, the direction of imports
between them, no import cycles, and nothing loaded eagerly that a room does not need.

Static (reads source with ``ast``, ``tests/source_tree.py``), so it checks lazy imports
inside functions too: an import hidden in a function body still ties two modules together.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.source_tree import ROOT, import_graph, modules, package_dirs

# The modules at the top of rolloutbus/: the foundation (config_loading turns a file, env vars
# and key=value overrides into one tree through OmegaConf; verl_keys says what each key of a
# verl trainer config means here; config_rollout and config_training hold the sections
# config joins into one Config) and the entry points.
ROOT_MODULES = {
    "__init__",
    "__main__",
    "config",
    "config_rollout",
    "config_training",
    "config_loading",
    "verl_keys",
    "errors",
    "runtime",
    "topics",
    "metrics",
    "progress",
    "demo",
}
# The packages in rolloutbus/: the Kafka boundary, models and tokenizers, the command line,
# monitoring (the lag exporter, top, inspect: tools that read every layer below the CLI),
# verl (the plug-ins verl's own trainer loads: they publish and consume like a user), and
# broker (the embedded Kafka broker: only the entry points and tests start one). The
# replica, a second service, has a room of its own (the top-level replica/ folder).
ROOT_PACKAGES = {"kafka", "broker", "models", "cli", "monitoring", "verl"}
# The folders mapped into the package ([tool.setuptools.package-dir]): the data flow, and the
# replica.
MAPPED_ROOMS = {"schemas", "streams", "producers", "consumers", "replica"}

FOUNDATION = {
    "runtime",
    "errors",
    "verl_keys",
    "config_loading",
    "config_rollout",
    "config_training",
    "config",
    "topics",
    "metrics",
    "progress",
}
# CONTRIBUTING.md's "Direction of imports", room by room: what each room may import besides
# itself. A room is a module of the foundation, or a package (streams and consumers by
# subpackage). cli, demo and __main__ import anything (lazily), and nothing imports them.
ENTRY_POINTS = {"cli", "demo", "__main__"}
ALLOWED: dict[str, set[str]] = {
    "runtime": set(),
    "errors": set(),
    "verl_keys": {"errors"},
    "config_loading": {"errors", "verl_keys"},
    "config_rollout": {"errors", "verl_keys", "config_loading"},
    "config_training": {"errors", "verl_keys", "config_loading", "config_rollout"},
    "config": {"errors", "verl_keys", "config_loading", "config_rollout", "config_training"},
    "topics": {"errors", "verl_keys", "config_loading", "config"},
    "metrics": {"errors", "verl_keys", "config_loading", "config"},
    "progress": set(),
    "rolloutbus": {"errors"},  # the package's __init__
    "schemas": FOUNDATION,
    "kafka": FOUNDATION | {"schemas"},
    "broker": FOUNDATION | {"kafka"},  # a client never imports it: no room lists it
    "models": FOUNDATION,
    "replica": FOUNDATION | {"schemas", "models"},
    "streams": {"runtime", "streams.inference"},  # the package's __init__: lazy re-exports
    "streams.plugins": FOUNDATION,
    "streams.token_stream": FOUNDATION | {"schemas"},
    "streams.agent_loop": FOUNDATION | {"schemas", "streams.plugins"},
    "streams.reward": FOUNDATION | {"schemas", "streams.plugins"},
    "streams.inference": FOUNDATION | {"schemas", "kafka", "streams.plugins"},
    "streams.assembly": FOUNDATION | {"schemas", "kafka", "streams.token_stream"},
    "streams.sessions": FOUNDATION
    | {"schemas", "kafka", "models"}
    | {f"streams.{room}" for room in ("agent_loop", "reward", "inference", "token_stream")},
    "streams.gateway": FOUNDATION
    | {"schemas", "kafka", "models"}
    | {f"streams.{room}" for room in ("agent_loop", "reward", "inference", "token_stream")}
    | {"streams.sessions"},
    "producers": FOUNDATION
    | {"schemas", "kafka", "models", "streams.agent_loop", "streams.reward"},
    "consumers": FOUNDATION | {"schemas", "kafka", "streams.assembly"},
    "consumers.training": FOUNDATION | {"schemas", "kafka", "models", "consumers"},
    "monitoring": FOUNDATION | {"schemas", "kafka", "models", "producers", "streams.agent_loop"},
    "verl": FOUNDATION | {"schemas", "kafka", "models", "producers", "consumers"},
}
# streams is a room per subpackage; consumers has one subroom, the trainer
CONSUMER_SUBROOMS = {"training"}

# What importing the pure fold may not load: the fold folds events in memory.
CLIENT_LIBRARIES = ("httpx", "aiohttp", "confluent_kafka", "aiokafka", "faust", "torch")


def room_of(module: str) -> str:
    """The room of a dotted module name, as ALLOWED names them."""
    parts = module.split(".")
    if len(parts) == 1:
        return "rolloutbus"
    top = parts[1]
    if top == "streams" and len(parts) > 2:
        return f"streams.{parts[2]}"
    if top == "consumers" and len(parts) > 2 and parts[2] in CONSUMER_SUBROOMS:
        return f"consumers.{parts[2]}"
    return top


def room_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) → the module imports behind it."""
    edges: dict[tuple[str, str], list[str]] = {}
    for src, dsts in graph.items():
        for dst in dsts:
            pair = (room_of(src), room_of(dst))
            if pair[0] != pair[1]:
                edges.setdefault(pair, []).append(f"{src} -> {dst}")
    return edges


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for (src, dst), why in sorted(room_edges(graph).items()):
        if src in ENTRY_POINTS:
            continue
        if dst in ENTRY_POINTS or dst not in ALLOWED.get(src, set()):
            found.append(f"{src} may not import {dst}: {why[0]}")
    return found


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


# ---- the rooms -----------------------------------------------------------------------


def test_package_root_holds_only_the_foundation_and_entry_points():
    modules_here = {p.stem for p in (ROOT / "rolloutbus").glob("*.py")}
    assert modules_here == ROOT_MODULES, f"unexpected in rolloutbus/: {modules_here ^ ROOT_MODULES}"
    packages = {p.parent.name for p in (ROOT / "rolloutbus").glob("*/__init__.py")}
    assert packages == ROOT_PACKAGES, f"unexpected packages in rolloutbus/: {packages}"


def test_the_mapped_rooms_are_the_data_flow_and_the_replica():
    mapped = {name.removeprefix("rolloutbus.") for name in package_dirs() if name != "rolloutbus"}
    assert mapped == MAPPED_ROOMS
    assert all(package_dirs()[f"rolloutbus.{room}"] == ROOT / room for room in MAPPED_ROOMS)


def test_every_room_is_in_the_table():
    rooms = {room_of(name) for name in modules()} - ENTRY_POINTS
    assert rooms == set(ALLOWED), f"rooms missing from ALLOWED: {rooms ^ set(ALLOWED)}"


# ---- the direction of imports --------------------------------------------------------


def test_imports_follow_the_direction_contributing_draws():
    bad = forbidden_edges(import_graph())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (
            "rolloutbus.kafka.admin",
            "rolloutbus.replica.engine",
        ),  # kafka and replica: not each other
        ("rolloutbus.replica.server", "rolloutbus.kafka.clients"),
        ("rolloutbus.schemas.turns", "rolloutbus.streams.token_stream"),  # schemas: foundation only
        ("rolloutbus.streams.sessions.worker", "rolloutbus.replica.engine"),  # tokenizer: models
        ("rolloutbus.consumers.training.policy", "rolloutbus.replica.engine"),
        ("rolloutbus.producers.row_checks", "rolloutbus.cli.common"),  # nothing imports the CLI
        ("rolloutbus.errors", "rolloutbus.config"),  # the foundation's own order
        ("rolloutbus.models.tokenizers", "rolloutbus.schemas.turns"),
    ],
)
def test_a_planted_import_against_the_direction_is_found(src, dst):
    graph = {name: set(targets) for name, targets in import_graph().items()}
    graph[src].add(dst)
    assert any(line.startswith(f"{room_of(src)} may not import") for line in forbidden_edges(graph))


def test_no_module_imports_in_a_circle():
    cycle = _find_cycle(_package_edges(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]


def test_nothing_imports_the_entry_points():
    importers = {
        src
        for src, dsts in import_graph().items()
        if {room_of(dst) for dst in dsts} & ENTRY_POINTS and room_of(src) not in ENTRY_POINTS
    }
    assert not importers, f"modules importing the CLI or demo: {importers}"


# ---- nothing loaded that a room does not need ------------------------------------------


def test_importing_the_pure_fold_loads_no_client_library():
    """``streams/__init__`` and ``streams.assembly`` re-export lazily: the fold that turns
    events into trajectories loads neither the inference client nor Kafka nor torch."""
    code = (
        "import sys\n"
        "import rolloutbus.streams.assembly.session_fold\n"
        "import rolloutbus.streams.assembly.partition_fold\n"
        f"print(','.join(m for m in {CLIENT_LIBRARIES!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "", f"importing the fold loaded {out.stdout.strip()}"


def test_replay_and_the_trainer_client_load_no_torch():
    """``consumers/__init__`` re-exports lazily: ``rolloutbus replay`` (``log_replay``) and
    the trainer client load torch only when they convert to tensors (its import costs
    about a second of CPU, which a replay of a short log would mostly spend on it)."""
    code = (
        "import sys\n"
        "import rolloutbus.consumers.log_replay, rolloutbus.consumers.report\n"
        "import rolloutbus.consumers.client\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False", "importing replay or the trainer client loaded torch"


def test_the_lazy_re_exports_still_resolve():
    import rolloutbus.consumers as consumers
    import rolloutbus.models as models
    import rolloutbus.streams as streams
    import rolloutbus.streams.assembly as assembly

    assert streams.LLMClient.__module__ == "rolloutbus.streams.inference.llm_client"
    assert assembly.ReleasedRecord.__module__ == "rolloutbus.streams.assembly.released"
    assert models.load_tokenizer.__module__ == "rolloutbus.models.tokenizers"
    assert consumers.to_padded.__module__ == "rolloutbus.consumers.tensors"
    with pytest.raises(AttributeError):
        streams.not_a_name  # noqa: B018


# ---- the test suite's own imports ------------------------------------------------------


def _test_side_names() -> set[str]:
    """The names the modules and packages directly in tests/ would answer to if tests/ were
    on ``sys.path`` (``helpers``, ``pipeline``, ``faults``, ...)."""
    tests = ROOT / "tests"
    modules_here = {path.stem for path in tests.glob("*.py")}
    packages_here = {path.parent.name for path in tests.glob("*/__init__.py")}
    return (modules_here | packages_here) - {"__init__", "conftest"}


def bare_test_imports(paths: list[Path]) -> dict[str, set[str]]:
    """File → the test-side names it imports bare (``import helpers``, ``from faults.x``)."""
    bare_names = _test_side_names()
    found: dict[str, set[str]] = {}
    for path in paths:
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level:
                names.append(node.module or "")
            elif isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
        hits = {name.split(".")[0] for name in names} & bare_names
        if hits:
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            found[where.as_posix()] = hits
    return found


def test_tests_and_benchmarks_import_the_test_helpers_by_package_path():
    """``tests.helpers``, never ``helpers``: a bare name resolves only while something has
    put tests/ on ``sys.path``, and one module imported under two names holds its state
    twice (the fault table, registries)."""
    paths = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])
    bare = bare_test_imports(paths)
    assert not bare, f"import these as tests.<name>: {bare}"


def test_a_bare_import_of_a_test_helper_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import helpers\nfrom faults.workload import Workload\nfrom tests.pipeline import spawn\n"
        "def f():\n    import builders\n"
    )
    [(_, names)] = bare_test_imports([planted]).items()
    assert names == {"helpers", "faults", "builders"}
