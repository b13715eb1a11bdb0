"""Write one release's format samples, tests/data/formats/<release>/, with that release's code.

    python tests/data/make_format_samples.py                        # this checkout -> current
    python tests/data/make_format_samples.py --release stop-12      # a released commit (RELEASES)
    python tests/data/make_format_samples.py --release stop-12 --source /tmp/old-d8a869d

The first form rewrites ``current`` (the formats of the release being built) after a schema
change; ``tests/schemas/test_schema_evolution.py`` says when. The second checks the commit out once
into a temporary git worktree, writes its samples with its own code (a child process
imports ``rolloutbus`` from that tree) and removes the worktree; ``--source`` uses a tree
already checked out. Released samples are frozen: written once, never edited.

What a sample holds, each record exactly as that version's code encodes it (one scenario,
built with that version's models; fields a version lacks are left out):

* ``prompts.jsonl``: three prompt groups (``build_group``, the publisher's encoding);
* ``turns.jsonl``: their turn log, one partition in log order: a single-turn group of two
  sessions, a tool-agent group (a tool call, its observation, the answer; and a session
  that failed mid-turn) and a group whose one session failed before any token;
* ``trajectories.jsonl``: what that version's replay-buffer fold released from that log
  (``{"key", "value_b64"}``: Arrow IPC stream bytes);
* ``control.jsonl``: two policy versions (releases that have ``rollout.control``);
* ``dead_letters.jsonl``: two dead letters;
* ``schemas.json``: the record models' JSON schemas and the trajectory's Arrow schema
  (titles and descriptions left out), and ``manifest.json`` with their fingerprint.

Imports nothing of ``rolloutbus`` at module level: the code it drives is chosen at run time.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib
import importlib.abc
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
FORMATS = HERE / "formats"
REPO = HERE.parent.parent
CURRENT = "current"
# the landed stops (`issues stops`): release name -> the commit whose code wrote its samples
RELEASES = {
    "stop-4": "8fb72447ce78dc971edada332f98d68b061cd94f",
    "stop-11": "290d6ab97aa5f4f0f96dd2951c3d0dbbc80509b0",
    "stop-12": "d8a869d401de62164bbe6e69a4552a6162bfcc40",
}
T0 = 1_796_000_000.0  # seconds since the epoch: every timestamp in a sample is fixed
# what the scenario's groups run under (as every release's defaults are), stated so that a
# change of a config default does not change the samples
SAMPLE_ROLLOUT = {
    "prompt_length": 1024,
    "response_length": 512,
    "calculate_log_probs": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "repetition_penalty": 1.0,
}


# -- running another tree's code -----------------------------------------------------------


class TreeFinder(importlib.abc.MetaPathFinder):
    """Imports ``rolloutbus`` and its subpackages from a source tree, mapped as that tree's
    pyproject maps them (``[tool.setuptools.package-dir]``), ahead of any installed copy."""

    def __init__(self, root: Path) -> None:
        config = tomllib.loads((root / "pyproject.toml").read_text())
        dirs = config["tool"]["setuptools"]["package-dir"]
        self.dirs = {name: root / path for name, path in dirs.items()}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        for package in sorted(self.dirs, key=len, reverse=True):
            if fullname == package or fullname.startswith(package + "."):
                rest = fullname[len(package) :].lstrip(".")
                base = self.dirs[package].joinpath(*rest.split(".")) if rest else self.dirs[package]
                if (base / "__init__.py").is_file():
                    return importlib.util.spec_from_file_location(
                        fullname, base / "__init__.py", submodule_search_locations=[str(base)]
                    )
                if base.with_suffix(".py").is_file():
                    return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
                # not in this tree: no other finder may supply it (from an installed copy)
                raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def _optional_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


# -- fingerprints --------------------------------------------------------------------------


def _normalized(node: Any, names: bool = False) -> Any:
    """A JSON schema without titles and descriptions (prose, not format). ``names``: a map
    of field or definition names, whose keys are kept whatever they are."""
    if isinstance(node, list):
        return [_normalized(v) for v in node]
    if not isinstance(node, dict):
        return node
    return {
        k: _normalized(v, names=not names and k in ("properties", "$defs"))
        for k, v in node.items()
        if names or k not in ("title", "description")
    }


def record_schemas(models: dict[str, Any], arrow_schema: Any) -> dict[str, Any]:
    """Each record kind's JSON schemas (as read and as written) and the trajectory's Arrow
    columns: what the fingerprint hashes."""
    from pydantic import TypeAdapter

    out: dict[str, Any] = {}
    for kind, target in models.items():
        adapter = TypeAdapter(target)
        out[kind] = {
            mode: _normalized(adapter.json_schema(mode=mode, by_alias=True))
            for mode in ("validation", "serialization")
        }
    out["trajectory_arrow"] = {
        "columns": [[f.name, str(f.type), f.nullable] for f in arrow_schema],
        "metadata": {k.decode(): v.decode() for k, v in (arrow_schema.metadata or {}).items()},
    }
    return out


def fingerprint(schemas: dict[str, Any]) -> dict[str, str]:
    """sha256 of each kind's schemas (canonical JSON), and of all of them."""
    digest = {k: _sha256(v) for k, v in sorted(schemas.items())}
    digest["all"] = _sha256(digest)
    return digest


