"""The bus side of the verl trainer tests: a config for a tiny-qwen3 replica and the even-token
loop (tests/plugins), and the replica, session worker and replay buffer running on it as
processes while verl's side runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rolloutbus.config import Config
from tests.helpers import unique_name
from tests.pipeline import even_token_rollout, pipeline_config, pipeline_running


def even_token_config(
    kafka_bootstrap: str, tmp_path: Path, prefix: str, trainer_group: str
) -> Config:
    """Topics of their own (``prefix``), groups of 2 even-token sessions of 8 tokens."""
    return pipeline_config(
        kafka_bootstrap,
        prefix,
        model={"seed": 0},
        rollout=even_token_rollout(tmp_path, n=2, response_length=8, temperature=1.0),
        trainer={"group_id": unique_name(trainer_group)},
    )


@contextlib.contextmanager
def bus_running(cfg: Config, tmp_path: Path) -> Iterator[tuple[Path, dict[str, Path]]]:
    """``cfg``'s topics made, then its replica (healthy), a session worker and a replay
    buffer running; yields the config file and the processes' logs."""
    config_path = tmp_path / "bus.yaml"
    with pipeline_running(cfg, config_path) as logs:
        yield config_path, logs
