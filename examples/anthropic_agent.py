"""A plain Anthropic-SDK agent with one tool, written as Claude agents are (a tool-use loop over
``messages.create``), trained through Rollout Bus's gateway.

Nothing here imports Rollout Bus: the agent is what it would be against Anthropic's API. The
only additions for training, shared with ``openai_agent.py``, are opening a group of sessions
and finishing each with a reward. Each session's client takes the session's root as its
``base_url`` (the SDK adds ``/v1/messages``), as a harness that reads ``ANTHROPIC_BASE_URL``
would.

    rolloutbus gateway --config my.yaml            # prints http://127.0.0.1:8100
    python examples/anthropic_agent.py http://127.0.0.1:8100 "What is 18 * 7?" --answer 126 -n 4

The loop: ``messages.create`` (or ``messages.stream`` with ``--stream``) with the calculator
tool; while the reply stops on ``tool_use``, every call is run and its result sent back as a
``tool_result`` block; the reply's blocks, thinking blocks and their signatures included, go
back into the history unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anthropic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_agent import (  # noqa: E402  # the session endpoints and the tool, shared
    CALCULATOR_TOOL,
    SYSTEM,
    calculator,
    finish,
    open_sessions,
    reward_of,
)

CALCULATOR = {  # openai_agent's tool in Anthropic's shape
    "name": CALCULATOR_TOOL["function"]["name"],
    "description": CALCULATOR_TOOL["function"]["description"],
    "input_schema": CALCULATOR_TOOL["function"]["parameters"],
}
MAX_TOKENS = 256  # per call; the gateway also bounds the whole trajectory


def client_for(gateway: str, session_id: str) -> anthropic.Anthropic:
    """An Anthropic client for one session: its base_url is the session's root."""
    return anthropic.Anthropic(
        base_url=f"{gateway}/sessions/{session_id}", api_key="not-used", max_retries=0
    )


def request(history: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The ``messages.create`` arguments for ``history`` (``fields`` add or override)."""
    return {
        "model": "policy",
        "max_tokens": MAX_TOKENS,
        "system": SYSTEM,
        "tools": [CALCULATOR],
        "messages": history,
        **fields,
    }


def run_agent(
    client: anthropic.Anthropic,
    question: str,
    *,
    tools: dict[str, Callable[..., str]] | None = None,
    stream: bool = False,
    max_turns: int = 8,
    **fields: Any,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Ask, run the model's tool calls, until it stops for another reason than a tool call:
    the history and the model's replies (the last one holds the answer)."""
    tools = tools or {"calculator": calculator}
    history: list[dict[str, Any]] = [{"role": "user", "content": question}]
    replies = []
    for _ in range(max_turns):
        if stream:
            with client.messages.stream(**request(history, **fields)) as events:
                reply = events.get_final_message()
        else:
            reply = client.messages.create(**request(history, **fields))
        replies.append(reply)
        history.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
        if reply.stop_reason != "tool_use":
            break
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": _run_tool(tools, b)}
            for b in reply.content
            if b.type == "tool_use"
        ]
        history.append({"role": "user", "content": results})
    return history, replies


def answer_of(replies: list[Any]) -> str:
    """The text of the last reply."""
    if not replies:
        return ""
    return "".join(b.text for b in replies[-1].content if b.type == "text")


def _run_tool(tools: dict[str, Callable[..., str]], call: Any) -> str:
    if call.name not in tools:
        return f"error: no tool named {call.name!r}"
    try:
        return tools[call.name](**call.input)
    except TypeError as exc:
        return f"error: bad arguments for {call.name}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gateway", help="the gateway's URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("question")
    parser.add_argument("--answer", required=True, help="the number a correct answer holds")
    parser.add_argument("-n", type=int, default=1, help="sessions in the group (GRPO's n)")
    parser.add_argument("--stream", action="store_true", help="stream each reply")
    args = parser.parse_args(argv)
    for session in open_sessions(args.gateway, args.n):
        with client_for(args.gateway, session["id"]) as client:
            _, replies = run_agent(client, args.question, stream=args.stream)
        answer = answer_of(replies)
        reward = reward_of(answer, args.answer)
        finish(args.gateway, session["id"], reward)
        print(json.dumps({"session": session["id"], "answer": answer, "reward": reward}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
