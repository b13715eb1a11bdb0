"""Reading the processes' /metrics directly (no Prometheus needed): for ``rolloutbus top``
and the demo's picture."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rolloutbus.config import Config

__all__ = ["Sample", "Scrape", "metrics_targets", "scrape_all"]

SCRAPE_TIMEOUT_S = 2.0  # seconds; a live process answers /metrics in milliseconds


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Scrape:
    """Every sample of every target at one moment, and which targets answered."""

    at: float
    samples: list[Sample] = field(default_factory=list)
    up: dict[str, bool] = field(default_factory=dict)  # job -> answered

    def values(self, name: str, **match: str) -> list[Sample]:
        return [
            s
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in match.items())
        ]

    def total(self, name: str, **match: str) -> float | None:
        """The sum of the matching samples; None when there is none."""
        found = self.values(name, **match)
        return sum(s.value for s in found) if found else None

    def by(self, name: str, label: str, **match: str) -> dict[str, float]:
        """Sum of the matching samples per value of ``label``."""
        out: dict[str, float] = {}
        for s in self.values(name, **match):
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0.0) + s.value
        return out


def metrics_targets(cfg: Config) -> dict[str, str]:
    """job → /metrics URL of every process the config gives a metrics port (the replicas
    always serve theirs on their API port)."""
    m = cfg.monitoring
    ports = {
        "sessions": (cfg.sessions.metrics_host, cfg.sessions.metrics_port),
        "replay-buffer": (cfg.replay_buffer.metrics_host, cfg.replay_buffer.metrics_port),
        "trainer": (cfg.trainer.metrics_host, cfg.trainer.metrics_port),
        "weight-sync": (m.metrics_host, m.weight_sync_metrics_port),
        "dispatch": (m.metrics_host, m.dispatch_metrics_port),
        "lag-exporter": (m.metrics_host, m.lag_exporter_port),
    }
    targets = {f"replica {url}": f"{url.rstrip('/')}/metrics" for url in cfg.replicas.urls}
    targets.update(
        {job: f"http://{host}:{port}/metrics" for job, (host, port) in ports.items() if port}
    )
    return targets


def scrape_all(targets: dict[str, str]) -> Scrape:
    """One scrape of every target; a target that does not answer is marked down."""
    scrape = Scrape(at=time.time())
    with httpx.Client(timeout=SCRAPE_TIMEOUT_S) as client:
        for job, url in targets.items():
            try:
                response = client.get(url)
                response.raise_for_status()
            except httpx.HTTPError:
                scrape.up[job] = False
                continue
            scrape.up[job] = True
            scrape.samples.extend(_samples(response.text, job))
    return scrape


def _samples(text: str, job: str) -> list[Sample]:
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.append(Sample(s.name, {**s.labels, "job": job}, float(s.value)))
    return out
