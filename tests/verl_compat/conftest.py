"""Fixtures of the verl area: the verl 0.9.1 side environment every parity test runs in,
and the one way a test runs a program there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import verl_side_env


@pytest.fixture(scope="session")
def verl_site() -> Path:
    """The folder of the verl 0.9.1 side environment (``$ROLLOUTBUS_VERL_SITE``, else what
    ops/contract/setup_verl_env.sh builds or finds, once per session); a test that needs it
    skips with the reason when there is none (``ops/test.sh`` builds it before the tests, and
    fails when it cannot)."""
    site = verl_side_env()
    if isinstance(site, str):
        pytest.skip(site)
    return site


@pytest.fixture(scope="session")
def run_in_verl(verl_site: Path) -> Callable[..., Any]:
    """Runs ``python ARGV...`` in the verl side environment (from /tmp, so the checkout's
    folders cannot shadow anything) and returns the JSON of its last stdout line; a failed
    run fails the test with the end of its stderr and of ``logs`` (paths)."""

    def run(*argv: str, timeout: float = 600, logs: Iterable[Path] = ()) -> Any:
        done = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            cwd="/tmp",
            env={**os.environ, "PYTHONPATH": str(verl_site)},
            timeout=timeout,
        )
        tails = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in logs if p.exists())
        assert done.returncode == 0, done.stderr[-6000:] + tails
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
