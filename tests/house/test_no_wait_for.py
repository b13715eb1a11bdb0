"""No ``asyncio.wait_for`` in the package: Python 3.11 (the version the project runs) drops
a cancellation that arrives as the awaited thing finishes, and returns its result instead.
A session task of a revoked partition then ran on beside its new owner's resumed attempt
and logged turns that were sampled twice (a fault-row failure under load, issue 25).
``async with asyncio.timeout(...)`` runs the awaitable in the task itself and has no such
window."""

from __future__ import annotations

import ast
import asyncio
import sys

import pytest

from tests.source_tree import ROOT, modules


def _wait_for_calls(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name == "wait_for":
                lines.append(node.lineno)
    return lines


def test_no_module_of_the_package_calls_asyncio_wait_for():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in modules().values()
        for line in _wait_for_calls(path.read_text())
    ]
    assert found == [], f"asyncio.wait_for (use asyncio.timeout): {found}"


def test_the_finder_finds_a_planted_call():
    assert _wait_for_calls("import asyncio\nasync def f(x):\n    await asyncio.wait_for(x, 1)\n")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for was rewritten in 3.12")
def test_the_reason_python_3_11_wait_for_drops_a_cancellation():
    async def scenario() -> str:
        finish = asyncio.Event()

        async def inner() -> str:
            await finish.wait()
            return "result"

        task = asyncio.ensure_future(asyncio.wait_for(inner(), 60))
        await asyncio.sleep(0)
        finish.set()
        await asyncio.sleep(0)  # inner is done; wait_for has not woken up yet
        task.cancel()
        return await task  # the cancel is dropped: the result comes back

    assert asyncio.run(scenario()) == "result"
