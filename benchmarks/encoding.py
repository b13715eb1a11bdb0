"""Which encoding for token arrays inside turn events? JSON lists vs base64 of int32.

Prints size and encode/decode time (median of repeats) for one generation event of each
length, and the ratio binary/JSON. Run: python benchmarks/encoding.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rolloutbus.schemas.turns import Generation, decode_turn_event, encode_turn_event

REPEATS = 200
QUICK_REPEATS = 5  # --quick: checks the script runs


def _median_s(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_REPEATS} repeats")
    repeats = QUICK_REPEATS if parser.parse_args().quick else REPEATS
    rng = random.Random(0)
    print(
        f"{'tokens':>7} {'json B':>8} {'binary B':>9} {'size':>6} {'json enc+dec us':>16} "
        f"{'binary enc+dec us':>18} {'time':>6}"
    )
    for n in (64, 512, 4096):
        tokens = [rng.randrange(151_936) for _ in range(n)]
        logprobs = [-rng.random() * 5 for _ in range(n)]
        event = Generation(
            uid="u",
            session_id=0,
            attempt="a",
            segment=0,
            turn=0,
            token_ids=tokens,
            logprobs=logprobs,
        )
        as_json = {**event.model_dump(mode="python"), "token_ids": tokens, "logprobs": logprobs}
        json_bytes = json.dumps(as_json).encode()
        bin_bytes = encode_turn_event(event)
        t_json = _median_s(lambda: json.loads(json.dumps(as_json)), repeats)  # noqa: B023
        t_bin = _median_s(lambda: decode_turn_event(encode_turn_event(event)), repeats)  # noqa: B023
        print(
            f"{n:>7} {len(json_bytes):>8} {len(bin_bytes):>9} "
            f"{len(bin_bytes) / len(json_bytes):>6.2f} "
            f"{t_json * 1e6:>16.0f} {t_bin * 1e6:>18.0f} {t_bin / t_json:>6.2f}"
        )


if __name__ == "__main__":
    main()