def _sha256(value: Any) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def current_models() -> tuple[dict[str, Any], Any]:
    """The record models of the ``rolloutbus`` this process imports, and the Arrow schema."""
    prompts = importlib.import_module("rolloutbus.schemas.prompts")
    turns = importlib.import_module("rolloutbus.schemas.turns")
    trajectories = importlib.import_module("rolloutbus.schemas.trajectories")
    dlq = importlib.import_module("rolloutbus.schemas.dlq")
    control = _optional_module("rolloutbus.schemas.control")
    models: dict[str, Any] = {
        "prompt_group": prompts.PromptGroup,
        "turn_event": turns.TurnEvent,
        "trajectory": trajectories.Trajectory,
        "dead_letter": dlq.DeadLetter,
    }
    if control is not None:
        models["control_event"] = control.ControlEvent
    return models, trajectories.TRAJECTORY_SCHEMA


# -- the scenario --------------------------------------------------------------------------


def _make(cls: Any, **fields: Any) -> Any:
    """``cls`` built from the fields it has (by name or alias): one scenario, any version."""
    known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
    return cls(**{k: v for k, v in fields.items() if k in known})


ROWS = {
    "fmt-single": {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 2 + 3? Answer with #### n."}],
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"index": 0, "split": "train"},
        "ability": "math",
        "__rollout_n__": 2,
    },
    "fmt-tool": {
        "data_source": "openai/gsm8k",
        "agent_name": "tool_agent",
        "prompt": [
            {"role": "system", "content": "Use the calculator."},
            {"role": "user", "content": "What is 17 * 23?"},
        ],
        "reward_model": {"style": "rule", "ground_truth": "391"},
        "extra_info": {"index": 1, "tools_kwargs": {"calculator": {"create_kwargs": {}}}},
        "__rollout_n__": 2,
    },
    "fmt-fail": {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "__rollout_n__": 1,
    },
}


class TurnLog:
    """Builds one partition's turn events in log order, numbering each stream's ``seq``."""

    def __init__(self, turns: ModuleType) -> None:
        self.turns = turns
        self.events: list[Any] = []
        self.seq: dict[tuple[Any, ...], int] = {}

    def add(self, name: str, stream: tuple[Any, ...], **fields: Any) -> None:
        seq = self.seq.get(stream, 0)
        self.seq[stream] = seq + 1
        ts = T0 + len(self.events) * 0.25
        self.events.append(_make(getattr(self.turns, name), seq=seq, ts=ts, **fields))

    def group(self, group: Any, settings: Any) -> None:
        self.add(
            "GroupStarted",
            (group.uid,),
            uid=group.uid,
            attempt=f"w0-{group.uid}",
            n=group.n,
            row=group.row,
            validate=group.validate_,
            global_steps=group.global_steps,
            policy_version=group.policy_version,
            sampling_params=group.sampling_params.model_dump(),
            settings=settings,
        )

    def session(self, name: str, uid: str, sid: int, **fields: Any) -> None:
        attempt = f"w0-{uid}-{sid}"
        self.add(name, (uid, sid, attempt), uid=uid, session_id=sid, attempt=attempt, **fields)


