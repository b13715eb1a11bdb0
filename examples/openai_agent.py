"""A plain OpenAI-SDK agent with one tool, trained through Rollout Bus's gateway.

Nothing here imports Rollout Bus: the agent is what it would be against any OpenAI-compatible
server. The only additions for training are opening a group of sessions (one per GRPO
sample, each with its own ``base_url``) and finishing each with a reward.

    rolloutbus gateway --config my.yaml            # prints http://127.0.0.1:8100
    python examples/openai_agent.py http://127.0.0.1:8100 "What is 18 * 7?" --answer 126 -n 4

Each session: ``chat.completions.create`` with the calculator tool; every tool call is run and
its result appended as a ``tool`` message; when the model answers without a call, the
session is finished with reward 1.0 if the answer holds the expected number, else 0.0.
The gateway logs every call as a turn, and the trainer receives the group's trajectories.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
from collections.abc import Callable
from typing import Any

import httpx
from openai import OpenAI

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 18 * 7"}},
            "required": ["expression"],
        },
    },
}
SYSTEM = "You are a careful assistant. Use the calculator for arithmetic, then answer."
_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}
HTTP_TIMEOUT_S = 60.0  # seconds for the session endpoints (a finish may run a scorer)


def calculator(expression: str) -> str:
    """The tool: numbers, + - * /, parentheses; anything else is an error text."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression: {ast.dump(node)}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(result)


def open_sessions(gateway: str, n: int, row: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """A group of ``n`` sessions: ``[{"id", "session_id", "base_url"}, ...]``."""
    body = {"n": n, "row": row or {}}
    response = httpx.post(f"{gateway}/v1/sessions", json=body, timeout=HTTP_TIMEOUT_S)
    response.raise_for_status()
    return list(response.json()["sessions"])


def run_agent(
    base_url: str,
    question: str,
    *,
    tools: dict[str, Callable[..., str]] | None = None,
    max_turns: int = 8,
) -> str:
    """The agent: call the model, run its tool calls, until it answers; returns the answer."""
    tools = tools or {"calculator": calculator}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    # closed on return: an unclosed client leaves its pooled sockets to the garbage collector
    with OpenAI(base_url=base_url, api_key="not-used") as client:
        for _ in range(max_turns):
            completion = client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR_TOOL]
            )
            message = completion.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return message.content or ""
            for call in message.tool_calls:
                result = _run_tool(tools, call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def _run_tool(tools: dict[str, Callable[..., str]], name: str, arguments: str) -> str:
    if name not in tools:
        return f"error: no tool named {name!r}"
    try:
        return tools[name](**json.loads(arguments))
    except (json.JSONDecodeError, TypeError) as exc:
        return f"error: bad arguments for {name}: {exc}"


def finish(gateway: str, session: str, reward: float | None) -> dict[str, Any]:
    """End a session with its reward (None: the row's scorer computes it)."""
    response = httpx.post(
        f"{gateway}/v1/sessions/{session}/finish", json={"reward": reward}, timeout=HTTP_TIMEOUT_S
    )
    response.raise_for_status()
    return dict(response.json())


def reward_of(answer: str, expected: str) -> float:
    return 1.0 if expected in answer else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gateway", help="the gateway's URL, e.g. http://127.0.0.1:8100")
    parser.add_argument("question")
    parser.add_argument("--answer", required=True, help="the number a correct answer holds")
    parser.add_argument("-n", type=int, default=1, help="sessions in the group (GRPO's n)")
    args = parser.parse_args(argv)
    for session in open_sessions(args.gateway, args.n):
        answer = run_agent(session["base_url"], args.question)
        reward = reward_of(answer, args.answer)
        finish(args.gateway, session["id"], reward)
        print(json.dumps({"session": session["id"], "answer": answer, "reward": reward}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
