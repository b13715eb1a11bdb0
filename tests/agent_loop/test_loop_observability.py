"""What a session tells beyond its tokens, and the verl knobs around the loop: trace spans
(verl's ``rollout_trace_op``), verl's per-step ``agent_loop/*`` metrics, the plug-in router
(``rollout.router_config_path``) and the ``data`` keys a loop renders with."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from rolloutbus.config import load_config
from rolloutbus.errors import ConfigError
from rolloutbus.schemas.agent_loop import AgentLoopMetrics
from rolloutbus.schemas.trajectories import trajectories_to_batch
from rolloutbus.streams.agent_loop import DictConfigWrap, ToolAgentLoop
from rolloutbus.streams.agent_loop.metrics import (
    agent_loop_step_metrics,
    step_metrics_of_batch,
)
from rolloutbus.streams.agent_loop.tools import CalculatorTool
from rolloutbus.streams.agent_loop.tracing import (
    collect_spans,
    export_to_opentelemetry,
    opentelemetry_available,
    rollout_trace_op,
    trace_span,
)
from rolloutbus.streams.inference.routing import LoadBalancer, load_balancer
from tests.builders import make_trajectory
from tests.scripted_server import (
    ScriptedServerManager,
    make_config,
    scripted_turn,
)

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "18 * 7"}}\n</tool_call>'


def _turn(tok, text):
    return scripted_turn(
        tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    )


# ---- trace spans ------------------------------------------------------------------------


async def test_a_tool_loop_run_records_its_run_and_tool_spans(tok):
    server = ScriptedServerManager([_turn(tok, CALL), _turn(tok, "126")])
    loop = ToolAgentLoop(DictConfigWrap(make_config()), server, tok, None, tools=[CalculatorTool()])
    with collect_spans() as spans:
        await loop.run({}, raw_prompt=[{"role": "user", "content": "18 * 7?"}])
    names = [s.name for s in spans]
    assert names == ["tool_call", "ToolAgentLoop.run"]  # a span ends after what it holds
    tool, run = spans
    assert tool.attributes == {"tool": "calculator"} and tool.status == "ok"  # reward None
    assert run.start_ts <= tool.start_ts <= tool.end_ts <= run.end_ts


async def test_spans_outside_a_session_are_dropped_and_errors_are_marked():
    @rollout_trace_op
    async def boom():
        raise RuntimeError("no")

    await rollout_trace_op(_noop)()  # no collector: nothing recorded, nothing raised
    with collect_spans() as spans:
        with pytest.raises(RuntimeError):
            await boom()
        with trace_span("later", n=1) as extra:
            extra["size"] = [1, 2]  # a value OpenTelemetry cannot take is kept as text
    assert [(s.name, s.status) for s in spans] == [
        ("test_spans_outside_a_session_are_dropped_and_errors_are_marked.<locals>.boom", "error"),
        ("later", "ok"),
    ]
    assert spans[0].error == "RuntimeError: no" and spans[1].attributes == {
        "n": 1,
        "size": "[1, 2]",
    }


async def _noop():
    return None


def test_opentelemetry_export_needs_the_package(monkeypatch):
    from rolloutbus.streams.agent_loop import tracing

    def missing():
        raise ModuleNotFoundError("No module named 'opentelemetry'")

    monkeypatch.setattr(tracing, "_otel_trace", missing)  # as where it is not installed
    assert not opentelemetry_available()
    with pytest.raises(ImportError, match="pip install opentelemetry-api opentelemetry-sdk"):
        export_to_opentelemetry([], session="u_0")


def test_opentelemetry_export_of_a_sessions_spans():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from rolloutbus.schemas.trace import TraceSpan

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = [TraceSpan(name="generate", start_ts=1.0, end_ts=2.5, attributes={"turn": 0})]
    assert export_to_opentelemetry(spans, session="u_0", tracer_provider=provider) == 1
    exported = {s.name: s for s in exporter.get_finished_spans()}
    assert set(exported) == {"u_0", "generate"}
    assert exported["generate"].parent.span_id == exported["u_0"].context.span_id
    assert exported["generate"].end_time - exported["generate"].start_time == 1_500_000_000


# ---- verl's per-step agent_loop/* metrics ------------------------------------------------


def test_step_metrics_have_verls_names_and_pick_the_slowest():
    metrics = [
        AgentLoopMetrics(
            generate_sequences=1.0, tool_calls=0.5, compute_score=0.1, num_preempted=0
        ),
        AgentLoopMetrics(
            generate_sequences=3.0, tool_calls=0.0, compute_score=0.2, num_preempted=2
        ),
        AgentLoopMetrics(
            generate_sequences=2.0, tool_calls=1.5, compute_score=0.0, num_preempted=1
        ),
    ]
    out = agent_loop_step_metrics(metrics, [10, 20, 30], [5, 6, 7])
    assert out["agent_loop/generate_sequences/mean"] == pytest.approx(2.0)
    assert out["agent_loop/tool_calls/max"] == 1.5 and out["agent_loop/num_preempted/min"] == 0
    # the slowest by generate + tools + score: 3.5 (the third) beats 3.2 (the second)
    assert out["agent_loop/slowest/generate_sequences"] == 2.0
    assert out["agent_loop/slowest/prompt_length"] == 30
    assert out["agent_loop/slowest/response_length"] == 7
    assert agent_loop_step_metrics([]) == {}


def test_step_metrics_of_a_trajectory_batch_leave_failed_records_out():
    def trajectory(i, status, generate):
        return make_trajectory(
            "u",
            i,
            group_size=2,
            status=status,
            prompts=[1] * (i + 2),
            responses=[2] * (i + 1),
            metrics=AgentLoopMetrics(generate_sequences=generate, num_preempted=0),
        )

    batch = trajectories_to_batch([trajectory(0, "completed", 1.5), trajectory(1, "failed", 0.0)])
    out = step_metrics_of_batch(batch)
    assert out["agent_loop/generate_sequences/min"] == 1.5  # the failed record's 0.0 is out
    assert out["agent_loop/slowest/prompt_length"] == 2
    assert step_metrics_of_batch(pa.Table.from_batches([batch])) == out


# ---- the plug-in router ------------------------------------------------------------------


class FirstReplicaRouter(LoadBalancer):
    """A plug-in router: every trajectory to the first healthy replica (and it keeps the
    YAML it was built with)."""

    def __init__(self, replica_ids, router_config):
        super().__init__(replica_ids)
        self.router_config = router_config

    def acquire(self, request_id: str) -> str:
        replica = self.healthy_replicas[0]
        self._in_flight[replica] += 1
        return replica


def test_router_config_path_builds_the_named_router(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(f"router_class: {__name__}.FirstReplicaRouter\nweight: 3\n")
    balancer = load_balancer(["http://a", "http://b"], router_config_path=str(path))
    assert isinstance(balancer, FirstReplicaRouter)
    assert balancer.router_config == {"router_class": f"{__name__}.FirstReplicaRouter", "weight": 3}
    assert {balancer.acquire(f"r{i}") for i in range(5)} == {"http://a"}
    default = load_balancer(["http://a", "http://b"], rng=random.Random(0))
    assert type(default) is LoadBalancer


@pytest.mark.parametrize(
    "text, message",
    [
        (None, "Router config file not found"),
        ("weight: 3\n", "must contain 'router_class'"),
        ("router_class: json.JSONDecoder\n", "is not a subclass of .*LoadBalancer"),
        ("router_class: no_such.Router\n", "cannot load router .* no module named 'no_such'"),
        ("defaults: [x]\nrouter_class: a.B\n", "Hydra 'defaults' block"),
    ],
)
def test_a_bad_router_config_is_a_config_error_naming_it(tmp_path, text, message):
    path = tmp_path / "router.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_balancer(["http://a"], router_config_path=str(path))


# ---- the data keys a loop renders with ---------------------------------------------------


async def test_verls_template_and_processor_kwargs_are_read_not_dropped(tmp_path, tok):
    path = tmp_path / "verl.yaml"
    path.write_text(
        "data:\n"
        "  apply_chat_template_kwargs: {enable_thinking: false}\n"
        "  mm_processor_kwargs: {max_pixels: 1024}\n"
        "actor_rollout_ref:\n"
        "  rollout:\n"
        "    enable_rollout_routing_replay: true\n"
        f"    router_config_path: {tmp_path / 'router.yaml'}\n"
    )
    cfg = load_config(path)
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}
    assert cfg.data.mm_processor_kwargs == {"max_pixels": 1024}
    assert cfg.rollout.enable_rollout_routing_replay is True
    assert cfg.rollout.router_config_path == str(tmp_path / "router.yaml")
    server = ScriptedServerManager([_turn(tok, "hi")])
    loop = ToolAgentLoop(DictConfigWrap(cfg), server, tok, None, tools=[])
    assert loop.mm_processor_kwargs == {"max_pixels": 1024}
    prompt = loop.continuous_token_builder.build_initial_tokens([{"role": "user", "content": "hi"}])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
