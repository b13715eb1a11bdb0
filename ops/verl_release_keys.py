"""Make the key lists of verl's generated trainer configs, one per release, that
``tests/verl_compat/test_verl_releases.py`` checks ``rolloutbus.verl_keys`` against: every
key of every release must be read or listed as dropped. Nothing here runs at run time.

A key is every node of a release's ``verl/trainer/config/_generated_ppo*_trainer.yaml``
(the FSDP one and, where the release has them, the Megatron, TorchTitan and VeOmni ones),
named by its dotted path as verl writes it: sections and leaves alike. Nothing is resolved.

Usage (network only here, never at run time)::

    mkdir -p /tmp/verl-wheels
    for v in 0.7.0 0.7.1 0.8.0 0.9.0 0.9.1; do
        pip download --no-deps verl==$v -d /tmp/verl-wheels
    done
    # verl main, pinned by commit: a clone (or bare mirror) of github.com/verl-project/verl
    python ops/verl_release_keys.py --wheels /tmp/verl-wheels \\
        --git /path/to/verl.git --commit 1dda039

It writes, for each release R (``0.9.1``, ``main-1dda039``):

* ``tests/data/verl/keys/verl_R.txt``: the release's keys, one a line, sorted;
* ``tests/data/verl/verl_R_generated_ppo_trainer.yaml``: its FSDP generated config, byte for
  byte (the tests load it).

A new verl release: add its wheel (or move --commit), run this, then classify in
``rolloutbus/verl_keys.py`` whatever key the test reports as unknown.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
KEYS_DIR = ROOT / "tests" / "data" / "verl" / "keys"
CONFIGS_DIR = ROOT / "tests" / "data" / "verl"
CONFIG_DIR = "verl/trainer/config/"
GENERATED = re.compile(r"^_generated_ppo(_\w+)?_trainer\.yaml$")
FSDP = "_generated_ppo_trainer.yaml"


def dotted_keys(node: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    """Every section and leaf of a config tree by its dotted path."""
    for name, value in node.items():
        yield f"{prefix}{name}"
        if isinstance(value, Mapping):
            yield from dotted_keys(value, f"{prefix}{name}.")


def wheel_configs(wheel: Path) -> dict[str, bytes]:
    """The generated trainer configs in a verl wheel: file name -> bytes."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            name[len(CONFIG_DIR) :]: archive.read(name)
            for name in archive.namelist()
            if name.startswith(CONFIG_DIR) and GENERATED.match(name[len(CONFIG_DIR) :])
        }


def git_configs(git_dir: Path, commit: str) -> dict[str, bytes]:
    """The generated trainer configs of verl at ``commit`` in a clone or bare mirror."""
    listing = subprocess.run(
        ["git", "--git-dir", str(git_dir), "ls-tree", "--name-only", commit, CONFIG_DIR],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    out = {}
    for path in listing:
        name = path[len(CONFIG_DIR) :]
        if GENERATED.match(name):
            out[name] = subprocess.run(
                ["git", "--git-dir", str(git_dir), "show", f"{commit}:{path}"],
                check=True,
                capture_output=True,
            ).stdout
    return out


def release_keys(configs: Mapping[str, bytes]) -> set[str]:
    keys: set[str] = set()
    for text in configs.values():
        keys.update(dotted_keys(yaml.safe_load(text)))
    return keys


def write_release(release: str, configs: Mapping[str, bytes]) -> None:
    """One release's key list and its FSDP config under tests/data/verl/."""
    stem = "verl_" + release.replace(".", "_").replace("-", "_")
    keys = release_keys(configs)
    KEYS_DIR.mkdir(parents=True, exist_ok=True)
    (KEYS_DIR / f"{stem}.txt").write_text("".join(f"{k}\n" for k in sorted(keys)))
    (CONFIGS_DIR / f"{stem}_generated_ppo_trainer.yaml").write_bytes(configs[FSDP])
    print(f"{release}: {len(keys)} keys from {', '.join(sorted(configs))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, required=True, help="folder of verl-X-*.whl")
    parser.add_argument("--git", type=Path, help="a clone or bare mirror of verl")
    parser.add_argument("--commit", help="verl main's commit to read (with --git)")
    args = parser.parse_args()
    for wheel in sorted(args.wheels.glob("verl-*.whl"), key=_version):
        write_release(wheel.name.split("-")[1], wheel_configs(wheel))
    if args.git is not None:
        commit = args.commit or "HEAD"
        write_release(f"main-{commit}", git_configs(args.git, commit))


def _version(wheel: Path) -> tuple[int, ...]:
    return tuple(int(x) for x in wheel.name.split("-")[1].split("."))


if __name__ == "__main__":
    main()
