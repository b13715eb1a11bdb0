"""Pure tests of the rules every reader of rollout.control follows (no broker): the newest
run wins, a version never goes backwards inside a run, a version above 0 names its
weights, and records written before runs existed still decode (run epoch 0)."""

from __future__ import annotations

import warnings

import pytest
from pydantic import ValidationError

from rolloutbus.kafka.version_ledger import (
    DEAD_LETTER_REASONS,
    Refusal,
    VersionLedger,
    supersedes,
)
from rolloutbus.schemas.control import (
    PolicyVersionPublished,
    RunStarted,
    decode_control_event,
    encode_control_event,
)


def _run(epoch: int, run_id: str | None = None) -> RunStarted:
    return RunStarted(run_id=run_id or f"run{epoch}", run_epoch=epoch)


def _v(
    version: int, run: RunStarted | None = None, path: str | None = ""
) -> PolicyVersionPublished:
    return PolicyVersionPublished(
        policy_version=version,
        weights_path=f"/ckpt/{run.run_id if run else 'legacy'}/v{version}" if path == "" else path,
        run_id=run.run_id if run else "",
        run_epoch=run.run_epoch if run else 0,
    )


def _fold(ledger: VersionLedger, *events) -> list[Refusal | None]:
    return [ledger.fold(e).refusal for e in events]


def test_a_record_written_before_runs_existed_decodes_as_run_epoch_0():
    # the exact bytes release 1 wrote (no run_id / run_epoch fields)
    old = (
        b'{"schema_version":1,"type":"policy_version","policy_version":3,'
        b'"weights_path":"/ckpt/v3","global_step":3,"trainer_id":"t","published_at":1.0,'
        b'"model_name":"tiny-qwen3"}'
    )
    event = decode_control_event(old)
    assert isinstance(event, PolicyVersionPublished)
    assert (event.policy_version, event.run_id, event.run_epoch) == (3, "", 0)
    stray = decode_control_event(b'{"policy_version": 7}')  # no type either
    assert isinstance(stray, PolicyVersionPublished) and stray.weights_path is None
    run = _run(2)
    assert decode_control_event(encode_control_event(run)) == run
    for junk in (b"not json", b'{"type": "pause_lease"}', b"[1]", b'{"policy_version": -1}'):
        with pytest.raises(ValidationError):
            decode_control_event(junk)


def test_the_newest_run_wins_and_an_older_runs_records_are_ignored_and_counted():
    ledger = VersionLedger()
    run1, run2 = _run(1), _run(2)
    assert _fold(ledger, _v(0), _v(4)) == [None, None]  # before runs: epoch 0
    assert ledger.current is not None and ledger.current.policy_version == 4
    assert _fold(ledger, run1, _v(0, run1), _v(1, run1), _v(2, run1)) == [None] * 4
    assert (ledger.run_epoch, ledger.current.policy_version) == (1, 2)
    # run 2 starts at version 0 again: its version 0 is current, run 1's later records not
    assert _fold(ledger, run2, _v(0, run2), _v(3, run1), _v(9)) == [
        None,
        None,
        Refusal.OLDER_RUN,
        Refusal.OLDER_RUN,
    ]
    assert (ledger.run_id, ledger.current.run_epoch, ledger.current.policy_version) == (
        "run2",
        2,
        0,
    )
    assert ledger.fold(run1).refusal is Refusal.OLDER_RUN  # a zombie's late RunStarted
    assert ledger.refused == {Refusal.OLDER_RUN: 3}
    assert Refusal.OLDER_RUN not in DEAD_LETTER_REASONS  # history, not an error


def test_inside_a_run_a_version_never_goes_backwards():
    ledger = VersionLedger()
    run = _run(1)
    _fold(ledger, run, _v(0, run), _v(2, run))
    verdict = ledger.fold(_v(1, run))
    assert verdict.refusal is Refusal.BACKWARDS and verdict.dead_letter
    assert "1 after 2" in verdict.detail
    assert ledger.current is not None and ledger.current.policy_version == 2
    # the same version again changes nothing; from another folder it is applied again
    assert ledger.fold(_v(2, run)).changed is False
    assert ledger.fold(_v(2, run, path="/elsewhere")).changed is True


def test_a_version_without_weights_cannot_relabel_and_runs_are_announced_first():
    ledger = VersionLedger()
    stray = decode_control_event(b'{"policy_version": 7}')
    assert ledger.fold(stray).refusal is Refusal.NO_WEIGHTS
    assert ledger.current is None
    assert ledger.fold(_v(0, path=None)).changed  # version 0 without weights: a relabel
    # a version of a run no RunStarted announced, and a second run claiming an epoch
    run = _run(1)
    assert ledger.fold(_v(1, run)).refusal is Refusal.UNKNOWN_RUN
    _fold(ledger, run)
    assert ledger.fold(_run(1, "impostor")).refusal is Refusal.CONFLICTING_RUN
    other = _v(1, _run(1, "impostor"))
    assert ledger.fold(other).refusal is Refusal.CONFLICTING_RUN
    assert ledger.malformed("junk").refusal is Refusal.MALFORMED
    assert ledger.fold(_v(1, run)).changed  # the run's own version 1
    assert ledger.refused[Refusal.MALFORMED] == 1
    assert all(r in DEAD_LETTER_REASONS for r in ledger.refused if r is not Refusal.OLDER_RUN)


def test_what_supersedes_the_applied_version():
    run1, run2 = _run(1), _run(2)
    assert supersedes(_v(0, run1), None)
    assert supersedes(_v(0, run2), _v(5, run1))  # a newer run, at a lower version
    assert not supersedes(_v(5, run1), _v(0, run2))
    assert supersedes(_v(3, run1), _v(2, run1)) and not supersedes(_v(2, run1), _v(3, run1))
    assert not supersedes(_v(2, run1), _v(2, run1))
    assert supersedes(_v(2, run1, path="/other"), _v(2, run1))


def test_the_old_import_path_of_the_trainer_client_still_works_with_a_warning():
    import importlib
    import sys

    sys.modules.pop("rolloutbus.consumers.trainer", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("rolloutbus.consumers.trainer")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    from rolloutbus.consumers import TrainerClient, TrajectoryGroup

    assert old.TrainerClient is TrainerClient and old.TrajectoryGroup is TrajectoryGroup
