"""The weight sync's ``PolicyVersionApplied`` under the broker's ACLs: the ``weight_sync``
role may write ``rollout.control`` (rolloutbus/broker/acls.py), and a principal that may
not (a misconfigured cluster) gets one clear error and no more tries, while the weight sync
goes on. A broker of its own with SASL and ACLs (tests/kafka/test_security.py's)."""

from __future__ import annotations

import pytest

from rolloutbus.schemas.control import PolicyVersionPublished
from rolloutbus.streams.inference.weight_sync_applied import AppliedAnnouncer
from tests.kafka.test_security import _as, _rollout, sasl_broker  # noqa: F401  # the fixture

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def test_the_weight_sync_role_announces_a_version_applied(sasl_broker):  # noqa: F811
    announcer = AppliedAnnouncer(_as(_rollout(sasl_broker), "weight_sync"))
    current = PolicyVersionPublished(policy_version=1, weights_path="/w/1")
    try:
        event = announcer.announce_if_served(current, {"http://r0": 1})
    finally:
        announcer.close()
    assert event is not None and event.policy_version == 1
    assert not announcer.refused


def test_a_refused_announcement_turns_the_announcer_off(sasl_broker, caplog):  # noqa: F811
    # the publisher may read rollout.control but not write it: as a cluster whose ACLs
    # predate the weight_sync role's WRITE grant would refuse the weight sync
    announcer = AppliedAnnouncer(_as(_rollout(sasl_broker), "publisher"))
    current = PolicyVersionPublished(policy_version=1, weights_path="/w/1")
    assert announcer.announce_if_served(current, {"http://r0": 1}) is None
    assert announcer.refused
    assert "grant the weight_sync role WRITE" in caplog.text
    # later versions are not tried again
    later = PolicyVersionPublished(policy_version=2, weights_path="/w/2")
    assert announcer.announce_if_served(later, {"http://r0": 2}) is None
    announcer.close()
