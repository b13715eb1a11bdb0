"""Policy versions on ``rollout.control``: the one import path for reading and writing them.

* reading (``control_reader``): :func:`latest_policy_version`, :func:`read_control_log`,
  :class:`PolicyVersionFollower`: the newest run's current version, by the rules of
  ``version_ledger`` (the newest run wins; inside a run a version only moves forward);
* writing (``control_writer``): :class:`TrainerControlWriter` (the trainer's fenced,
  transactional writer: ``RunStarted``, then the run's versions),
  :class:`PolicyVersionPublisher` and :func:`publish_policy_version` (unfenced, as given).

The topic has one partition (``admin.CONTROL_PARTITIONS``), compacted, with records keyed
by event type and run epoch (``topics.control_key``), so the latest version of every run
is kept and any process that starts reads the current one from the log.
"""

from __future__ import annotations

from rolloutbus.kafka.control_reader import (
    CONTROL_DEAD_LETTER_GROUP,
    PolicyVersionFollower,
    latest_policy_version,
    read_control_log,
)
from rolloutbus.kafka.control_writer import (
    PolicyVersionPublisher,
    TrainerControlWriter,
    publish_policy_version,
    trainer_transactional_id,
)

__all__ = [
    "CONTROL_DEAD_LETTER_GROUP",
    "PolicyVersionFollower",
    "PolicyVersionPublisher",
    "TrainerControlWriter",
    "latest_policy_version",
    "publish_policy_version",
    "read_control_log",
    "trainer_transactional_id",
]
