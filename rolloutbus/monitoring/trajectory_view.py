"""``rolloutbus inspect KEY|UID``: one trajectory (or a whole group), turn by turn, as the
turn log holds it.

Reads the uid's partition of ``rollout.turns`` (every record about a group lies in one
partition), keeps the events of the uid, and per session shows the attempt the replay
buffer folds (the first to reach a terminal event; superseded attempts are named): the
prompt, each generation (decoded text, trained tokens: mask 1, with logprobs, policy
version, replica, stop reason, latency), each observation (untrained tokens: mask 0, the
tool or user text), the tool calls the configured parser finds in a generation, and the
end (reward, turns, the loop's timings) or the failure.

:func:`inspect_key` returns plain data (``--json`` prints it); :func:`format_text` lays it
out for a terminal, with the mask written out on every block so a plain terminal tells
trained from untrained text without colours.
"""

from __future__ import annotations

import asyncio
from statistics import fmean
from typing import Any

from pydantic import ValidationError

from rolloutbus.config import Config
from rolloutbus.errors import ConfigError, SchemaError
from rolloutbus.kafka.partition_reader import read_partition
from rolloutbus.schemas.turns import decode_turn_event
from rolloutbus.topics import KEY_SEPARATOR, Topics, partition_for

__all__ = ["format_text", "inspect_key", "parse_key"]


def parse_key(key: str) -> tuple[str, int | None]:
    """``UID``, ``UID_SESSION`` or a trajectory key ``UID_SESSION_OUTPUT`` → (uid, session)."""
    parts = key.split(KEY_SEPARATOR)
    if not parts[0] or len(parts) > 3 or not all(p.isdigit() for p in parts[1:]):
        raise ConfigError(
            f"not a uid or key: {key!r} (expected UID, UID_SESSION or UID_SESSION_OUTPUT)"
        )
    return parts[0], int(parts[1]) if len(parts) > 1 else None


def inspect_key(
    cfg: Config, key: str, tokenizer: Any | None, *, start_offset: int = 0
) -> dict[str, Any]:
    """The sessions of ``key`` as plain data (JSON-ready)."""
    uid, session = parse_key(key)
    topic = Topics.from_config(cfg.kafka).turns
    partition = partition_for(uid, cfg.kafka.partitions)
    events = []
    for msg in read_partition(cfg.kafka, topic, partition, start_offset):
        try:
            event = decode_turn_event(msg.value() or b"")
        except (ValidationError, SchemaError):
            continue  # a dead letter's business, not this group's
        if event.uid == uid and (
            session is None or getattr(event, "session_id", session) == session
        ):
            events.append((msg.offset(), event))
    if not events:
        raise ConfigError(f"{key}: no turn events for uid {uid} in {topic}[{partition}]")
    view = _Viewer(tokenizer, cfg.rollout.multi_turn.format, cfg.rollout.response_length)
    return view.group(uid, topic, partition, events)


