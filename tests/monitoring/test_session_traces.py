"""Session traces from the turn log (rolloutbus/monitoring/session_traces.py): the attempts
of a resumed session, their OTLP JSON, and a POST to a receiver (a local HTTP server)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rolloutbus.errors import RolloutBusError
from rolloutbus.monitoring.session_traces import attempt_traces, otlp_traces, send_otlp
from rolloutbus.schemas.trace import TraceSpan
from rolloutbus.schemas.turns import Generation, SessionFinished, SessionStarted
from tests.builders import session_ids


def _generation(attempt: str, turn: int, replica: str, version: int) -> Generation:
    return Generation(
        **session_ids("u", 0, attempt),
        segment=0,
        turn=turn,
        token_ids=[1, 2, 3],
        replica=replica,
        policy_version=version,
        latency_s=0.5,
    )


def _killed_then_resumed() -> list[tuple[float, object]]:
    """Attempt a: turn 0 on replica r1 at version 3, then its worker dies. Attempt b resumes
    it: replays turn 0 from the log, calls a tool, samples turn 1 on r2 at version 4."""
    first, second = session_ids("u", 0, "a"), session_ids("u", 0, "b")
    spans = [
        TraceSpan(name="tool_call", start_ts=21.0, end_ts=21.5, attributes={"tool": "calc"}),
        TraceSpan(
            name="generate", start_ts=22.0, end_ts=23.0, attributes={"segment": 0, "turn": 1}
        ),
        TraceSpan(name="ToolAgentLoop.run", start_ts=20.0, end_ts=23.5),
    ]
    return [
        (10.0, SessionStarted(**first, agent_name="tool_agent")),
        (11.0, _generation("a", 0, "r1", 3)),
        (20.0, SessionStarted(**second, agent_name="tool_agent", resumed_from="a")),
        (20.1, _generation("b", 0, "r1", 3)),  # replayed as logged
        (23.0, _generation("b", 1, "r2", 4)),
        (23.6, SessionFinished(**second, outputs=[], spans=spans)),
    ]


def test_a_resumed_session_is_two_attempts_the_second_linked_to_the_first():
    killed, resumed = attempt_traces(_killed_then_resumed())  # type: ignore[arg-type]
    assert (killed.status, resumed.status) == ("unfinished", "finished")
    assert (killed.start_s, killed.end_s) == (10.0, 11.0)
    [logged] = killed.spans  # no terminal event: the logged generation is the span
    assert (logged.start_s, logged.end_s) == (10.5, 11.0)
    assert logged.attributes["replica"] == "r1" and logged.attributes["policy_version"] == 3
    assert resumed.resumed_from == "a" and resumed.replayed_turns == 1
    generate = next(s for s in resumed.spans if s.name == "generate")
    assert generate.attributes == {
        "segment": 0,
        "turn": 1,
        "replica": "r2",
        "policy_version": 4,
        "response_tokens": 3,
    }

    body = otlp_traces([killed, resumed])
    [resource] = body["resourceSpans"]
    spans = resource["scopeSpans"][0]["spans"]
    by_name = {s["name"]: s for s in spans}
    assert len(spans) == 1 + 2 + 1 + 3  # the session, two attempts, their spans
    assert len({s["traceId"] for s in spans}) == 1  # one trace per session
    root = by_name["session u_0"]
    assert "parentSpanId" not in root
    assert root["startTimeUnixNano"] == "10000000000" and root["endTimeUnixNano"] == "23600000000"
    first, second = by_name["attempt a"], by_name["attempt b"]
    assert first["parentSpanId"] == second["parentSpanId"] == root["spanId"]
    assert second["links"] == [{"traceId": root["traceId"], "spanId": first["spanId"]}]
    assert _attrs(second)["rolloutbus.resumed_from"] == {"stringValue": "a"}
    assert _attrs(second)["rolloutbus.replayed_turns"] == {"intValue": "1"}
    tool = by_name["tool_call"]
    assert tool["parentSpanId"] == second["spanId"]
    assert _attrs(tool)["rolloutbus.attempt"] == {"stringValue": "b"}
    generates = [s for s in spans if s["name"] == "generate"]
    assert sorted(_attrs(g)["replica"]["stringValue"] for g in generates) == ["r1", "r2"]
    assert otlp_traces([resumed, killed]) == body  # ids derive from the keys: stable


def _attrs(span: dict) -> dict:
    return {a["key"]: a["value"] for a in span["attributes"]}


def test_traces_are_posted_to_an_otlp_receiver_and_a_refusal_is_an_error():
    received: list[tuple[str, dict]] = []

    class Receiver(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append((self.path, body))
            self.send_response(200 if len(received) == 1 else 400)
            self.end_headers()
            self.wfile.write(b"{}" if len(received) == 1 else b"bad spans")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        traces = attempt_traces(_killed_then_resumed())  # type: ignore[arg-type]
        url = f"http://127.0.0.1:{server.server_port}"
        assert send_otlp(traces, url) == 7
        assert received[0] == ("/v1/traces", otlp_traces(traces))
        with pytest.raises(RolloutBusError, match="answered 400: bad spans"):
            send_otlp(traces, url + "/v1/traces")
    finally:
        server.shutdown()
        server.server_close()
