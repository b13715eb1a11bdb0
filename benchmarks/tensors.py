"""Arrow → torch for the trainer: verl-V0 padding (row slices, with and without reused
output buffers) vs the per-row torch loop it replaced, and the jagged (nested tensor) path,
on one batch of trajectories; and, for scale, the time only to write the same output bytes
to fresh and to reused memory (what no conversion avoids).

Prints the median of REPEATS runs of each and the ratio loop/new measured in this run.
Run: python benchmarks/tensors.py [--rows 256] [--tokens 4096] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa
import torch

from rolloutbus.consumers.tensors import (
    PaddedBuffers,
    _fill_nulls,
    _ragged,
    to_jagged,
    to_padded,
)
from rolloutbus.schemas.trajectories import TRAJECTORY_SCHEMA

REPEATS = 30
PAD = 151643  # Qwen3's <|endoftext|>
PROMPT_SHARE = 0.25  # of each trajectory's tokens: a 1k-token prompt and a 3k-token response


def make_batch(rows: int, tokens: int, seed: int = 0) -> pa.RecordBatch:
    """``rows`` trajectories of ``tokens`` tokens at most (lengths drawn between half and all
    of the budget, so the padding has work to do), as the trainer client yields them."""
    rng = np.random.default_rng(seed)
    prompt_budget = int(tokens * PROMPT_SHARE)
    response_budget = tokens - prompt_budget
    prompt_lens = rng.integers(prompt_budget // 2, prompt_budget + 1, rows)
    response_lens = rng.integers(response_budget // 2, response_budget + 1, rows)

    def ragged(lengths: np.ndarray, values: np.ndarray, type_: pa.DataType) -> pa.Array:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_))

    n_resp = int(response_lens.sum())
    columns = {
        "prompts": ragged(
            prompt_lens, rng.integers(0, 151_936, int(prompt_lens.sum())), pa.int32()
        ),
        "responses": ragged(response_lens, rng.integers(0, 151_936, n_resp), pa.int32()),
        "response_mask": ragged(
            response_lens, (rng.random(n_resp) < 0.9).astype(np.int8), pa.int8()
        ),
        "rollout_log_probs": ragged(
            response_lens, -rng.random(n_resp).astype(np.float32), pa.float32()
        ),
        "rm_scores": ragged(response_lens, np.zeros(n_resp, dtype=np.float32), pa.float32()),
    }
    arrays = [
        columns[f.name] if f.name in columns else pa.nulls(rows, f.type) for f in TRAJECTORY_SCHEMA
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=TRAJECTORY_SCHEMA)


# -- the per-row loop that consumers/tensors.py used before, kept as the baseline ----------
def _loop_pad_rows(column: pa.Array, width: int, pad: float, left: bool, dtype) -> torch.Tensor:
    values, offsets = _ragged(column)
    out = torch.full((len(offsets) - 1, width), pad, dtype=dtype)
    for i in range(len(offsets) - 1):
        values_i = np.array(values[offsets[i] : offsets[i + 1]])
        row = torch.from_numpy(values_i[-width:] if left else values_i[:width])
        if left:
            out[i, width - len(row) :] = row.to(dtype)
        else:
            out[i, : len(row)] = row.to(dtype)
    return out


def _loop_ones_like(column: pa.Array) -> pa.Array:
    n = column.offsets[-1].as_py() - column.offsets[0].as_py()
    rebased = pa.array(column.offsets.to_numpy() - column.offsets[0].as_py(), type=pa.int64())
    return pa.LargeListArray.from_arrays(rebased, pa.array(np.ones(n, dtype=np.int8)))


def loop_to_padded(
    batch: pa.RecordBatch, *, prompt_length: int, response_length: int, pad_token_id: int
):
    prompts = _loop_pad_rows(batch.column("prompts"), prompt_length, pad_token_id, True, torch.long)
    responses = _loop_pad_rows(
        batch.column("responses"), response_length, pad_token_id, False, torch.long
    )
    prompt_attn = _loop_pad_rows(
        _loop_ones_like(batch.column("prompts")), prompt_length, 0, True, torch.long
    )
    response_attn = _loop_pad_rows(
        _loop_ones_like(batch.column("responses")), response_length, 0, False, torch.long
    )
    response_mask = _loop_pad_rows(
        batch.column("response_mask"), response_length, 0, False, torch.long
    )
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0),
        "response_mask": response_mask * response_attn,
        "rollout_log_probs": _loop_pad_rows(
            _fill_nulls(batch.column("rollout_log_probs")),
            response_length,
            0.0,
            False,
            torch.float32,
        ),
        "rm_scores": _loop_pad_rows(
            batch.column("rm_scores"), response_length, 0.0, False, torch.float32
        ),
    }


def write_floor(
    batch: pa.RecordBatch, prompt_length: int, response_length: int, keep: list | None
) -> None:
    """The part no conversion avoids: allocate the same outputs and write every byte once.
    With ``keep``, the arrays stay alive, so every call writes to fresh pages."""
    rows, width = batch.num_rows, prompt_length + response_length
    shapes = [((rows, width), np.int64)] * 3 + [((rows, response_length), np.int64)]
    shapes += [((rows, response_length), np.float32)] * 2
    for shape, dtype in shapes:
        array = np.empty(shape, dtype=dtype)
        array.fill(1)
        if keep is not None:
            keep.append(array)


def _median_ms(fn) -> float:
    fn()  # warm-up: first-call allocations
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096, help="budget per trajectory")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (stable figures)")
    parser.add_argument("--quick", action="store_true", help="16 rows of 256 tokens, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        global REPEATS
        args.rows, args.tokens, REPEATS = 16, 256, 3
    torch.set_num_threads(args.threads)
    batch = make_batch(args.rows, args.tokens)
    prompt_length = int(args.tokens * PROMPT_SHARE)
    widths = dict(
        prompt_length=prompt_length, response_length=args.tokens - prompt_length, pad_token_id=PAD
    )
    new, old = to_padded(batch, **widths), loop_to_padded(batch, **widths)
    assert new.keys() == old.keys() and all(torch.equal(new[k], old[k]) for k in new), (
        "results differ"
    )
    # the budgets cut every row: the truncating path (a selection of the values) as well
    cut = dict(
        prompt_length=prompt_length // 2,
        response_length=(args.tokens - prompt_length) // 2,
        pad_token_id=PAD,
    )
    new_cut, old_cut = to_padded(batch, **cut), loop_to_padded(batch, **cut)
    assert all(torch.equal(new_cut[k], old_cut[k]) for k in new_cut), "truncated results differ"

    t_loop = _median_ms(lambda: loop_to_padded(batch, **widths))
    t_vec = _median_ms(lambda: to_padded(batch, **widths))
    t_loop_cut = _median_ms(lambda: loop_to_padded(batch, **cut))
    t_vec_cut = _median_ms(lambda: to_padded(batch, **cut))
    buffers = PaddedBuffers()
    t_reused = _median_ms(lambda: to_padded(batch, **widths, buffers=buffers))
    response_length = args.tokens - prompt_length
    t_floor = _median_ms(lambda: write_floor(batch, prompt_length, response_length, None))
    kept: list = []
    t_fresh = _median_ms(lambda: write_floor(batch, prompt_length, response_length, kept))
    t_jagged = _median_ms(lambda: to_jagged(batch, "responses", dtype=torch.long))
    print(
        f"{args.rows} trajectories of <= {args.tokens} tokens, "
        f"torch threads {args.threads}, median of {REPEATS}"
    )
    print(f"{'path':<34} {'ms':>8} {'loop/new':>16}")
    print(f"{'padded, per-row torch loop (before)':<34} {t_loop:>8.2f}")
    print(f"{'padded, row slices (now)':<34} {t_vec:>8.2f} {t_loop / t_vec:>15.1f}x")
    print(f"{'padded + truncated, per-row loop':<34} {t_loop_cut:>8.2f}")
    print(
        f"{'padded + truncated, row slices':<34} {t_vec_cut:>8.2f} {t_loop_cut / t_vec_cut:>15.1f}x"
    )
    print(f"{'padded, row slices, PaddedBuffers':<34} {t_reused:>8.2f} {t_loop / t_reused:>15.1f}x")
    print(f"{'only writing the outputs, fresh':<34} {t_fresh:>8.2f}")
    print(f"{'only writing the outputs, reused':<34} {t_floor:>8.2f}")
    print(f"{'jagged responses (nested tensor)':<34} {t_jagged:>8.2f}")


if __name__ == "__main__":
    main()
