"""The workload of a fault run: G prompt groups of the seeded paced loop, n sessions each."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutbus.topics import trajectory_key

# the agent loop and reward the workers load by module name (their PYTHONPATH)
PLUGINS = Path(__file__).parent.parent / "plugins"
LOOP_NAME = "seededpaced"
LOOP_TARGET = "seeded_paced_loop.SeededPacedLoop"


@dataclass(frozen=True)
class Workload:
    """G prompt groups of ``tests/plugins/seeded_paced_loop.py``, n sessions each."""

    groups: int = 100
    n: int = 4
    turns: int = 3
    tokens_per_turn: int = 2
    tool_delay_s: float = 0.25  # seconds; a session waits this long between its turns

    def uids(self) -> list[str]:
        return [f"fault{i:05d}" for i in range(self.groups)]  # no "_": the key separator

    def expected_keys(self) -> set[str]:
        return {trajectory_key(uid, sid, 0) for uid in self.uids() for sid in range(self.n)}

    @property
    def sessions(self) -> int:
        return self.groups * self.n

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "uid": uid,
                "__rollout_n__": self.n,
                "data_source": "faults",
                "agent_name": LOOP_NAME,
                "prompt": [{"role": "user", "content": f"count to {i}"}],
                "extra_info": {
                    "index": i,
                    "turns": self.turns,
                    "tokens_per_turn": self.tokens_per_turn,
                    "tool_delay_s": self.tool_delay_s,
                },
            }
            for i, uid in enumerate(self.uids())
        ]
