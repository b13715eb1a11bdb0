"""A continuous-batching decode engine for a torch causal LM (not HF ``generate()``).

One thread runs the decode loop. Each iteration:

1. admit waiting requests while the batch has room (``max_batch_size``);
2. prefill them together (right-padded, causal) into the KV-cache slots after the running
   rows, and sample their first token;
3. run one decode step for the whole batch, each row at its own position, and sample one
   token per row;
4. hand finished (or aborted) rows back to their callers; the last rows' slots move into
   the holes they leave, so the batch stays rows ``0..B-1`` (``kv_cache.SlotKVCache``).

Each row keeps a *pending* token: sampled but not yet in the KV cache. Nothing is padded
or copied per step: the cache is preallocated per slot, and attention reads a view of it.

Between iterations (never during a forward pass) the loop obeys the control surface:
``pause(mode)`` stops admitting and aborts (``abort``), drains (``wait``) or freezes
(``keep``) the running rows; ``reload_weights`` copies new weights into the model only
while paused; ``resume()`` carries on. Each sampled token is stamped with the
``weight_version`` current when it was sampled.

The seams: ``batch`` (each request while held, and the running batch), ``model_runner``
(the forward passes over the slot KV cache), ``sampling`` (one token per row, float32),
``control_work`` (work run between steps) and ``pause_gate`` (the pause modes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from rolloutbus.config import Config
from rolloutbus.errors import ReplicaError
from rolloutbus.replica.batch import DecodeBatch, DecodeSequence, WaitingRequests
from rolloutbus.replica.control_work import ControlWork
from rolloutbus.replica.generation import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    check_request_fits,
)
from rolloutbus.replica.model_runner import ModelRunner
from rolloutbus.replica.pause_gate import PauseGate, check_pause_mode
from rolloutbus.replica.sampling import generator_for, sample_tokens

__all__ = ["DecodeEngine"]

log = logging.getLogger(__name__)

STOP_JOIN_TIMEOUT_S = 30.0  # seconds; one decode step of a 135M model on CPU is < 1 s

# Streaming: hears (token id, its logprob, the weight version that sampled it) on the
# engine thread after each token a request samples; it must only hand the token over
# (``call_soon_threadsafe``). Kept per request in DecodeEngine._listeners, by id(seq).
OnToken = Callable[[int, float, "int | str"], None]


def ignore_token(token: int, logprob: float, version: int | str) -> None:
    """The ``OnToken`` of a request nobody streams."""


class DecodeEngine:
    """Serves ``submit()`` calls from a decode loop in its own thread."""

    owned_by = "rolloutbus"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str,
        max_batch_size: int = 32,
        max_model_len: int = 4096,
        torch_threads: int | None = None,
    ) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self.model_name = model_name
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.torch_threads = torch_threads
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self._runner = ModelRunner(model, max_batch_size, max_model_len)
        self.stats = EngineStats()
        self.weight_version: int | str = 0  # set by POST /update_weight_version
        self._waiting = WaitingRequests(self.stats)
        self._cond = threading.Condition()
        self._stopping = False
        self._gate = PauseGate()  # changed under self._cond: the decode loop reads it
        self._quiescent = False  # the loop has done what the pause mode asks
        self._control = ControlWork()  # run between steps, e.g. a weight reload
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._listeners: dict[int, OnToken] = {}

    @classmethod
    def from_config(cls, cfg: Config) -> DecodeEngine:
        """Load ``cfg.model`` (``rolloutbus.models.causal_lm``) and wrap it; not started."""
        from rolloutbus.models.causal_lm import load_causal_lm

        if cfg.replica_server.torch_threads:
            torch.set_num_threads(cfg.replica_server.torch_threads)
        model, tokenizer = load_causal_lm(cfg.model)
        return cls(
            model,
            tokenizer,
            model_name=cfg.model.name,
            max_batch_size=cfg.replica_server.max_batch_size,
            max_model_len=cfg.replica_server.max_model_len,
            torch_threads=cfg.replica_server.torch_threads,
        )

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="rolloutbus-decode", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Finish the current step, abort everything else, join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(STOP_JOIN_TIMEOUT_S)

    # -- control surface (vLLM's RL API; any thread) ------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._gate.is_paused

    @property
    def pause_gate(self) -> PauseGate:
        return self._gate

    async def pause(self, mode: PauseMode = "abort", lease_s: float | None = None) -> None:
        check_pause_mode(mode)  # before the health check: a bad mode is the caller's mistake
        await asyncio.to_thread(self._pause_and_wait, mode, lease_s)

    async def resume(self) -> None:
        with self._cond:
            self._gate.open()
            self._cond.notify_all()

    async def reload_weights(self, weights_path: str) -> None:
        from rolloutbus.replica.weights import read_weight_update

        self._gate.require_paused(weights_path)
        self._gate.reload_started()  # until the apply is done: it holds the pause's lease
        try:
            # Reading and checking the files touches no model tensor: do it off the loop.
            update = await asyncio.to_thread(read_weight_update, self.model, weights_path)
            self._gate.require_paused(weights_path)

            def apply() -> None:
                update.apply()
                self._gate.reload_finished(weights_path)

            done = self._run_in_loop(apply)
        except BaseException:
            self._gate.reload_ended()
            raise
        # The apply runs in the decode thread even when this caller goes away (a weight sync
        # killed mid-reload): the reload counts as running until the work is done or dropped.
        done.add_done_callback(_in_loop(asyncio.get_running_loop(), self._gate.reload_ended))
        await asyncio.wrap_future(done)
        log.info("%s: reloaded weights from %s", self.model_name, weights_path)

    def _pause_and_wait(self, mode: PauseMode, lease_s: float | None) -> None:
        with self._cond:
            self._require_running()
            self._gate.close(mode, lease_s)
            self._quiescent = False
            if mode == "abort":  # queued requests are in flight too, as in vLLM: end them now
                for seq in self._waiting.take_all():
                    self._finish(seq, "abort")
            self._cond.notify_all()
            while not self._quiescent and self.healthy and not self._stopping:
                self._cond.wait(timeout=1.0)  # seconds; re-check health if the loop dies

    def _run_in_loop(self, work: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Run ``work`` in the decode thread between two steps; its future says how it went."""
        with self._cond:
            self._require_running()
            future = self._control.submit(work)
            self._cond.notify_all()
        return future

    async def submit(
        self, request: GenerationRequest, on_token: OnToken = ignore_token
    ) -> GenerationResult:
        check_request_fits(request, self.max_model_len, self.vocab_size)
        self._require_running()
        loop = asyncio.get_running_loop()
        seq = DecodeSequence(
            request=request,
            loop=loop,
            future=loop.create_future(),
            generator=generator_for(request),
            stop_ids=frozenset(request.stop_token_ids)
            | (frozenset() if request.ignore_eos else self.eos_token_ids),
            submitted=time.monotonic(),
        )
        self._listeners[id(seq)] = on_token
        with self._cond:
            self._waiting.add(seq)
            self._cond.notify_all()
        try:
            return await seq.future
        except asyncio.CancelledError:
            seq.aborted = True  # the loop drops it at the next step boundary
            raise
        finally:
            self._listeners.pop(id(seq), None)

    def _require_running(self) -> None:
        if not self.healthy:
            raise ReplicaError(f"engine for {self.model_name} is not running: {self._error!r}")

    # -- the decode loop (engine thread) ----------------------------------------------

    def _run(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        batch: DecodeBatch | None = None
        try:
            with torch.inference_mode():
                while True:
                    admitted = self._next_work(batch)
                    if admitted is None:
                        break  # stopping
                    self._control.run_pending(self._cond)
                    mode = self._gate.mode
                    if mode == "abort" and batch is not None:
                        for seq in batch.rows:
                            seq.aborted = True  # released below with the tokens sampled so far
                        batch = self._release_finished(batch)
                    if admitted:
                        batch = self._prefill(batch, admitted)
                        batch = self._release_finished(batch)  # e.g. eos as first token
                    if batch is not None and mode in (None, "wait"):
                        self._decode_step(batch)
                        batch = self._release_finished(batch)
        except Exception as exc:  # the loop must not die silently: fail every caller
            log.exception("decode loop for %s crashed", self.model_name)
            self._error = exc
        self._abort_all(batch)

    def _next_work(self, batch: DecodeBatch | None) -> list[DecodeSequence] | None:
        """Block until there is work; return the requests admitted to the batch (maybe
        none), or None when stopping. While paused nothing is admitted: the loop only
        runs control work, aborts (``abort``) or drains (``wait``) the running rows."""
        running = len(batch.rows) if batch else 0
        with self._cond:
            while True:
                if self._stopping:
                    return None
                mode = self._gate.mode
                if mode is not None and (mode == "keep" or running == 0) and not self._quiescent:
                    self._quiescent = True  # at a step boundary, with what the mode asks done
                    self._cond.notify_all()
                if self._control:
                    return []
                if mode is None and (running or self._waiting):
                    break
                if mode in ("abort", "wait") and running:
                    return []
                self._cond.wait()
            admitted, gave_up = self._waiting.admit(self.max_batch_size - running)
            for seq in gave_up:
                self._finish(seq, "abort")
        return admitted

    def _prefill(self, batch: DecodeBatch | None, seqs: list[DecodeSequence]) -> DecodeBatch:
        """Prefill ``seqs`` into the slots after the running rows; sample their first token."""
        now = time.monotonic()
        for seq in seqs:
            seq.started = now
        logits = self._runner.prefill(len(batch.rows) if batch else 0, seqs)
        lengths = [len(s.request.prompt_ids) for s in seqs]
        self.stats.prompt_tokens += sum(lengths)
        pending = self._sample(seqs, logits)
        first = time.monotonic()
        for seq in seqs:
            seq.first_token = first
        joining = DecodeBatch(
            rows=seqs, pending=pending, positions=torch.tensor(lengths), lengths=lengths
        )
        return joining if batch is None else batch.join(joining)

    def _decode_step(self, batch: DecodeBatch) -> None:
        rows = len(batch.rows)
        logits = self._runner.decode(batch)
        self.stats.steps += 1
        self.stats.batch_sizes[rows] += 1
        batch.pending = self._sample(batch.rows, logits)

    def _sample(self, rows: list[DecodeSequence], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row, record it and its logprob, mark finished rows."""
        tokens, logprobs, tops = sample_tokens(
            logits.float(), [s.request for s in rows], [s.generator for s in rows]
        )
        version = self.weight_version  # read once: one step, one version
        # tolist(): one conversion for the batch, not one tensor read per row
        for i, (seq, token, logprob) in enumerate(
            zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if seq.finish_reason is None:
                seq.record(token, logprob, tops[i] if tops else None, version)
                self._listeners.get(id(seq), ignore_token)(token, logprob, version)
        self.stats.generation_tokens += len(rows)
        return tokens

    def _release_finished(self, batch: DecodeBatch | None) -> DecodeBatch | None:
        if batch is None:
            return None
        keep: list[int] = []
        done: list[int] = []
        for i, seq in enumerate(batch.rows):
            if seq.aborted and seq.finish_reason is None:
                seq.finish_reason = "abort"
            (keep if seq.finish_reason is None else done).append(i)
        finished = [batch.rows[i] for i in done]
        if done:
            self._runner.compact(batch, keep, done)
        self.stats.running = len(batch.rows)  # before callers hear back: they may read it
        for seq in finished:
            self._finish(seq, seq.finish_reason or "abort")  # never None here: it is in done
        return batch if batch.rows else None

    def _finish(self, seq: DecodeSequence, reason: FinishReason) -> None:
        seq.resolve(seq.result(reason))

    def _abort_all(self, batch: DecodeBatch | None) -> None:
        with self._cond:
            waiting = self._waiting.take_all()
            control = self._control.drain()
            self._quiescent = True
            self._cond.notify_all()
        for future in control:
            if future.set_running_or_notify_cancel():  # else its caller already went away
                future.set_exception(ReplicaError(f"engine for {self.model_name} stopped"))
        for seq in (batch.rows if batch else []) + waiting:
            if self._error is not None:
                seq.reject(
                    ReplicaError(f"decode loop for {self.model_name} crashed: {self._error!r}")
                )
            else:
                self._finish(seq, "abort")
        self.stats.running = self.stats.waiting = 0


# -- small helpers --------------------------------------------------------------------


def _eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _in_loop(
    loop: asyncio.AbstractEventLoop, callback: Callable[[], None]
) -> Callable[[concurrent.futures.Future[None]], None]:
    """A done-callback for a concurrent future that runs ``callback`` in ``loop``'s thread."""

    def call(_: concurrent.futures.Future[None]) -> None:
        try:
            loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: the server is gone, nobody reads the gate
            pass

    return call
