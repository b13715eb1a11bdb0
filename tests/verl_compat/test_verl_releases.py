"""Every recent verl release's trainer config loads: verl 0.7.0 through 0.9.1 and main
1dda039. Each key those releases generate is read or listed as dropped (checked against the
key lists ``ops/verl_release_keys.py`` makes from the releases' generated configs, in
tests/data/verl/keys/); the keys that are read mean the same in every release (their
defaults are pinned below, so a new release that changes one is looked at); a key no
release knows is still an error with its suggestion."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutbus.config import Config, key_tree, load_config
from rolloutbus.errors import ConfigError
from rolloutbus.verl_keys import ignored_reason, layout_name, read_as, verl_sections
from tests.source_tree import TEST_DATA
from tests.verl_compat.test_verl_config import _listed_ignored

VERL_DATA = TEST_DATA / "verl"
RELEASES = ("0.7.0", "0.7.1", "0.8.0", "0.9.0", "0.9.1", "main-1dda039")
NEWEST = "0.9.1"


def _stem(release: str) -> str:
    return "verl_" + release.replace(".", "_").replace("-", "_")


def _generated(release: str) -> Path:
    """The release's verl/trainer/config/_generated_ppo_trainer.yaml, byte for byte."""
    return VERL_DATA / f"{_stem(release)}_generated_ppo_trainer.yaml"


def _keys(release: str) -> list[str]:
    """Every key of the release's generated trainer configs (FSDP, Megatron, TorchTitan,
    VeOmni), as ops/verl_release_keys.py lists them."""
    return (VERL_DATA / "keys" / f"{_stem(release)}.txt").read_text().split()


def _ours(dotted: str) -> str | None:
    """ "leaf" or "section" when ``dotted`` is one of our config keys, else None."""
    node: Any = key_tree()
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return "section" if isinstance(node, dict) else "leaf"


def _read_keys(release: str) -> list[str]:
    """The release's keys that are read here (verl's name), leaves only."""
    return [k for k in _keys(release) if _ours(read_as(k) or layout_name(k)) == "leaf"]


# -- every key is known -------------------------------------------------------------------


@pytest.mark.parametrize("release", RELEASES)
def test_every_key_a_release_generates_is_read_or_dropped(release):
    sections = verl_sections()
    unknown = [
        key
        for key in _keys(release)
        if key.rpartition(".")[2] != "_target_"  # hydra's class, accepted at any depth
        and ignored_reason(layout_name(key)) is None
        and _ours(read_as(key) or layout_name(key)) is None
        and layout_name(key) not in sections
    ]
    assert not unknown, f"classify in rolloutbus/verl_keys.py: {unknown}"


def _defaults(release: str) -> dict[str, Any]:
    """The read keys' values in the release's generated FSDP config (unresolved)."""
    tree = yaml.safe_load(_generated(release).read_text())
    out: dict[str, Any] = {}
    for key in _read_keys(release):
        node: Any = tree
        for part in key.split("."):
            node = node.get(part, "<absent>") if isinstance(node, dict) else "<absent>"
        out[key] = node
    return out


# Where the releases differ on a key that is read, and why each still means the same here.
# A new release that changes another one fails the test below: look at what verl changed.
DIFFERENCES = {
    # the same switch (the engine returns each token's logprob; truncated importance
    # sampling needs them); verl's default went from False to True in 0.9.0. Read as the
    # file says: a 0.8 config without it gives trajectories without rollout logprobs, as verl
    "actor_rollout_ref.rollout.calculate_log_probs": (False, False, False, True, True, True),
    # verl 0.7.1 renamed custom_reward_function to reward.custom_reward_function and kept the
    # old name: both work, the old one first when set (as verl's reward loop migrates it).
    # path null: verl's default_compute_score whatever the name, in verl and here
    "custom_reward_function.name": ("compute_score", None, None, None, None, None),
    "reward.custom_reward_function.name": ("<absent>", *["compute_score"] * 5),
    "reward.custom_reward_function.path": ("<absent>", *[None] * 5),
    # added by later releases (older ones get the same default here)
    "actor_rollout_ref.rollout.full_determinism": ("<absent>",) * 3 + (False,) * 3,
    "actor_rollout_ref.rollout.multi_turn.function_tool_path": ("<absent>",) * 2 + (None,) * 4,
    "data.mm_processor_kwargs": ("<absent>",) * 2 + ({},) * 4,
    # verl 0.9.1 only (main 1dda039 is older)
    "actor_rollout_ref.rollout.router_config_path": ("<absent>",) * 4 + (None, "<absent>"),
}


