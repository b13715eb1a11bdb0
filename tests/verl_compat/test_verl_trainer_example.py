"""examples/verl/: the config and the commands of a run with verl's own trainer.

No trainer runs here (verl's trainers need a GPU). What runs is everything up to it: the
bus's loader reads the example's YAML, the README's ``rolloutbus`` commands exist, and the
README's ``python -m verl.trainer.main_ppo`` line composes under verl 0.9.1's own Hydra entry
point (``--cfg job --resolve`` added; verl side environment). In that composed config verl's
``load_class_from_fqn`` loads the plug-in's class path as ``BusAgentLoopManagerV0``, and the
plug-in's ``bus_config`` finds the same YAML and agrees with verl on the rollout settings.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rolloutbus.config import load_config
from tests.source_tree import ROOT

EXAMPLE = ROOT / "examples" / "verl"
CONFIG = EXAMPLE / "bus" / "grpo_v0.yaml"
README = EXAMPLE / "README.md"
MANAGER = "rolloutbus.verl.BusAgentLoopManagerV0"

# In the verl side env: verl's own loader on the composed class path, and the plug-in's
# bus config from the composed verl config (argv[1]: the composed YAML).
PLUGIN_SIDE = """
import json, sys
from omegaconf import OmegaConf
from verl.utils.import_utils import load_class_from_fqn
from rolloutbus.verl.settings import bus_config
from rolloutbus.verl.v0_manager import BusAgentLoopManagerV0
composed = OmegaConf.load(sys.argv[1])
fqn = composed.actor_rollout_ref.rollout.agent.agent_loop_manager_class
cls = load_class_from_fqn(fqn, "AgentLoopManager")
bus = bus_config(composed, env={})
print(json.dumps({
    "is_manager": cls is BusAgentLoopManagerV0,
    "has_create": callable(getattr(cls, "create", None)),
    "rollout": bus.rollout.model_dump(mode="json"),
    "model": bus.model.name,
}))
"""


def _readme_commands() -> list[str]:
    """The lines of the README's bash block, ``\\`` continuations joined."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.DOTALL)
    assert block, "examples/verl/README.md has no ```bash block"
    joined = block.group(1).replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in joined.splitlines() if line.strip()]


def _verl_command() -> str:
    lines = [c for c in _readme_commands() if c.startswith("python -m verl.trainer.main_ppo")]
    assert len(lines) == 1, lines
    return lines[0]


def test_the_example_config_loads_with_rolloutbus_config():
    done = subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", "config", "-c", str(CONFIG)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    printed = yaml.safe_load(done.stdout)
    assert printed["rollout"]["n"] == 4
    assert printed["model"]["name"] == "models/SmolLM2-135M-Instruct"
    assert "accepted and ignored" in done.stderr


def test_every_rolloutbus_command_of_the_readme_is_a_cli_command():
    done = subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # a command's name at 4 spaces, alone on its line when it is long (replay-buffer)
    listed = set(re.findall(r"^ {4}([a-z][a-z-]*)(?: |$)", done.stdout, re.MULTILINE))
    used = {c.split()[1] for c in _readme_commands() if c.startswith("rolloutbus ")}
    assert used and used <= listed, used - listed


def test_the_readme_names_the_plug_in_in_verls_documented_key():
    assert f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER}" in shlex.split(
        _verl_command()
    )


@pytest.fixture(scope="module")
def composed(verl_site: Path, run_in_verl, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """verl's config as the README's command composes it, and what the plug-in sees in it."""
    python = shlex.quote(sys.executable)
    command = _verl_command().replace("python ", f"{python} ", 1) + " --cfg job --resolve"
    env = {**os.environ, "PYTHONPATH": str(verl_site), "PYTHONSAFEPATH": "1"}
    done = subprocess.run(
        ["bash", "-c", command],
        capture_output=True,
        text=True,
        cwd=ROOT,  # the README's commands run from the repository root
        env={**env, "PWD": str(ROOT)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    path = tmp_path_factory.mktemp("verl") / "composed.yaml"
    path.write_text(done.stdout)
    return {
        "verl": yaml.safe_load(done.stdout),
        "plugin": run_in_verl("-c", PLUGIN_SIDE, str(path)),
    }


@pytest.mark.verl
def test_verls_entry_point_composes_the_readme_command_with_the_manager(composed):
    verl = composed["verl"]
    assert verl["actor_rollout_ref"]["rollout"]["agent"]["agent_loop_manager_class"] == MANAGER
    assert verl["trainer"]["use_v1"] is False
    assert verl["rolloutbus"]["config"] == str(CONFIG)
    assert composed["plugin"]["is_manager"] and composed["plugin"]["has_create"]


@pytest.mark.verl
def test_the_plug_in_and_verl_agree_on_the_rollout(composed):
    rollout = composed["verl"]["actor_rollout_ref"]["rollout"]
    bus = composed["plugin"]["rollout"]
    assert (bus["n"], bus["prompt_length"], bus["response_length"]) == (4, 256, 256)
    assert bus["n"] == rollout["n"]
    assert bus["prompt_length"] == rollout["prompt_length"]
    assert bus["response_length"] == rollout["response_length"]
    assert bus["temperature"] == rollout["temperature"]
    assert bus["calculate_log_probs"] is True
    assert rollout["calculate_log_probs"] is True
    # the model comes to the plug-in from the file alone (verl's overrides are rollout keys
    # only): the plug-in found the file that +rolloutbus.config names
    assert composed["plugin"]["model"] == composed["verl"]["actor_rollout_ref"]["model"]["path"]
    assert composed["plugin"]["model"] == load_config([str(CONFIG)], env={}).model.name
