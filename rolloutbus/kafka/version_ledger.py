"""Which policy version is current: the rules every reader of ``rollout.control`` follows.

A :class:`VersionLedger` folds the control records in log order (pure: no Kafka) into the
newest run and that run's current version. Every reader uses one (the weight sync, the
dispatcher, the trainer client's staleness filter, ``latest_policy_version``), so they all
agree on what is current:

* the newest run wins: a record of an older ``run_epoch`` is ignored (counted, never an
  error: a superseded trainer's last words); a ``RunStarted`` of a newer epoch starts a
  run with no version yet, and the trainer publishes its first version in the same
  transaction;
* inside a run a version only moves forward: one below the current version is an error
  (``backwards``), the same version again with the same weights changes nothing;
* a version above 0 without ``weights_path`` is refused (``no_weights``): it would relabel
  a replica's weights without changing them (a stray ``{"policy_version": 7}``);
* a version of an epoch above the newest run that no ``RunStarted`` announced is refused
  (``unknown_run``), and so is a second run claiming an epoch already taken
  (``conflicting_run``): the trainer writes ``RunStarted`` first, fenced;
* a record that is no control event at all is ``malformed``;
* ``PolicyVersionApplied`` (the weight sync's "every replica serves it") changes nothing.

Records without run fields (written before runs existed) are run epoch 0: they still
follow these rules among themselves, and any run supersedes them.

Every refusal but ``older_run`` is a dead letter (``DEAD_LETTER_REASONS``); the weight sync
writes them (``PolicyVersionFollower(dead_letters=True)``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

from rolloutbus.schemas.control import (
    AnyControlEvent,
    PolicyVersionApplied,
    PolicyVersionPublished,
    RunStarted,
)

__all__ = ["DEAD_LETTER_REASONS", "Refusal", "Verdict", "VersionLedger", "supersedes"]


class Refusal(StrEnum):
    """Why a control record was not taken (a metric label and a dead letter's reason)."""

    OLDER_RUN = "older_run"
    BACKWARDS = "backwards"
    NO_WEIGHTS = "no_weights"
    UNKNOWN_RUN = "unknown_run"
    CONFLICTING_RUN = "conflicting_run"
    MALFORMED = "malformed"


# refusals that are errors (dead-lettered); an older run's records are history, not errors
DEAD_LETTER_REASONS = frozenset(Refusal) - {Refusal.OLDER_RUN}


@dataclass(frozen=True)
class Verdict:
    """What one record did: ``changed`` when the current run or version moved."""

    changed: bool
    refusal: Refusal | None = None
    detail: str = ""

    @property
    def dead_letter(self) -> bool:
        return self.refusal in DEAD_LETTER_REASONS


UNCHANGED = Verdict(changed=False)
CHANGED = Verdict(changed=True)


class VersionLedger:
    """The newest run and its current version, from the control records seen so far."""

    def __init__(self) -> None:
        self.run_epoch = 0  # records without a run are epoch 0
        self.run: RunStarted | None = None  # the newest run's start record; None: epoch 0
        self.current: PolicyVersionPublished | None = None  # the newest run's version
        self.refused: Counter[Refusal] = Counter()

    @property
    def run_id(self) -> str:
        return self.run.run_id if self.run is not None else ""

    def fold(self, event: AnyControlEvent) -> Verdict:
        if isinstance(event, PolicyVersionApplied):
            return UNCHANGED  # the weight sync's report (add-only): it moves no version
        verdict = (
            self._fold_run(event) if isinstance(event, RunStarted) else self._fold_version(event)
        )
        if verdict.refusal is not None:
            self.refused[verdict.refusal] += 1
        return verdict

    def malformed(self, detail: str) -> Verdict:
        """Count a record that is not a control event."""
        self.refused[Refusal.MALFORMED] += 1
        return Verdict(False, Refusal.MALFORMED, f"not a control event: {detail}")

    def _fold_run(self, run: RunStarted) -> Verdict:
        if run.run_epoch < self.run_epoch:
            return self._older(run.run_epoch)
        if run.run_epoch == self.run_epoch:
            if run.run_id == self.run_id:
                return UNCHANGED  # the same record again (a re-read)
            return Verdict(
                False,
                Refusal.CONFLICTING_RUN,
                f"run {run.run_id!r} claims run epoch {run.run_epoch}, which run "
                f"{self.run_id!r} already holds",
            )
        self.run_epoch, self.run, self.current = run.run_epoch, run, None
        return CHANGED

    def _fold_version(self, event: PolicyVersionPublished) -> Verdict:
        if event.policy_version > 0 and event.weights_path is None:
            return Verdict(
                False,
                Refusal.NO_WEIGHTS,
                f"policy version {event.policy_version} names no weights_path: a version "
                "above 0 must name the weights it labels",
            )
        if event.run_epoch < self.run_epoch:
            return self._older(event.run_epoch)
        if event.run_epoch > self.run_epoch:
            return Verdict(
                False,
                Refusal.UNKNOWN_RUN,
                f"policy version {event.policy_version} of run epoch {event.run_epoch}, "
                f"which no run_started announced (newest run epoch: {self.run_epoch})",
            )
        if self.run is not None and event.run_id != self.run.run_id:
            return Verdict(
                False,
                Refusal.CONFLICTING_RUN,
                f"policy version {event.policy_version} says run {event.run_id!r}, but run "
                f"epoch {event.run_epoch} is run {self.run.run_id!r}",
            )
        return self._forward(event)

    def _forward(self, event: PolicyVersionPublished) -> Verdict:
        current = self.current
        if current is not None and event.policy_version < current.policy_version:
            return Verdict(
                False,
                Refusal.BACKWARDS,
                f"policy version {event.policy_version} after {current.policy_version} in run "
                f"epoch {event.run_epoch}: versions of a run only move forward",
            )
        if (
            current is not None
            and event.policy_version == current.policy_version
            and event.weights_path == current.weights_path
        ):
            return UNCHANGED  # republished: nothing to do
        self.current = event
        return CHANGED

    def _older(self, epoch: int) -> Verdict:
        return Verdict(
            False,
            Refusal.OLDER_RUN,
            f"run epoch {epoch} is older than the newest run's ({self.run_epoch})",
        )


def supersedes(event: PolicyVersionPublished, current: PolicyVersionPublished | None) -> bool:
    """Whether ``event`` replaces ``current`` for whoever applies versions: a newer run, or a
    later version of the same run, or the same version republished with other weights."""
    if current is None:
        return True
    if event.run_epoch != current.run_epoch:
        return event.run_epoch > current.run_epoch
    if event.policy_version != current.policy_version:
        return event.policy_version > current.policy_version
    return event.weights_path != current.weights_path
