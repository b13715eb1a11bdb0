"""Small helpers that tests import directly (``from tests.helpers import free_port``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it).

    Another process may take it before the caller binds it; callers that start a server
    on it should retry with a fresh port when the start fails because the port is busy.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def unique_name(prefix: str, hex_chars: int = 8) -> str:
    """``prefix`` plus random hex: topic prefixes, group ids. No ``_`` (the key separator)."""
    return f"{prefix}{uuid.uuid4().hex[:hex_chars]}"


def verl_side_env() -> Path | str:
    """The folder of the verl 0.9.1 side environment (``$ROLLOUTBUS_VERL_SITE``, else what
    ops/contract/setup_verl_env.sh builds or finds), or why there is none: tests marked
    ``verl`` skip with that reason, as tests/verl_compat/test_verl_parity.py does."""
    site = os.environ.get("ROLLOUTBUS_VERL_SITE")
    if site:
        return Path(site)
    setup = Path(__file__).resolve().parents[1] / "ops" / "contract" / "setup_verl_env.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    built = subprocess.run(
        ["bash", str(setup)], capture_output=True, text=True, env=env, timeout=900
    )
    if built.returncode != 0:
        return f"the verl side environment did not build: {built.stderr[-2000:]}"
    return Path(built.stdout.strip().splitlines()[-1])


CLI_TIMEOUT_S = 120.0  # seconds; a command's start imports torch on two shared cores (a publish
# ran past 60 s at load 12 in a CI run beside other work)


def run_cli(
    *argv: str, timeout: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``rolloutbus ARGV`` in a fresh process, as a user runs it: its exit code, stdout and
    stderr (``env`` added to this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "rolloutbus.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
