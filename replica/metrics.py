"""The replica's Prometheus series, vLLM's names under ``rolloutbus_replica_*`` (served on
its API port, ``GET /metrics``): engine gauges and counters read at scrape time, and
per-request histograms observed when a request finishes. Help texts end in ``; unit``
(docs/reference/metrics.md is generated from them)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from rolloutbus.replica.generation import Engine, GenerationResult

METRIC_PREFIX = "rolloutbus_replica"
# seconds; CPU decoding: a 16-token tiny-model reply takes ~0.05 s, a 512-token SmolLM2 one ~60 s
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
# seconds; a prefill on CPU: ~10 ms for a short prompt, seconds behind a long queue
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows per decode step


class EngineCollector:
    """Engine-side gauges, counters and the batch-size histogram, read at scrape time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        stats, model = self.engine.stats, [self.engine.model_name]
        yield _gauge(
            "requests_running", "Requests in the decode batch; requests", stats.running, model
        )
        yield _gauge(
            "requests_waiting", "Requests queued for a batch slot; requests", stats.waiting, model
        )
        yield _counter(
            "prompt_tokens", "Prefilled prompt tokens; tokens", stats.prompt_tokens, model
        )
        yield _counter(
            "generation_tokens", "Sampled tokens; tokens", stats.generation_tokens, model
        )
        yield _counter(
            "num_preemptions",
            "Preemptions (always 0: the engine never preempts); preemptions",
            stats.preemptions,
            model,
        )
        yield _counter("decode_steps", "Decode steps run; steps", stats.steps, model)
        gate = self.engine.pause_gate
        yield _gauge(
            "paused", "1 while paused (POST /pause), else 0; boolean", int(gate.is_paused), model
        )
        yield _counter(
            "pause_lease_expiries",
            "Pauses ended by their lease: the weight sync that paused stopped renewing it; pauses",
            gate.lease_expiries,
            model,
        )
        # dict() copies under the GIL: the decode thread may add a key meanwhile.
        yield self._batch_histogram(dict(stats.batch_sizes), model)

    @staticmethod
    def _batch_histogram(sizes: dict[int, int], model: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            f"{METRIC_PREFIX}_batch_size", "Rows per decode step; rows", labels=["model_name"]
        )
        buckets = [
            (str(float(b)), sum(n for s, n in sizes.items() if s <= b)) for b in BATCH_BUCKETS
        ]
        buckets.append(("+Inf", sum(sizes.values())))
        family.add_metric(model, buckets, sum_value=float(sum(s * n for s, n in sizes.items())))
        return family


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"{METRIC_PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, value: float, labels: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"{METRIC_PREFIX}_{name}", doc, labels=["model_name"])
    family.add_metric(labels, value)
    return family


class RequestMetrics:
    """Per-request metrics, observed when a request finishes."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        p = METRIC_PREFIX
        self.success = Counter(
            f"{p}_request_success",
            "Finished requests; requests",
            ["model_name", "finished_reason"],
            registry=registry,
        )
        self.errors = Counter(
            f"{p}_request_errors",
            "Requests answered with an HTTP error; requests",
            ["model_name", "code"],
            registry=registry,
        )
        self.e2e = Histogram(
            f"{p}_e2e_request_latency_seconds",
            "Submit to last token; seconds",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.ttft = Histogram(
            f"{p}_time_to_first_token_seconds",
            "Submit to first token; seconds",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.queue = Histogram(
            f"{p}_request_queue_time_seconds",
            "Submit to prefill; seconds",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )

    def observe(self, result: GenerationResult) -> None:
        m = self.model_name
        self.success.labels(m, result.finish_reason).inc()
        self.e2e.labels(m).observe(result.timings.e2e_s)
        self.ttft.labels(m).observe(result.timings.ttft_s)
        self.queue.labels(m).observe(result.timings.queue_s)