def test_the_keys_that_are_read_mean_the_same_in_every_release():
    by_release = {release: _defaults(release) for release in RELEASES}
    read = set().union(*by_release.values())
    differing = {
        key: tuple(by_release[r].get(key, "<absent>") for r in RELEASES)
        for key in read
        if len({repr(by_release[r].get(key, "<absent>")) for r in RELEASES}) > 1
    }
    assert differing == DIFFERENCES
    # the renamed reward function: both names are read
    assert {"custom_reward_function.name", "reward.custom_reward_function.name"} <= read


# -- the generated configs load -----------------------------------------------------------

OVERRIDES = [
    "actor_rollout_ref.rollout.n=8",
    "rollout.temperature=0.7",
    "data.max_prompt_length=1024",
    "actor_rollout_ref.actor.optim.lr=2e-6",
]


def _load(release: str) -> Config:
    return load_config(_generated(release), env={}, overrides=OVERRIDES)


@pytest.fixture(scope="module")
def newest() -> Config:
    return _load(NEWEST)


@pytest.mark.parametrize("release", RELEASES)
def test_each_releases_generated_config_loads_with_overrides(release, newest, caplog):
    with caplog.at_level(logging.WARNING, logger="rolloutbus.config"):
        cfg = _load(release)
    r = cfg.rollout
    assert (r.n, r.temperature, r.prompt_length, r.response_length) == (8, 0.7, 1024, 512)
    assert cfg.actor.optim.lr == 2e-6
    # the same rollout settings where the releases agree: all but calculate_log_probs
    differs = {"calculate_log_probs": release in ("0.7.0", "0.7.1", "0.8.0")}
    ours, theirs = r.model_dump(), newest.rollout.model_dump()
    assert ours["calculate_log_probs"] is not differs["calculate_log_probs"]
    assert {k: v for k, v in ours.items() if k not in differs} == {
        k: v for k, v in theirs.items() if k not in differs
    }
    for section in ("actor", "data", "algorithm", "async_training", "model", "trainer"):
        assert getattr(cfg, section) == getattr(newest, section), section
    assert cfg.reward_function.path is None  # verl's default_compute_score, in every release
    assert "actor_rollout_ref.ref" in _listed_ignored(caplog)


@pytest.mark.parametrize(
    "release, dropped",
    [
        ("0.7.0", {"reward_manager", "data.sampler", "actor_rollout_ref.rollout.skip_rollout"}),
        ("0.8.0", {"actor_rollout_ref.actor.router_replay", "actor_rollout_ref.rollout.skip"}),
        ("0.9.0", {"actor_rollout_ref.actor.router_replay", "data.continuous_token"}),
        ("main-1dda039", {"actor_rollout_ref.actor.router_replay"}),
    ],
)
def test_a_key_only_some_releases_have_is_listed_as_dropped(release, dropped, caplog):
    with caplog.at_level(logging.WARNING, logger="rolloutbus.config"):
        _load(release)
    assert dropped <= _listed_ignored(caplog)


@pytest.mark.parametrize("release", ["0.8.0", "0.9.0", "0.9.1", "main-1dda039"])
@pytest.mark.parametrize(
    "typo, nearest",
    [
        ("actor_rollout_ref.rollout.temprature=0.5", "temperature"),
        ("data.promt_key=question", "prompt_key"),
        ("actor_rollout_ref.actor.optim.lrr=1e-5", "lr"),
        ("replay_buffer.group_idd=x", "group_id"),
    ],
)
def test_a_typo_is_still_an_error_with_its_suggestion(release, typo, nearest):
    key = typo.split("=")[0]
    with pytest.raises(ConfigError, match=rf"unknown config key '{re.escape(key)}'") as err:
        load_config(_generated(release), env={}, overrides=[typo])
    assert f"did you mean `{nearest}`?" in str(err.value)


def test_a_typo_in_a_file_is_an_error_too(tmp_path):
    path = tmp_path / "c.yaml"
    raw = yaml.safe_load(_generated("0.8.0").read_text())
    raw["replay_buffer"] = {"compresion": "zstd"}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"'replay_buffer.compresion' in .*`compression`\?"):
        load_config(path, env={})


@pytest.mark.parametrize("release", ["0.8.0", "0.9.0", "0.9.1", "main-1dda039"])
def test_rolloutbus_config_prints_each_releases_generated_config(release):
    done = subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", "config", "-c", str(_generated(release))]
        + ["actor_rollout_ref.rollout.n=8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = yaml.safe_load(done.stdout)
    assert printed["rollout"]["n"] == 8 and printed["rollout"]["prompt_length"] == 512
    assert "accepted and ignored" in done.stderr