def _generation(
    log: TurnLog, uid: str, sid: int, turn: int, tokens: list[int], **more: Any
) -> None:
    log.session(
        "Generation",
        uid,
        sid,
        segment=0,
        turn=turn,
        token_ids=tokens,
        logprobs=[-0.25 * (i + 1) for i in range(len(tokens))],
        replica="http://127.0.0.1:8100",
        engine_request_id=f"{uid}-{sid}-{turn}",
        policy_version=0,
        stop_reason="completed",
        num_preempted=-1,
        latency_s=0.125,
        **more,
    )


def _output(turns: ModuleType, agent_loop: ModuleType, **fields: Any) -> Any:
    metrics = _make(
        agent_loop.AgentLoopMetrics,
        generate_sequences=fields.pop("generate_s"),
        tool_calls=fields.pop("tool_s", 0.0),
        compute_score=0.0625,
        num_preempted=-1,
    )
    return _make(turns.OutputSummary, segment=0, metrics=metrics, **fields)


def _spans(uid: str) -> list[Any]:
    trace = _optional_module("rolloutbus.schemas.trace")
    if trace is None:
        return []
    return [
        trace.TraceSpan(
            name="agent_loop.run", start_ts=T0, end_ts=T0 + 1.5, attributes={"uid": uid}
        )
    ]


def _routed_experts(tokens: int) -> Any:
    module = _optional_module("rolloutbus.schemas.routed_experts")
    if module is None:
        return None
    import numpy as np

    return module.RoutedExperts.from_array(np.arange(tokens * 2 * 2).reshape(tokens, 2, 2) % 8)


def turn_log(groups: dict[str, Any], settings: Any) -> list[Any]:
    """The scenario's turn events (see the module docstring), as this version writes them."""
    turns = importlib.import_module("rolloutbus.schemas.turns")
    agent_loop = importlib.import_module("rolloutbus.schemas.agent_loop")
    log = TurnLog(turns)
    single, tool, fail = groups["fmt-single"], groups["fmt-tool"], groups["fmt-fail"]
    prompt = [101, 102, 103, 104, 105]
    log.group(single, settings)
    for sid in (0, 1):
        log.session("SessionStarted", single.uid, sid, agent_name="single_turn_agent")
        log.session("SegmentStarted", single.uid, sid, segment=0, prompt_ids=prompt)
    _generation(log, single.uid, 0, 0, [7, 8, 9, 2], routed_experts=_routed_experts(8))
    _generation(log, single.uid, 1, 0, [7, 8, 10, 11, 2])
    for sid, (length, reward) in enumerate([(4, 1.0), (5, 0.0)]):
        summary = _output(
            turns,
            agent_loop,
            prompt_len=5,
            response_len=length,
            reward_score=reward,
            num_turns=2,
            generate_s=0.125,
        )
        log.session("SessionFinished", single.uid, sid, outputs=[summary], spans=_spans(single.uid))

    log.group(tool, settings)
    log.session("SessionStarted", tool.uid, 0, agent_name="tool_agent")
    log.session("SegmentStarted", tool.uid, 0, segment=0, prompt_ids=prompt + [106])
    _generation(log, tool.uid, 0, 0, [31, 32, 33])  # the tool call
    log.session("SessionStarted", tool.uid, 1, agent_name="tool_agent")
    log.session("SegmentStarted", tool.uid, 1, segment=0, prompt_ids=prompt + [106])
    log.session("Observation", tool.uid, 0, segment=0, turn=1, token_ids=[41, 42])  # its result
    _generation(log, tool.uid, 1, 0, [31, 34])
    _generation(log, tool.uid, 0, 2, [51, 52, 2])  # the answer
    log.session(
        "SessionFailed",
        tool.uid,
        1,
        agent_name="tool_agent",
        error="AgentLoopError: tool calculator timed out after 5.0 s",
        retriable=False,
    )
    summary = _output(
        turns,
        agent_loop,
        prompt_len=6,
        response_len=8,
        reward_score=1.0,
        num_turns=4,
        generate_s=0.25,
        tool_s=0.03125,
        extra_fields={"tool_rewards": [0.0]},
    )
    log.session("SessionFinished", tool.uid, 0, outputs=[summary], spans=_spans(tool.uid))

    log.group(fail, settings)
    log.session("SessionStarted", fail.uid, 0, agent_name="single_turn_agent")
    log.session(
        "SessionFailed",
        fail.uid,
        0,
        agent_name="single_turn_agent",
        error="NoReplicaAvailableError: no replica answered within 30.0 s",
        retriable=False,
    )
    return log.events