class _Viewer:
    def __init__(self, tokenizer: Any | None, tool_format: str, response_length: int):
        self.tokenizer = tokenizer
        self.response_length = response_length
        self.parser = _tool_parser(tool_format, tokenizer)

    def group(self, uid: str, topic: str, partition: int, events: list) -> dict[str, Any]:
        started = next((e for _, e in events if e.type == "group_started"), None)
        attempts: dict[tuple[int, str], list] = {}
        for offset, event in events:
            if hasattr(event, "session_id"):
                attempts.setdefault((event.session_id, event.attempt), []).append((offset, event))
        sessions = []
        for session_id in sorted({sid for sid, _ in attempts}):
            mine = [(a, evs) for (sid, a), evs in attempts.items() if sid == session_id]
            chosen, superseded = _chosen_attempt(mine)
            sessions.append(self.session(session_id, chosen, superseded))
        return {
            "uid": uid,
            "turn_log": f"{topic}[{partition}]",
            "n": started.n if started else None,
            "data_source": (started.row.get("data_source") if started else None),
            "policy_version_at_dispatch": started.policy_version if started else None,
            "started_at": started.ts if started else None,
            "sessions": sessions,
        }

    def session(
        self, session_id: int, chosen: tuple[str, list], superseded: list[str]
    ) -> dict[str, Any]:
        attempt, events = chosen
        first_ts = events[0][1].ts
        blocks = [self.block(offset, e, first_ts) for offset, e in sorted(events, key=_seq)]
        end = next((b for b in reversed(blocks) if b["type"] in ("finished", "failed")), None)
        return {
            "session_id": session_id,
            "attempt": attempt,
            "superseded_attempts": superseded,
            "resumed_from": next(
                (e.resumed_from for _, e in events if e.type == "session_started"), None
            ),
            "status": end["type"] if end else "running",
            "turns": [b for b in blocks if b["type"] not in ("started",)],
        }

    def block(self, offset: int, e: Any, first_ts: float) -> dict[str, Any]:
        base = {"offset": offset, "seq": e.seq, "at_s": round(e.ts - first_ts, 3)}
        if e.type == "session_started":
            return {**base, "type": "started", "agent_name": e.agent_name}
        if e.type == "segment_started":
            return {
                **base,
                "type": "prompt",
                "segment": e.segment,
                "mask": 0,
                **self.tokens(e.prompt_ids),
            }
        if e.type == "generation":
            return {**base, **self.generation(e)}
        if e.type == "observation":
            return {
                **base,
                "type": "observation",
                "turn": e.turn,
                "mask": 0,
                **self.tokens(e.token_ids),
            }
        if e.type == "session_finished":
            outputs = [self.output(o.model_dump()) for o in e.outputs]
            return {**base, "type": "finished", "outputs": outputs}
        return {**base, "type": "failed", "error": e.error, "retriable": e.retriable}

    def output(self, summary: dict[str, Any]) -> dict[str, Any]:
        # the trajectory's status as the replay buffer releases it (verl: a response that
        # fills rollout.response_length is truncated, whatever the engine's stop reason)
        truncated = summary["response_len"] >= self.response_length
        return {**summary, "status": "truncated" if truncated else "completed"}

    def generation(self, e: Any) -> dict[str, Any]:
        logprobs = list(e.logprobs) if e.logprobs is not None else None
        out = {
            "type": "generation",
            "turn": e.turn,
            "segment": e.segment,
            "mask": 1,
            "policy_version": e.policy_version,
            "replica": e.replica,
            "stop_reason": e.stop_reason,
            "latency_s": e.latency_s,
            "num_preempted": e.num_preempted,
            **self.tokens(e.token_ids),
            "logprobs": logprobs,
            "logprob_mean": fmean(logprobs) if logprobs else None,
            "tool_calls": self.tool_calls(list(e.token_ids)),
        }
        if self.tokenizer is not None:  # each sampled token as the tokenizer spells it
            out["token_texts"] = [self.tokenizer.decode([t]) for t in out["token_ids"]]
        return out

    def tokens(self, ids: Any) -> dict[str, Any]:
        ids = [int(i) for i in ids]
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return {"num_tokens": len(ids), "token_ids": ids, "text": text}

    def tool_calls(self, ids: list[int]) -> list[dict[str, Any]]:
        if self.parser is None:
            return []
        _, calls = asyncio.run(self.parser.extract_tool_calls(ids))
        return [{"name": c.name, "arguments": c.arguments} for c in calls]


def _tool_parser(tool_format: str, tokenizer: Any | None) -> Any | None:
    if tokenizer is None:
        return None
    from rolloutbus.streams.agent_loop.tool_parser import ToolParser

    return ToolParser.get_tool_parser(tool_format, tokenizer)


def _seq(item: tuple[int, Any]) -> tuple[int, int]:
    offset, event = item
    return (event.seq, offset)


def _chosen_attempt(attempts: list[tuple[str, list]]) -> tuple[tuple[str, list], list[str]]:
    """The attempt the replay buffer folds: the first (in log order) to reach a terminal
    event; with none terminal yet, the latest one. The others are superseded."""
    terminal = [
        (min(off for off, e in evs if e.type in ("session_finished", "session_failed")), a, evs)
        for a, evs in attempts
        if any(e.type in ("session_finished", "session_failed") for _, e in evs)
    ]
    if terminal:
        _, attempt, events = min(terminal, key=lambda t: t[0])
    else:
        attempt, events = max(attempts, key=lambda ae: max(off for off, _ in ae[1]))
    return (attempt, events), sorted(a for a, _ in attempts if a != attempt)


