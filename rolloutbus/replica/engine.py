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

Sampling is done in float32 (also for a bfloat16 model: its logits are cast first, and the
logprob returned is that of the float32 distribution the token was drawn from) with
inverse-CDF draws from each request's own ``torch.Generator`` (``torch.multinomial`` over a
152k vocabulary costs ~80 ms a step on CPU; cumsum + searchsorted ~2 ms), and the logprob of
each sampled token is taken in the loop, never by keeping logits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rolloutbus.config import Config
from rolloutbus.errors import ReplicaError
from rolloutbus.replica.generation import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    RequestRejectedError,
    Timings,
    version_spans,
)
from rolloutbus.replica.kv_cache import SlotKVCache, check_supported, use_slot_attention
from rolloutbus.replica.pause_gate import PauseGate, check_pause_mode

__all__ = ["DecodeEngine"]

log = logging.getLogger(__name__)

STOP_JOIN_TIMEOUT_S = 30.0  # seconds; one decode step of a 135M model on CPU is < 1 s


@dataclass(eq=False)
class _Sequence:
    """One request while the engine holds it."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    generator: torch.Generator | None  # None for greedy requests
    stop_ids: frozenset[int]
    submitted: float
    started: float = 0.0
    first_token: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    aborted: bool = False  # set from the caller's thread when it gives up
    # (weight version, index of the first token it sampled), one entry per version change
    version_starts: list[tuple[int | str, int]] = field(default_factory=list)


@dataclass
class _Batch:
    """The running rows (row i in KV-cache slot i) and what each row feeds next."""

    rows: list[_Sequence]
    pending: torch.Tensor  # [B] long, the last sampled token (not yet in the cache)
    positions: torch.Tensor  # [B] long, tokens of each row in the cache = next position
    lengths: list[int]  # the same, as ints: the width a step attends to, without a sync


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
        check_supported(model)
        use_slot_attention(model)
        self._cache = SlotKVCache(model.config, max_batch_size, max_model_len, model.dtype)
        self._columns = torch.arange(max_model_len)
        self.stats = EngineStats()
        self.weight_version: int | str = 0  # set by POST /update_weight_version
        self._waiting: deque[_Sequence] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._gate = PauseGate()  # changed under self._cond: the decode loop reads it
        self._quiescent = False  # the loop has done what the pause mode asks
        # Work the loop runs between steps: (function, future for the caller), e.g. a reload.
        self._control: deque[tuple[Callable[[], None], concurrent.futures.Future[None]]] = deque()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> DecodeEngine:
        """Load ``cfg.model`` (see ``weights.load_causal_lm``) and wrap it; not started."""
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
            if not self.healthy:
                raise ReplicaError(f"engine for {self.model_name} is not running: {self._error!r}")
            self._gate.close(mode, lease_s)
            self._quiescent = False
            if mode == "abort":  # queued requests are in flight too, as in vLLM: end them now
                for seq in self._waiting:
                    self._finish(seq, "abort")
                self._waiting.clear()
                self.stats.waiting = 0
            self._cond.notify_all()
            while not self._quiescent and self.healthy and not self._stopping:
                self._cond.wait(timeout=1.0)  # seconds; re-check health if the loop dies

    def _run_in_loop(self, work: Callable[[], None]) -> concurrent.futures.Future[None]:
        """Run ``work`` in the decode thread between two steps; its future says how it went."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._cond:
            if not self.healthy:
                raise ReplicaError(f"engine for {self.model_name} is not running: {self._error!r}")
            self._control.append((work, future))
            self._cond.notify_all()
        return future

    async def submit(self, request: GenerationRequest) -> GenerationResult:
        self._validate(request)
        if not self.healthy:
            raise ReplicaError(f"engine for {self.model_name} is not running: {self._error!r}")
        loop = asyncio.get_running_loop()
        seq = _Sequence(
            request=request,
            loop=loop,
            future=loop.create_future(),
            generator=_generator_for(request),
            stop_ids=frozenset(request.stop_token_ids)
            | (frozenset() if request.ignore_eos else self.eos_token_ids),
            submitted=time.monotonic(),
        )
        with self._cond:
            self._waiting.append(seq)
            self.stats.waiting = len(self._waiting)
            self._cond.notify_all()
        try:
            return await seq.future
        except asyncio.CancelledError:
            seq.aborted = True  # the loop drops it at the next step boundary
            raise

    # -- validation (caller's thread) -------------------------------------------------

    def _validate(self, request: GenerationRequest) -> None:
        prompt_len = len(request.prompt_ids)
        if prompt_len + request.max_tokens > self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{prompt_len} prompt tokens + max_tokens {request.max_tokens} = "
                f"{prompt_len + request.max_tokens}; shorten the prompt or lower max_tokens"
            )
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestRejectedError(
                f"prompt token ids must lie in [0, {self.vocab_size}); got {bad[:5]}"
            )

    # -- the decode loop (engine thread) ----------------------------------------------

    def _run(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        batch: _Batch | None = None
        try:
            with torch.inference_mode():
                while True:
                    admitted = self._next_work(batch)
                    if admitted is None:
                        break  # stopping
                    self._run_control()
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

    def _next_work(self, batch: _Batch | None) -> list[_Sequence] | None:
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
            admitted: list[_Sequence] = []
            while self._waiting and running + len(admitted) < self.max_batch_size:
                seq = self._waiting.popleft()
                if seq.aborted:
                    self._finish(seq, "abort")
                else:
                    admitted.append(seq)
            self.stats.waiting = len(self._waiting)
        return admitted

    def _prefill(self, batch: _Batch | None, seqs: list[_Sequence]) -> _Batch:
        """Prefill ``seqs`` into the slots after the running rows; sample their first token."""
        now = time.monotonic()
        for seq in seqs:
            seq.started = now
        first_slot = len(batch.rows) if batch else 0
        lengths = [len(s.request.prompt_ids) for s in seqs]
        width = max(lengths)
        input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):  # right padding: causal attention never looks at it
            input_ids[i, : lengths[i]] = torch.tensor(seq.request.prompt_ids, dtype=torch.long)
        self._cache.ensure_capacity(width)
        self._cache.begin_prefill(first_slot)
        hidden = self.model.model(
            input_ids=input_ids,
            position_ids=self._columns[:width].expand(len(seqs), width),
            past_key_values=self._cache,
            use_cache=True,
        ).last_hidden_state
        last = torch.tensor(lengths) - 1
        logits = self.model.lm_head(hidden[torch.arange(len(seqs)), last])
        self.stats.prompt_tokens += sum(lengths)
        pending = self._sample(seqs, logits)
        first = time.monotonic()
        for seq in seqs:
            seq.first_token = first
        joining = _Batch(
            rows=seqs, pending=pending, positions=torch.tensor(lengths), lengths=lengths
        )
        return joining if batch is None else _join(batch, joining)

    def _decode_step(self, batch: _Batch) -> None:
        rows = len(batch.rows)
        width = max(batch.lengths) + 1  # the pending tokens go in at their positions
        self._cache.ensure_capacity(width)
        self._cache.begin_decode(batch.positions, width)
        # mask[i, j]: row i attends to column j, i.e. its own tokens up to its position;
        # none when every row is as long as the widest (SDPA then skips the masking).
        mask = None
        if min(batch.lengths) + 1 < width:
            mask = (self._columns[:width] <= batch.positions[:, None]).view(rows, 1, 1, width)
        hidden = self.model.model(
            input_ids=batch.pending[:, None],
            attention_mask=mask,
            position_ids=batch.positions[:, None],
            past_key_values=self._cache,
            use_cache=True,
        ).last_hidden_state
        batch.positions = batch.positions + 1
        batch.lengths = [n + 1 for n in batch.lengths]
        self.stats.steps += 1
        self.stats.batch_sizes[rows] += 1
        batch.pending = self._sample(batch.rows, self.model.lm_head(hidden[:, -1]))

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row, record it and its logprob, mark finished rows."""
        tokens, logprobs, tops = sample_tokens(
            logits.float(), [s.request for s in rows], [s.generator for s in rows]
        )
        version = self.weight_version  # read once: one step, one version
        # tolist(): one conversion for the batch, not one tensor read per row
        for i, (seq, token, logprob) in enumerate(
            zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if seq.finish_reason is not None:
                continue
            if not seq.version_starts or seq.version_starts[-1][0] != version:
                seq.version_starts.append((version, len(seq.token_ids)))
            self._append(seq, token, logprob, tops[i] if tops else None)
        self.stats.generation_tokens += len(rows)
        return tokens

    def _append(
        self, seq: _Sequence, token: int, logprob: float, top: dict[int, float] | None
    ) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if top is not None:
            seq.top_logprobs = (seq.top_logprobs or []) + [top]
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
            seq.stop_reason = token if token in seq.request.stop_token_ids else None
        elif len(seq.token_ids) >= seq.request.max_tokens:
            seq.finish_reason = "length"

    def _release_finished(self, batch: _Batch | None) -> _Batch | None:
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
            self._compact(batch, keep, done)
        self.stats.running = len(batch.rows)  # before callers hear back: they may read it
        for seq in finished:
            self._finish(seq, seq.finish_reason or "abort")  # never None here: it is in done
        return batch if batch.rows else None

    def _compact(self, batch: _Batch, keep: list[int], done: list[int]) -> None:
        """Drop rows ``done``: the last kept rows move (with their cache slots) into the
        holes below ``len(keep)``, so the batch stays slots ``0..len(keep)-1``."""
        holes = [i for i in done if i < len(keep)]
        movers = [i for i in keep if i >= len(keep)]
        order = list(range(len(batch.rows)))
        for hole, mover in zip(holes, movers, strict=True):
            self._cache.move(mover, hole, batch.lengths[mover])
            order[hole] = mover
        index = order[: len(keep)]
        batch.rows = [batch.rows[i] for i in index]
        batch.lengths = [batch.lengths[i] for i in index]
        selector = torch.tensor(index, dtype=torch.long)
        batch.pending = batch.pending[selector]
        batch.positions = batch.positions[selector]

    def _finish(self, seq: _Sequence, reason: FinishReason) -> None:
        now = time.monotonic()
        result = GenerationResult(
            request_id=seq.request.request_id,
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=seq.token_ids,
            logprobs=seq.logprobs,
            top_logprobs=seq.top_logprobs,
            finish_reason=reason,
            stop_reason=seq.stop_reason,
            weight_versions=version_spans(seq.version_starts, len(seq.token_ids)),
            timings=Timings(
                queue_s=(seq.started or now) - seq.submitted,
                ttft_s=(seq.first_token or now) - seq.submitted,
                e2e_s=now - seq.submitted,
            ),
        )
        _resolve(seq, result)

    def _run_control(self) -> None:
        while True:
            with self._cond:
                if not self._control:
                    return
                work, future = self._control.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it started: nothing was changed
            try:
                work()
            except Exception as exc:  # reported to the caller that asked for the work
                future.set_exception(exc)
            else:
                future.set_result(None)

    def _abort_all(self, batch: _Batch | None) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
            control, self._control = list(self._control), deque()
            self._quiescent = True
            self._cond.notify_all()
        for _, future in control:
            if future.set_running_or_notify_cancel():  # else its caller already went away
                future.set_exception(ReplicaError(f"engine for {self.model_name} stopped"))
        for seq in (batch.rows if batch else []) + waiting:
            if self._error is not None:
                _reject(
                    seq, ReplicaError(f"decode loop for {self.model_name} crashed: {self._error!r}")
                )
            else:
                self._finish(seq, "abort")
        self.stats.running = self.stats.waiting = 0


# -- sampling -------------------------------------------------------------------------


def sample_tokens(
    logits: torch.Tensor,
    requests: list[GenerationRequest],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor, list[dict[int, float]] | None]:
    """One token per row of float32 ``logits`` [B, V]: (tokens [B], logprobs [B], tops).

    Greedy rows (temperature 0) take the argmax and the plain log_softmax; the others
    sample from the processed distribution (temperature, then top-k, then top-p) and
    report its logprob, as vLLM's ``processed_logprobs`` does. Only the chosen tokens'
    logprobs are formed (``x - logsumexp``): no second B x V tensor per step.
    """
    temps = torch.tensor([r.sampling.temperature for r in requests], dtype=torch.float32)
    greedy = temps == 0
    if bool(greedy.all()):
        scaled, tokens = logits, logits.argmax(dim=-1)
        log_norm = torch.logsumexp(logits, dim=-1)
    else:
        # Greedy rows keep temperature 1 and skip top-k/top-p: their logprobs stay plain.
        scaled = logits / torch.where(greedy, 1.0, temps)[:, None]
        scaled = _apply_top_k(scaled, requests)
        scaled = _apply_top_p(scaled, requests)
        tokens, log_norm = _inverse_cdf(scaled, generators)
        if bool(greedy.any()):
            tokens = torch.where(greedy, scaled.argmax(dim=-1), tokens)
    chosen = scaled.gather(1, tokens[:, None]).squeeze(1) - log_norm
    tops = _top_logprobs(scaled, log_norm, tokens, chosen, requests)
    return tokens, chosen, tops


def _apply_top_k(scaled: torch.Tensor, requests: list[GenerationRequest]) -> torch.Tensor:
    ks = [
        r.sampling.top_k if r.sampling.top_k > 0 and not r.sampling.greedy else 0 for r in requests
    ]
    k_max = min(max(ks), scaled.shape[-1])
    if k_max <= 0:
        return scaled
    kth = torch.topk(scaled, k_max, dim=-1).values  # [B, k_max], descending
    index = torch.tensor([min(k, k_max) - 1 if k > 0 else 0 for k in ks])[:, None]
    threshold = kth.gather(1, index)
    threshold[torch.tensor([k == 0 for k in ks])] = float("-inf")
    return scaled.masked_fill(scaled < threshold, float("-inf"))


def _apply_top_p(scaled: torch.Tensor, requests: list[GenerationRequest]) -> torch.Tensor:
    ps = torch.tensor(
        [1.0 if r.sampling.greedy else r.sampling.top_p for r in requests], dtype=torch.float32
    )
    if bool((ps >= 1.0).all()):
        return scaled
    rows = torch.nonzero(ps < 1.0).squeeze(1)
    sub = scaled[rows]
    sorted_logits, order = sub.sort(dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token once the mass before it already reaches top_p (the first always stays).
    drop_sorted = (probs.cumsum(-1) - probs) >= ps[rows][:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    scaled = scaled.clone()
    scaled[rows] = sub.masked_fill(drop, float("-inf"))
    return scaled


def _inverse_cdf(
    scaled: torch.Tensor, generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw per row (one uniform from the row's own generator), and logsumexp."""
    peak = scaled.max(dim=-1, keepdim=True).values
    # float32 throughout: a float64 [32, 152k] temporary is mmapped and unmapped every step.
    cdf = (scaled - peak).exp_().cumsum_(dim=-1)
    total = cdf[:, -1]
    uniforms = torch.cat(
        [torch.rand(1, generator=g) if g is not None else torch.zeros(1) for g in generators]
    )
    targets = (uniforms * total).unsqueeze(1)
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1).clamp(max=cdf.shape[-1] - 1)
    # Float rounding can land the draw on a token with zero mass at the far end.
    impossible = scaled.gather(1, tokens[:, None]).squeeze(1) == float("-inf")
    if bool(impossible.any()):
        tokens = torch.where(impossible, scaled.argmax(dim=-1), tokens)
    return tokens, peak.squeeze(1) + total.log()