def prompt_groups(cfg: Any) -> dict[str, Any]:
    publish = importlib.import_module("rolloutbus.producers.publish")
    groups = {}
    for uid, row in ROWS.items():
        group = publish.build_group(cfg, dict(row), uid=uid, validate=uid == "fmt-fail")
        groups[uid] = group.model_copy(update={"created_at": T0})
    return groups


def encode_prompt_group(cfg: Any, group: Any) -> bytes:
    publish = importlib.import_module("rolloutbus.producers.publish")
    if hasattr(publish, "encode_group"):
        return publish.encode_group(cfg, group)
    return group.model_dump_json(by_alias=True).encode()  # stop 4's publisher, inline


def group_settings(cfg: Any) -> Any:
    turns = importlib.import_module("rolloutbus.schemas.turns")
    if not hasattr(turns, "GroupSettings"):
        return None
    return _make(
        turns.GroupSettings,
        prompt_length=cfg.rollout.prompt_length,
        response_length=cfg.rollout.response_length,
    )


def released_trajectories(cfg: Any, events: list[Any]) -> list[tuple[str, bytes]]:
    """The replay buffer's fold of the log, by this version's own fold and finalize."""
    if _optional_module("rolloutbus.streams.assembly.partition_fold") is not None:
        return _released_by_assembly(cfg, events)
    return _released_by_group_fold(cfg, events)


def _released_by_assembly(cfg: Any, events: list[Any]) -> list[tuple[str, bytes]]:
    fold_module = importlib.import_module("rolloutbus.streams.assembly.partition_fold")
    build = importlib.import_module("rolloutbus.streams.assembly.trajectories")
    fold = fold_module.PartitionFold(0, limits=fold_module.FoldLimits.from_config(cfg))
    out = []
    for offset, event in enumerate(events):
        for group in fold.fold(offset, event):
            done = build.finalize_group(
                group, cfg.rollout, max_record_bytes=build.max_record_bytes(cfg.kafka)
            )
            out += [(t.key, r) for t, r in zip(done.trajectories, done.records, strict=True)]
    _check_all_released(fold)
    return out


def _released_by_group_fold(cfg: Any, events: list[Any]) -> list[tuple[str, bytes]]:
    group_fold = importlib.import_module("rolloutbus.streams.group_fold")
    release = importlib.import_module("rolloutbus.streams.release")
    trajectories = importlib.import_module("rolloutbus.schemas.trajectories")
    fold = group_fold.PartitionFold(next_offset=0, traj_next_offset=0)
    out = []
    for offset, event in enumerate(events):
        group = fold.apply(offset, event)
        if group is not None:
            built, _ = release.finalize_group(group, cfg.rollout)
            records = trajectories.encode_trajectories(built)
            out += [(t.key, r) for t, r in zip(built, records, strict=True)]
    _check_all_released(fold)
    return out


def _check_all_released(fold: Any) -> None:
    if fold.open:
        raise SystemExit(f"the scenario left groups open: {sorted(fold.open)}")