# -- text ----------------------------------------------------------------------------------

TEXT_PREVIEW_CHARS = 2000  # characters of one block's text shown (--json has everything)


def format_text(view: dict[str, Any], *, show_tokens: bool = False) -> str:
    lines = [
        f"group {view['uid']}  ({view['turn_log']}, n={view['n']}, data_source "
        f"{view['data_source']}, dispatched at policy version {view['policy_version_at_dispatch']})"
    ]
    for s in view["sessions"]:
        lines.append("")
        head = f"session {view['uid']}_{s['session_id']}  attempt {s['attempt']}  [{s['status']}]"
        if s["resumed_from"]:
            head += f"  resumed from {s['resumed_from']}"
        if s["superseded_attempts"]:
            head += f"  superseded: {', '.join(s['superseded_attempts'])}"
        lines.append(head)
        for block in s["turns"]:
            lines.extend(_block_lines(block, show_tokens))
    return "\n".join(lines)


def _block_lines(b: dict[str, Any], show_tokens: bool) -> list[str]:
    at = f"+{b['at_s']:.2f}s"
    if b["type"] == "prompt":
        return [
            f"  {at} PROMPT seg {b['segment']}  {b['num_tokens']} tokens, mask 0 (not trained)",
            *_text(b),
        ]
    if b["type"] == "generation":
        lp = "-" if b["logprob_mean"] is None else f"{b['logprob_mean']:.3f}"
        head = (
            f"  {at} GENERATION turn {b['turn']}  {b['num_tokens']} tokens, mask 1 (trained)  "
            f"policy v{b['policy_version']}  replica {b['replica'] or '-'}  "
            f"engine stop {b['stop_reason']}  {b['latency_s']:.2f} s  mean logprob {lp}"
        )
        out = [head, *_text(b)]
        out += [f"      tool call: {c['name']}({c['arguments']})" for c in b["tool_calls"]]
        if show_tokens:
            out += _token_lines(b)
        return out
    if b["type"] == "observation":
        return [
            f"  {at} OBSERVATION turn {b['turn']}  {b['num_tokens']} tokens, mask 0 "
            "(not trained: tool/user/template)",
            *_text(b),
        ]
    if b["type"] == "finished":
        out = [f"  {at} FINISHED"]
        for i, o in enumerate(b["outputs"]):
            m = o["metrics"]
            out.append(
                f"      output {i}: {o['status']}  reward {o['reward_score']}  "
                f"turns {o['num_turns']}  response {o['response_len']} tokens  "
                f"generate {m['generate_sequences']:.2f} s  "
                f"tools {m['tool_calls']:.2f} s  score {m['compute_score']:.3f} s"
            )
        return out
    return [f"  {at} FAILED ({'retriable' if b['retriable'] else 'final'}): {b['error']}"]


def _text(b: dict[str, Any]) -> list[str]:
    text = b.get("text")
    if text is None:
        return [f"      ids {b['token_ids'][:32]}{' ...' if b['num_tokens'] > 32 else ''}"]
    if len(text) > TEXT_PREVIEW_CHARS:
        text = text[:TEXT_PREVIEW_CHARS] + f" ... ({len(text)} characters)"
    marker = "| " if b["mask"] else ": "  # | trained text, : untrained, on every line
    return ["      " + marker + line for line in text.splitlines() or [""]]


def _token_lines(b: dict[str, Any]) -> list[str]:
    logprobs = b["logprobs"] or [None] * b["num_tokens"]
    texts = b.get("token_texts") or [""] * b["num_tokens"]
    return [
        f"        {tid:>8}  {'-' if lp is None else f'{lp:8.4f}'}  {text!r}"
        for tid, lp, text in zip(b["token_ids"], logprobs, texts, strict=False)
    ]