def _top_logprobs(
    scaled: torch.Tensor,
    log_norm: torch.Tensor,
    tokens: torch.Tensor,
    chosen: torch.Tensor,
    requests: list[GenerationRequest],
) -> list[dict[int, float]] | None:
    n_max = max(r.top_logprobs for r in requests)
    if n_max == 0:
        return None
    values, ids = torch.topk(scaled, n_max, dim=-1)
    values = values - log_norm[:, None]
    tops = []
    for i, request in enumerate(requests):
        n = request.top_logprobs
        top = {int(t): float(v) for t, v in zip(ids[i, :n], values[i, :n], strict=True)}
        top[int(tokens[i])] = float(chosen[i])  # the sampled token is always listed, as in vLLM
        tops.append(top)
    return tops


def _join(running: _Batch, joining: _Batch) -> _Batch:
    """``joining``'s rows (prefilled into the slots after ``running``'s) appended to it."""
    return _Batch(
        rows=running.rows + joining.rows,
        pending=torch.cat([running.pending, joining.pending]),
        positions=torch.cat([running.positions, joining.positions]),
        lengths=running.lengths + joining.lengths,
    )


# -- small helpers --------------------------------------------------------------------


def _generator_for(request: GenerationRequest) -> torch.Generator | None:
    if request.sampling.greedy:
        return None
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)


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


def _resolve(seq: _Sequence, result: GenerationResult) -> None:
    def deliver() -> None:
        if not seq.future.done():
            seq.future.set_result(result)

    _call_in_loop(seq, deliver)


def _reject(seq: _Sequence, error: BaseException) -> None:
    def deliver() -> None:
        if not seq.future.done():
            seq.future.set_exception(error)

    _call_in_loop(seq, deliver)


def _call_in_loop(seq: _Sequence, callback: Any) -> None:
    try:
        seq.loop.call_soon_threadsafe(callback)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass
