"""The fault harness's public names, where fault-row modules have always imported them.

The harness itself is the package ``tests/faults/`` (one module per job: workload,
services, processes, scenario, broker_control, run, measure, table); this module only
re-exports it, so ``from faults_harness import Workload, run_fault_scenario, ...`` keeps
working in every ``tests/test_faults*.py``.
"""

from tests.faults import (
    PLUGINS,
    ROWS,
    WORKER_ENV,
    FaultContext,
    FaultRow,
    FaultRun,
    Pipeline,
    Scenario,
    ScenarioTimeout,
    Service,
    Workload,
    at_spread_moments,
    dedicated_broker,
    explain_lost,
    format_table,
    kill_broker,
    release_stall,
    restart_broker,
    run_fault_scenario,
    sigkill_spread,
    turn_log_counts,
)

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
