"""From a YAML file, environment variables and ``key=value`` overrides to one tree in our
layout, ready for the config models (``rolloutbus.config.load_config`` validates it).

1. The file is read with OmegaConf, as verl reads its own: relative (``${.x}``), absolute
   (``${a.b}``) and nested interpolations, ``${oc.env:HOME}``, ``${oc.select:a.b,default}``.
   ``???`` (missing) values are fine wherever nothing reads them. Several files (``-c a.yaml
   -c b.yaml``) merge in order, as Hydra's and kubectl's do: each key of a later file is
   set where the tree keeps that setting (our name or verl's), so the later file wins key
   by key and a section it does not name is kept.
2. Overrides are set into that tree before anything is resolved, so an interpolation sees
   them: first ``ROLLOUTBUS__SECTION__KEY`` environment variables, then command-line
   ``key=value`` (hydra's syntax; ``+key=value`` and ``++key=value`` too). Precedence: file
   < environment < command line. A key may be given in verl's or in our name
   (``actor_rollout_ref.rollout.n=8`` or ``rollout.n=8``); it is written where the file
   keeps that setting, so the last word is always the override's.
3. The tree is walked with the tables of ``rolloutbus.verl_keys``: verl's keys that mean
   something here are read under our names, the others are collected with their reason
   (listed once by ``load_config``), unknown keys are errors that suggest the nearest
   known one. Only what is read is resolved.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rolloutbus.errors import ConfigError
from rolloutbus.verl_keys import (
    ROLLOUT_BLOCK,
    VERL_KEYS_IGNORED,
    VERL_KEYS_READ,
    VERL_VALUES_NOT_SUPPORTED,
    ignored_reason,
    layout_name,
    read_as,
    verl_name,
    verl_sections,
)

ENV_PREFIX = "ROLLOUTBUS__"
# A command-line override: a dotted key (at least two parts: every config key is in a
# section), ``=``, a value; hydra's ``+``/``++`` prefixes are accepted and mean the same here
OVERRIDE = re.compile(r"^\+{0,2}(?P<key>[A-Za-z_][\w-]*(?:\.[\w-]+)+)=(?P<value>.*)$", re.DOTALL)
# Our config models' keys: a section maps to its keys, a leaf to None
KeyTree = Mapping[str, "KeyTree | None"]


@dataclass
class LoadedTree:
    """A config in our layout, with what was ignored and what deserves a warning."""

    raw: dict[str, Any] = field(default_factory=dict)
    # (key as written, why it means nothing here), in file order
    ignored: list[tuple[str, str]] = field(default_factory=list)
    # a sentence per verl value that asks for something this system does not do
    unsupported: list[str] = field(default_factory=list)
    # our key -> the key as written, for messages about a value read under another name
    origin: dict[str, str] = field(default_factory=dict)


@dataclass
class Sources:
    """Where each key of a tree was set, so a message names the real source: the file, a
    later file, an environment variable or a command-line override."""

    files: list[Path] = field(default_factory=list)
    # a key as placed in the tree -> " in b.yaml", " (from override 'rollout.n=abc')", ...
    set_by: dict[str, str] = field(default_factory=dict)

    def record(self, placed: str, where: str) -> None:
        """``placed`` (and everything under it) was set last by ``where``."""
        for key in [k for k in self.set_by if k.startswith(placed + ".")]:
            del self.set_by[key]
        self.set_by[placed] = where

    def where(self, written: str) -> str:
        """ " in FILE", " (from ...)" or "" for a key as written in the tree."""
        parts = written.split(".")
        for i in range(len(parts), 0, -1):
            found = self.set_by.get(".".join(parts[:i]))
            if found is not None:
                return found
        # a section (or a value) whose contents one source set: ``rollout.n.x=1``
        below = {w for k, w in self.set_by.items() if k.startswith(written + ".")}
        if len(below) == 1:
            return below.pop()
        return f" in {self.files[0]}" if self.files else ""


Where = str | Sources  # a fixed " in FILE" (or ""), or the sources of a tree


def where_of(where: Where, written: str) -> str:
    """The source of ``written`` for a message: " in FILE", " (from ...)" or ""."""
    return where.where(written) if isinstance(where, Sources) else where


def is_override(token: str) -> bool:
    """Whether a command-line token is a ``dotted.key=value`` override."""
    return OVERRIDE.match(token) is not None


def parse_override(token: str) -> tuple[str, Any]:
    """``a.b=value`` -> ("a.b", value parsed as a YAML scalar, list or mapping); ``a.b=`` is
    the empty string, as in hydra."""
    match = OVERRIDE.match(token)
    if match is None:
        raise ConfigError(f"override {token!r} is not KEY=VALUE with a dotted KEY (rollout.n=8)")
    key, text = match["key"], match["value"]
    return key, _yaml_value(text, f"override {token!r}") if text != "" else ""


def env_overrides(env: Mapping[str, str]) -> list[tuple[str, str, Any]]:
    """``ROLLOUTBUS__ROLLOUT__N=8`` -> ("ROLLOUTBUS__ROLLOUT__N", "rollout.n", 8); an empty
    value is null."""
    out = []
    for name, text in env.items():
        if name.startswith(ENV_PREFIX):
            key = name[len(ENV_PREFIX) :].lower().replace("__", ".")
            value = _yaml_value(text, f"environment variable {name}") if text else None
            out.append((name, key, value))
    return out


def _yaml_value(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: the value is not valid YAML: {exc}") from exc


# -- 1 and 2: the file and the overrides, as one OmegaConf tree ---------------------------


def read_tree(
    path: str | Path | None,
    env: Mapping[str, str],
    overrides: Iterable[str] = (),
) -> DictConfig:
    """The file (or nothing) with the environment's, then the command line's, overrides."""
    return read_sources([] if path is None else [path], env, overrides)[0]


def read_sources(
    paths: Sequence[str | Path],
    env: Mapping[str, str],
    overrides: Iterable[str] = (),
) -> tuple[DictConfig, Sources]:
    """The files merged in order, then the environment's and the command line's overrides;
    with where each key was set."""
    sources = Sources(files=[Path(p) for p in paths])
    tree = _read_file(sources.files[0]) if sources.files else OmegaConf.create({})
    for later in sources.files[1:]:
        _merge_file(tree, later, sources)
    for name, key, value in env_overrides(env):
        what = f"environment variable {name}"
        sources.record(set_override(tree, key, value, what), f" (from {what})")
    for token in overrides:
        key, value = parse_override(token)
        what = f"override {token!r}"
        sources.record(set_override(tree, key, value, what), f" (from {what})")
    return tree, sources


def _merge_file(tree: DictConfig, path: Path, sources: Sources) -> None:
    """Every leaf of a later file set into ``tree`` (interpolations kept as written)."""
    later = OmegaConf.to_container(_read_file(path), resolve=False)
    assert isinstance(later, dict)  # _read_file refuses a list
    for key, value in _leaves(later, ""):
        sources.record(set_override(tree, key, value, f"config file {path}"), f" in {path}")


def _leaves(node: Mapping[Any, Any], prefix: str) -> Iterable[tuple[str, Any]]:
    for key, value in node.items():
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _read_file(path: Path) -> DictConfig:
    try:
        tree = OmegaConf.load(path)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config file {path}: {_first_line(exc)}") from exc
    if not isinstance(tree, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping, got a list")
    if "defaults" in tree.keys():
        raise ConfigError(
            f"config file {path} has a hydra 'defaults' list, which is not composed here: give "
            "the composed config (verl's _generated_ppo_trainer.yaml, or the output of "
            "`python -m verl.trainer.main_ppo --cfg job`)"
        )
    return tree


def set_override(tree: DictConfig, key: str, value: Any, what: str) -> str:
    """Set ``key`` where the file keeps that setting (our name or verl's); returns where."""
    placed = placement(tree, key)
    try:
        OmegaConf.update(tree, placed, value, merge=False, force_add=True)
    except (OmegaConfBaseException, ValueError) as exc:
        raise ConfigError(f"{what}: cannot set {placed}: {_first_line(exc)}") from exc
    return placed


def placement(tree: DictConfig, key: str) -> str:
    """Where an override of ``key`` goes: under our name if the file uses it, under verl's
    if the file uses that, else as given."""
    ours = read_as(key) or key
    verl = verl_name(ours)
    if verl == ours:
        return key
    ours_root, verl_root = _aliased_roots(ours)
    if _holds(tree, ours_root):
        return ours
    if _holds(tree, verl_root):
        return verl
    return key


def _aliased_roots(ours: str) -> tuple[str, str]:
    for verl_key, ours_key in VERL_KEYS_READ.items():
        if ours == ours_key or ours.startswith(ours_key + "."):
            return ours_key, verl_key
    raise AssertionError(f"{ours} has no verl name")  # callers check verl_name first


def _holds(tree: DictConfig, dotted: str) -> bool:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node.keys():
            return False
        if OmegaConf.is_interpolation(node, part) or OmegaConf.is_missing(node, part):
            return True
        node = node[part]
    return True


# -- 3: the walk --------------------------------------------------------------------------


def to_our_layout(
    tree: DictConfig, known: KeyTree, where: Where = "", env: Mapping[str, str] = os.environ
) -> LoadedTree:
    """Read ``tree`` into our layout (see the module docstring). ``where``: " in FILE", or
    the tree's ``Sources``; ``env``: where verl's file logger finds its path."""
    if _holds(tree, "rollout") and _holds(tree, ROLLOUT_BLOCK):
        raise ConfigError(
            f"config{where_of(where, ROLLOUT_BLOCK)} has both 'rollout' and '{ROLLOUT_BLOCK}': "
            "keep one"
        )
    walk = _Walk(tree, known, where)
    walk.section(tree, "")
    if walk.unknown:
        raise ConfigError("; ".join(walk.unknown))
    walk.loaded.unsupported = _unsupported_values(tree)
    _lengths_from_data(walk.loaded.raw)
    _file_logger(tree, walk.loaded.raw, env)
    return walk.loaded


class _Walk:
    def __init__(self, tree: DictConfig, known: KeyTree, where: Where):
        self.tree = tree
        self.known = known
        self.where = where
        self.loaded = LoadedTree()
        self.unknown: list[str] = []
        self.verl_sections = verl_sections()

    def section(self, node: DictConfig, prefix: str) -> None:
        for key in map(str, node.keys()):
            self.entry(node, key, f"{prefix}{key}")

    def entry(self, node: DictConfig, key: str, written: str) -> None:
        name = layout_name(written)
        if key == "_target_":
            return  # hydra's class to instantiate
        reason = ignored_reason(name)
        if reason is not None:
            self.loaded.ignored.append((written, reason))
            return
        target = read_as(written) or name
        kind = _kind(self.known, target)
        container = _is_section(node, key)
        if kind == "section" and container:
            self.section(node[key], f"{written}.")
        elif kind is not None:
            self.put(target, self.value(node, key, written), written)
        elif name in self.verl_sections and container:
            self.section(node[key], f"{written}.")
        else:
            self.unknown.append(self.describe_unknown(written, name))

    def value(self, node: DictConfig, key: str, written: str) -> Any:
        try:
            value = node[key]
            if isinstance(value, DictConfig | ListConfig):
                value = OmegaConf.to_container(value, resolve=True, throw_on_missing=True)
        except MissingMandatoryValue as exc:
            raise ConfigError(
                f"config key '{written}'{where_of(self.where, written)} is '???' (required): "
                "give it a value"
            ) from exc
        except OmegaConfBaseException as exc:
            raise ConfigError(
                f"config key '{written}'{where_of(self.where, written)}: {_first_line(exc)}"
            ) from exc
        return value

    def put(self, target: str, value: Any, written: str) -> None:
        if target in self.loaded.origin:
            raise ConfigError(
                f"config keys '{self.loaded.origin[target]}' and '{written}'"
                f"{where_of(self.where, written)} both set {target}: keep one"
            )
        self.loaded.origin[target] = written
        *parents, leaf = target.split(".")
        out = self.loaded.raw
        for part in parents:
            out = out.setdefault(part, {})
        out[leaf] = value

    def describe_unknown(self, written: str, name: str) -> str:
        message = f"unknown config key '{written}'{where_of(self.where, written)}"
        parent, _, leaf = name.rpartition(".")
        nearest = suggest(leaf, _siblings(self.known, parent))
        return message + (f": did you mean `{nearest}`?" if nearest else "")


def _is_section(node: DictConfig, key: str) -> bool:
    if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
        return False
    return isinstance(node[key], DictConfig)


def _kind(known: KeyTree, dotted: str) -> str | None:
    """ "section", "leaf", or None when ``dotted`` is not one of our keys."""
    node: KeyTree | None = known
    for part in dotted.split("."):
        if node is None or part not in node:
            return None
        node = node[part]
    return "leaf" if node is None else "section"


def _siblings(known: KeyTree, parent: str) -> set[str]:
    """Every key known under ``parent`` (a layout name): ours, and verl's from the tables."""
    node: KeyTree | None = known
    for part in parent.split(".") if parent else []:
        node = node.get(part) if node is not None else None
    names = set(node) if node is not None else set()
    verl_keys = (
        *(layout_name(k) for k in VERL_KEYS_READ),
        *VERL_KEYS_IGNORED,
        *VERL_VALUES_NOT_SUPPORTED,
        *verl_sections(),
    )
    prefix = f"{parent}." if parent else ""
    for key in verl_keys:
        if key.startswith(prefix) and "." not in key[len(prefix) :]:
            names.add(key[len(prefix) :])
    return names


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The known key nearest to a mistyped one, if any is near (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def _unsupported_values(tree: DictConfig) -> list[str]:
    out = []
    for key, (fine, instead) in VERL_VALUES_NOT_SUPPORTED.items():
        value = _select(tree, key)
        if value is not _ABSENT and value not in fine:
            out.append(f"config key '{key}' = {value!r} is not supported here: {instead}")
    return out


_ABSENT = object()


def _select(tree: DictConfig, key: str) -> Any:
    """The resolved value at ``key``, or _ABSENT when it is not set or does not resolve
    (then nothing here reads it, and nothing needs a warning)."""
    if not _holds(tree, key):
        return _ABSENT
    try:
        value = OmegaConf.select(tree, key, default=_ABSENT, throw_on_missing=False)
    except OmegaConfBaseException:
        return _ABSENT
    return value if not isinstance(value, DictConfig | ListConfig) else _ABSENT


def _lengths_from_data(raw: dict[str, Any]) -> None:
    """verl's rollout.prompt_length/response_length default to data.max_prompt_length/
    max_response_length (an interpolation in its generated config)."""
    data = raw.get("data")
    if not isinstance(data, dict):
        return
    rollout = raw.setdefault("rollout", {})
    for ours, theirs in (
        ("prompt_length", "max_prompt_length"),
        ("response_length", "max_response_length"),
    ):
        if data.get(theirs) is not None and isinstance(rollout, dict):
            rollout.setdefault(ours, data[theirs])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def split_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Command-line tokens -> (``key=value`` overrides, the rest, for argparse). Tokens after
    a ``--`` are never overrides."""
    overrides: list[str] = []
    rest: list[str] = []
    for i, token in enumerate(argv):
        if token == "--":
            rest.extend(argv[i:])
            break
        (overrides if is_override(token) else rest).append(token)
    return overrides, rest


def _file_logger(tree: DictConfig, raw: dict[str, Any], env: Mapping[str, str]) -> None:
    """verl's ``trainer.logger: [file]`` writes a JSONL log: trainer.metrics_log, unless set."""
    trainer = raw.get("trainer")
    if not isinstance(trainer, dict):
        return
    loggers = trainer.get("logger")
    loggers = [loggers] if isinstance(loggers, str) else loggers
    if isinstance(loggers, list) and "file" in loggers and trainer.get("metrics_log") is None:
        trainer["metrics_log"] = file_logger_path(tree, env)


def file_logger_path(tree: DictConfig, env: Mapping[str, str]) -> str:
    """Where verl's ``file`` logger writes: ``$VERL_FILE_LOGGER_PATH``, else
    ``$VERL_FILE_LOGGER_ROOT`` (default ``.``) / project_name / experiment_name.jsonl."""
    if env.get("VERL_FILE_LOGGER_PATH"):
        return env["VERL_FILE_LOGGER_PATH"]
    root = os.path.expanduser(env.get("VERL_FILE_LOGGER_ROOT", "."))
    project = _select(tree, "trainer.project_name")
    experiment = _select(tree, "trainer.experiment_name")
    project = "rolloutbus" if project in (_ABSENT, None) else project
    experiment = "train" if experiment in (_ABSENT, None) else experiment
    return os.path.join(root, str(project), f"{experiment}.jsonl")
