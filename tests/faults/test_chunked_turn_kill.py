"""SIGKILL a session worker in the middle of long turns logged in chunks
(``sessions.chunk_tokens``): the resumed sessions go on from their logged chunks, so each
in-flight session samples again at most one chunk, and every trajectory is released once.

Real processes throughout (``tests/faults/``: broker, embedded replica with tiny-qwen3's
random weights, a supervised session worker, a replay buffer); the loop is the seeded paced
loop with ``ignore_eos`` turns of ``TOKENS`` tokens.

Tokens sampled again: the replica's ``generation_tokens`` counter minus the tokens of the
released turns (what the killed worker's requests sampled and never logged), counted per
in-flight session.
"""

from __future__ import annotations

import signal
import time
from collections import defaultdict
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.turns import Generation, GenerationChunk, decode_turn_event
from tests.faults import Pipeline, Workload

pytestmark = pytest.mark.slow

TOKENS = 1024  # tokens per turn: a long reasoning turn, ignore_eos
CHUNK = 64  # sessions.chunk_tokens
N = 2  # sessions, all in flight when the worker is killed
CHUNKS_BEFORE_KILL = 3  # every session has logged this many chunks when the kill comes
# Tokens a session may cost beyond its chunk per takeover: what the replica samples while
# the worker writes a full chunk and after the worker dies, until the hang-up aborts the
# request (a streamed turn runs on; 131 for 2 x 64 once, in a full-suite run on 12-05)
CANCEL_SLACK = CHUNK // 4
DEADLINE_S = 480.0  # seconds for the turns to be logged in chunks, and to be released (a
# loaded machine streamed tiny-qwen3 at 2-6 tokens/s: 240 s ran out once in 10 under load 16)
POLL_S = 0.2


def replica_generated_tokens(pipeline: Pipeline) -> int:
    """The replica's count of tokens it sampled (its /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{pipeline.port}/metrics", timeout=10).text
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.endswith("generation_tokens_total")
        )
    )


def _turn_events(pipeline: Pipeline) -> list[Any]:
    cfg = pipeline.cfg
    return [
        decode_turn_event(msg.value() or b"")
        for part in range(cfg.kafka.partitions)
        for msg in read_partition(cfg.kafka, pipeline.topics.turns, part, 0)
    ]


def _wait_for(what: str, ready: Any, pipeline: Pipeline) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not ready():
        if time.monotonic() > deadline:
            logs = "\n".join(s.log_tail() for s in pipeline.services())
            raise AssertionError(f"{what} did not happen in {DEADLINE_S:g} s\n{logs}")
        time.sleep(POLL_S)


def _chunks_per_session(pipeline: Pipeline) -> dict[int, int]:
    chunks: dict[int, int] = defaultdict(int)
    for event in _turn_events(pipeline):
        if isinstance(event, GenerationChunk):
            chunks[event.session_id] += 1
        elif isinstance(event, Generation):
            chunks[event.session_id] = -(10**6)  # a whole turn logged: killed too late
    return chunks


def test_a_killed_worker_samples_again_at_most_one_chunk_per_session(
    kafka_bootstrap: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # every process of the pipeline reads these (Service copies os.environ)
    monkeypatch.setenv("ROLLOUTBUS__SESSIONS__CHUNK_TOKENS", str(CHUNK))
    monkeypatch.setenv("ROLLOUTBUS__ROLLOUT__RESPONSE_LENGTH", str(TOKENS))
    workload = Workload(groups=1, n=N, turns=1, tokens_per_turn=TOKENS, tool_delay_s=0.0)
    pipeline = Pipeline(kafka_bootstrap, tmp_path, partitions=1, concurrency=2, replica_batch=N)
    try:
        pipeline.start()
        before = replica_generated_tokens(pipeline)
        pipeline.publish(workload)
        _wait_for(
            f"{CHUNKS_BEFORE_KILL} chunks logged by every session",
            lambda: (
                sum(c >= CHUNKS_BEFORE_KILL for c in _chunks_per_session(pipeline).values()) == N
            ),
            pipeline,
        )
        pipeline.workers[0].kill(signal.SIGKILL)  # the supervisor restarts it
        _wait_for(
            "every trajectory released",
            lambda: sum(pipeline.watcher.keys.values()) >= N,
            pipeline,
        )
        sampled = replica_generated_tokens(pipeline) - before
        events = _turn_events(pipeline)
    finally:
        pipeline.close()
    assert sorted(pipeline.watcher.keys) == sorted(workload.expected_keys())
    assert set(pipeline.watcher.keys.values()) == {1}, "a trajectory released twice"
    resumed = [e for e in events if getattr(e, "resumed_from", None)]
    assert {e.session_id for e in resumed} == set(range(N)), "every session resumed from the log"
    # the kill is one takeover per session; a worker this slow (load 16+ on two cores) can
    # be taken over again later (seen once in ten: every session twice). Each takeover may
    # cost up to one chunk per session (and CANCEL_SLACK), so the bound below counts them
    takeovers = len(resumed)
    final = {e.session_id: e for e in events if isinstance(e, Generation)}
    assert all(len(g.token_ids) == TOKENS for g in final.values())
    kept = [(e.session_id, e.start, e.token_ids) for e in events if isinstance(e, GenerationChunk)]
    for sid, start, tokens in kept:  # the resumed turn holds every logged chunk as logged
        assert final[sid].token_ids[start : start + len(tokens)] == tokens
    again = sampled - sum(len(g.token_ids) for g in final.values())
    print(f"\n[chunked kill] {N} sessions in flight, {TOKENS}-token turns, chunks of {CHUNK}:")
    print(f"[chunked kill] tokens sampled again: {again} ({again / N:.1f} per session)")
    print(f"[chunked kill] resumes: {takeovers} ({N} per takeover)")
    bound = (CHUNK + CANCEL_SLACK) * takeovers
    assert 0 <= again <= bound, f"{again} tokens sampled again in {takeovers} resumes"
