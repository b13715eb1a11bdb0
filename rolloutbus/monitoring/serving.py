"""/metrics for the dispatcher (the weight sync serves its registry with
``rolloutbus.metrics.serve_metrics``)."""

from __future__ import annotations

from rolloutbus.config import Config
from rolloutbus.metrics import serve_metrics
from rolloutbus.producers.dispatch import Dispatcher
from rolloutbus.producers.dispatch_metrics import DispatchCollector


def serve_dispatch_metrics(cfg: Config, dispatcher: Dispatcher) -> bool:
    """Serve the dispatcher's progress on ``monitoring.dispatch_metrics_port`` (if set)."""
    collector = DispatchCollector(
        lambda: getattr(dispatcher, "report", None), dispatcher.waiting.is_set
    )
    return serve_metrics(
        cfg.monitoring.dispatch_metrics_port, cfg.monitoring.metrics_host, collector
    )
