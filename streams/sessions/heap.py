"""The session worker's garbage collector, set for many sessions in flight (issue 28).

A worker's start-up heap is large and lives as long as the process: the tokenizer loads
transformers and torch, about 400,000 tracked objects. CPython's full collection scans all of
them, and with hundreds of sessions in flight the turns' short-lived objects trigger one
every few thousand turns: at 256 sessions in flight that was about 30% of the worker's CPU
(three collections of ~160 ms in 7,900 turn events; ``benchmarks/worker_concurrency.py``).

``settle_start_up_heap`` moves what start-up made into the permanent generation
(``gc.freeze``): a collection no longer scans it, and nothing of it is garbage (a frozen
object is still freed by its reference count). The youngest generation's threshold is then
raised, as Ray Serve's proxy does for the same reason: each young collection scans every
object of the sessions in flight, so the fewer of them, the less CPU per turn.
"""

from __future__ import annotations

import gc

__all__ = ["YOUNG_THRESHOLD", "settle_start_up_heap"]

# container allocations (net of frees) between two young collections; CPython's default is
# 700. Cyclic garbage waits a little longer to be freed (10,000 objects at most, a few MB).
YOUNG_THRESHOLD = 10_000


def settle_start_up_heap() -> None:
    """Collect once, freeze what is left, and collect the young generation less often.

    Call it once the worker is built (tokenizer, clients, agent loops loaded), before the
    first session runs."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
