"""Fixtures of the verl area: the verl 0.9.1 side environment every parity test runs in."""

from __future__ import annotations

from pathlib import Path

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