def control_events() -> list[bytes]:
    control = _optional_module("rolloutbus.schemas.control")
    if control is None:
        return []  # released before rollout.control existed
    first = _make(control.PolicyVersionPublished, policy_version=0, published_at=T0)
    second = _make(
        control.PolicyVersionPublished,
        policy_version=1,
        weights_path="/checkpoints/policy-1",
        global_step=2,
        trainer_id="trainer-0",
        published_at=T0 + 60,
        model_name="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
    return [control.encode_control_event(e) for e in (first, second)]


def dead_letters() -> list[bytes]:
    dlq = importlib.import_module("rolloutbus.schemas.dlq")
    letters = [
        dlq.DeadLetter.of(
            b"\xff not a prompt group",
            stage="sessions",
            reason="prompt group does not match its schema",
            source="rollout.prompts[0]@7",
        ),
        dlq.DeadLetter.of(b"", stage="replay_buffer", reason="a tombstone on the turn log"),
    ]
    return [d.model_copy(update={"ts": T0}).model_dump_json().encode() for d in letters]


# -- writing -------------------------------------------------------------------------------


def sample_config() -> Any:
    """The config the scenario's groups run and are folded under."""
    config = importlib.import_module("rolloutbus.config")
    return config.Config.model_validate({"rollout": SAMPLE_ROLLOUT})


def write_samples(release: str, out: Path, commit: str = "") -> None:
    """Write ``release``'s samples into ``out`` with the ``rolloutbus`` this process imports."""
    version = importlib.import_module("rolloutbus.schemas.version")
    cfg = sample_config()
    groups = prompt_groups(cfg)
    events = turn_log(groups, group_settings(cfg))
    turns = importlib.import_module("rolloutbus.schemas.turns")
    models, arrow_schema = current_models()
    schemas = record_schemas(models, arrow_schema)
    out.mkdir(parents=True, exist_ok=True)
    files = {
        "prompts.jsonl": [encode_prompt_group(cfg, g) for g in groups.values()],
        "turns.jsonl": [turns.encode_turn_event(e) for e in events],
        "control.jsonl": control_events(),
        "dead_letters.jsonl": dead_letters(),
        "trajectories.jsonl": [
            json.dumps({"key": k, "value_b64": base64.b64encode(v).decode()}).encode()
            for k, v in released_trajectories(cfg, events)
        ],
    }
    for name, lines in files.items():
        if lines:
            (out / name).write_bytes(b"".join(line + b"\n" for line in lines))
    (out / "schemas.json").write_text(json.dumps(schemas, indent=1, sort_keys=True) + "\n")
    manifest = {
        "release": release,
        "commit": commit,
        "schema_version": version.SCHEMA_VERSION,
        "records": {name: len(lines) for name, lines in files.items() if lines},
        "fingerprint": fingerprint(schemas),
        "written_by": "tests/data/make_format_samples.py",
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def _from_commit(release: str, commit: str, out: Path) -> None:
    """Check ``commit`` out once into a temporary worktree, write from it, remove it."""
    tree = Path(tempfile.mkdtemp(prefix=f"old-{commit[:7]}-"))
    tree.rmdir()
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True
    )
    try:
        subprocess.run(
            [
                sys.executable,
                __file__,
                "--release",
                release,
                "--source",
                str(tree),
                "--out",
                str(out),
            ],
            check=True,
        )
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=True
        )


def _commit_of(tree: Path) -> str:
    run = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return run.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--release", default=CURRENT, help=f"{CURRENT} or one of {sorted(RELEASES)}"
    )
    parser.add_argument(
        "--source", type=Path, help="a checked-out tree whose code writes the samples"
    )
    parser.add_argument("--out", type=Path, help="default: tests/data/formats/<release>")
    args = parser.parse_args(argv)
    if args.release != CURRENT and args.release not in RELEASES:
        parser.error(f"unknown release {args.release!r}: {CURRENT} or one of {sorted(RELEASES)}")
    out = args.out or FORMATS / args.release
    if out.exists() and args.out is None:
        shutil.rmtree(out)
    if args.source is not None:
        source = args.source.resolve()
        sys.meta_path.insert(0, TreeFinder(source))
        if not Path(importlib.import_module("rolloutbus").__file__ or "").is_relative_to(source):
            raise SystemExit(f"rolloutbus was not imported from {source}")
        write_samples(args.release, out, _commit_of(source))
    elif args.release == CURRENT:
        write_samples(CURRENT, out)
    else:
        _from_commit(args.release, RELEASES[args.release], out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
