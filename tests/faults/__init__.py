"""A fault injector for the whole pipeline: real processes, one fault scenario, one table row.

A run starts, on its own topic prefix, one embedded replica (tiny-qwen3), M replay buffers
and K session workers through the ``rolloutbus`` command line; publishes G prompt groups
of ``tests/plugins/seeded_paced_loop.py`` (n sessions each); hands the running processes
and the broker to a *scenario* (a callable that kills, restarts, adds processes or stops
the broker); waits until every trajectory key arrived on rollout.trajectories and the
replay buffer has folded the whole turn log; stops everything and measures the row
(``measure.py`` says what each column counts).

One module per job:

- ``workload``: the prompt groups of a run;
- ``services``: one supervised ``rolloutbus`` process, restarted when it exits;
- ``processes``: the pipeline of those processes, its config, and the topic reads that
  follow its progress;
- ``scenario``: what a scenario gets (``FaultContext``) and the common faults;
- ``broker_control``: a broker of the scenario's own, restarted or SIGKILLed;
- ``run``: one run from start to measurement (``run_fault_scenario``);
- ``measure``: the row's numbers, from the topics;
- ``table``: the row and the table printed at the end of the test session.

This is a fault injector: it stands in for the operators and machines that kill
processes in production. Nothing in it is a test double of the product.

**Comparing with a fault-free run.** Every turn of the fixture loop asks the replica for
a seed derived from (uid, session_id, turn), and the rows carry their own ``uid`` column,
so a fault run and the reference publish the same uids and every turn, sampled once or
again after a crash, gets the same tokens. The embedded replica is not batch-invariant:
a row's logits depend on what else is in its decode batch (float summation order and
left padding), measured on tiny-qwen3 with 24 seeded requests: max_batch_size 1 twice
gave bit-identical tokens and logprobs; max_batch_size 8 against 1 changed logprobs of
17/24 requests (by up to 1e-6, or 0.14 where a token changed) and the tokens of 1/24.
So the runs use ``replica_server.max_batch_size: 1``. Every trajectory column is
compared except ``attempt``: attempt ids are random by design (a resumed or re-run
session gets a fresh one, and so does every session of every run).
"""

from tests.faults.broker_control import dedicated_broker, kill_broker, restart_broker
from tests.faults.measure import explain_lost, release_stall, turn_log_counts
from tests.faults.processes import WORKER_ENV, Pipeline
from tests.faults.run import FaultRun, run_fault_scenario
from tests.faults.scenario import (
    FaultContext,
    Scenario,
    ScenarioTimeout,
    at_spread_moments,
    sigkill_spread,
)
from tests.faults.services import Service
from tests.faults.table import ROWS, FaultRow, format_table
from tests.faults.workload import PLUGINS, Workload

__all__ = [
    "PLUGINS",
    "ROWS",
    "WORKER_ENV",
    "FaultContext",
    "FaultRow",
    "FaultRun",
    "Pipeline",
    "Scenario",
    "ScenarioTimeout",
    "Service",
    "Workload",
    "at_spread_moments",
    "dedicated_broker",
    "explain_lost",
    "format_table",
    "kill_broker",
    "release_stall",
    "restart_broker",
    "run_fault_scenario",
    "sigkill_spread",
    "turn_log_counts",
]
