"""A continuous-batching decode engine for a torch causal LM (not HF ``generate()``).

One thread runs the decode loop. Each iteration:

1. admit waiting requests while the batch has room (``max_batch_size``);
2. prefill them together (left-padded), sample their first token, then merge their KV
   cache into the running batch's (left-padding the shorter cache, so every row's
   tokens end at the same column);
3. run one decode step for the whole batch and sample one token per row;
4. hand finished (or aborted) rows back to their callers and drop them from the batch.

Each row keeps a *pending* token: sampled but not yet in the KV cache. Positions come
from the attention mask (real tokens so far), so left padding never shifts them.

Sampling is done in float32 with inverse-CDF draws from each request's own
``torch.Generator`` (``torch.multinomial`` over a 152k vocabulary costs ~80 ms a step on
CPU; cumsum + searchsorted ~2 ms), and the logprob of each sampled token is taken in the
loop, never by keeping logits (B x vocab floats a step adds up to gigabytes).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rolloutbus.config import Config
from rolloutbus.errors import ReplicaError
from rolloutbus.replica.generation import (
    EngineStats,
    GenerationRequest,
    GenerationResult,
    RequestRejectedError,
    Timings,
)

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
    finish_reason: str | None = None
    stop_reason: int | None = None
    aborted: bool = False  # set from the caller's thread when it gives up


@dataclass
class _Batch:
    """The running rows, their shared KV cache and what each row feeds next."""

    rows: list[_Sequence]
    cache: Any  # transformers DynamicCache, [B, heads, T, head_dim] per layer
    mask: torch.Tensor  # [B, T] long, 1 = real token in the cache, 0 = left padding
    pending: torch.Tensor  # [B] long, the last sampled token (not yet in the cache)


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
        self.stats = EngineStats()
        self._waiting: deque[_Sequence] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> DecodeEngine:
        """Load ``cfg.model`` (see ``weights.load_causal_lm``) and wrap it; not started."""
        from rolloutbus.replica.weights import load_causal_lm

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
                    admitted = self._admit(batch)
                    if admitted is None:
                        break  # stopping
                    if admitted:
                        batch = _merge(batch, self._prefill(admitted))
                        batch = self._release_finished(batch)  # e.g. eos as first token
                    if batch is not None:
                        self._decode_step(batch)
                        batch = self._release_finished(batch)
        except Exception as exc:  # the loop must not die silently: fail every caller
            log.exception("decode loop for %s crashed", self.model_name)
            self._error = exc
        self._abort_all(batch)

    def _admit(self, batch: _Batch | None) -> list[_Sequence] | None:
        """Waiting requests that fit in the batch; blocks while there is nothing to do."""
        running = len(batch.rows) if batch else 0
        with self._cond:
            while not self._stopping and running == 0 and not self._waiting:
                self._cond.wait()
            if self._stopping:
                return None
            admitted: list[_Sequence] = []
            while self._waiting and running + len(admitted) < self.max_batch_size:
                seq = self._waiting.popleft()
                if seq.aborted:
                    self._finish(seq, "abort")
                else:
                    admitted.append(seq)
            self.stats.waiting = len(self._waiting)
        return admitted

    def _prefill(self, seqs: list[_Sequence]) -> _Batch:
        from transformers import DynamicCache

        now = time.monotonic()
        for seq in seqs:
            seq.started = now
        width = max(len(s.request.prompt_ids) for s in seqs)
        input_ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids = seq.request.prompt_ids
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[i, width - len(ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.prompt_tokens += int(mask.sum())
        _zero_padding(out.past_key_values, mask)
        pending = self._sample(seqs, out.logits[:, -1, :])
        first = time.monotonic()
        for seq in seqs:
            seq.first_token = first
        return _Batch(rows=seqs, cache=out.past_key_values, mask=mask, pending=pending)

    def _decode_step(self, batch: _Batch) -> None:
        positions = batch.mask.sum(-1, keepdim=True)  # real tokens already cached
        batch.mask = torch.cat([batch.mask, torch.ones_like(positions)], dim=-1)
        out = self.model(
            input_ids=batch.pending[:, None],
            attention_mask=batch.mask,
            position_ids=positions,
            past_key_values=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.cache = out.past_key_values
        self.stats.steps += 1
        self.stats.batch_sizes[len(batch.rows)] += 1
        batch.pending = self._sample(batch.rows, out.logits[:, -1, :])

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Sample one token per row, record it and its logprob, mark finished rows."""
        tokens, logprobs, tops = sample_tokens(
            logits.float(), [s.request for s in rows], [s.generator for s in rows]
        )
        for i, seq in enumerate(rows):
            if seq.finish_reason is not None:
                continue
            self._append(seq, int(tokens[i]), float(logprobs[i]), tops[i] if tops else None)
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
        keep, done = [], []
        for i, seq in enumerate(batch.rows):
            if seq.aborted and seq.finish_reason is None:
                seq.finish_reason = "abort"
            (keep if seq.finish_reason is None else done).append(i)
        finished = [batch.rows[i] for i in done]
        if done:
            _select_rows(batch, keep)
        self.stats.running = len(batch.rows)  # before callers hear back: they may read it
        for seq in finished:
            self._finish(seq, seq.finish_reason)
        return batch if batch.rows else None

    def _finish(self, seq: _Sequence, reason: str) -> None:
        now = time.monotonic()
        result = GenerationResult(
            request_id=seq.request.request_id,
            prompt_ids=list(seq.request.prompt_ids),
            token_ids=seq.token_ids,
            logprobs=seq.logprobs,
            top_logprobs=seq.top_logprobs,
            finish_reason=reason,
            stop_reason=seq.stop_reason,
            timings=Timings(
                queue_s=(seq.started or now) - seq.submitted,
                ttft_s=(seq.first_token or now) - seq.submitted,
                e2e_s=now - seq.submitted,
            ),
        )
        _resolve(seq, result)

    def _abort_all(self, batch: _Batch | None) -> None:
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
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


# -- KV cache surgery -----------------------------------------------------------------


def _merge(running: _Batch | None, joining: _Batch) -> _Batch:
    """Append ``joining``'s rows to ``running``'s, left-padding the shorter cache."""
    if running is None or not running.rows:
        return joining
    width = max(running.mask.shape[1], joining.mask.shape[1])
    for mine, theirs in zip(running.cache.layers, joining.cache.layers, strict=True):
        mine.keys = torch.cat([_pad_left(mine.keys, width, -2), _pad_left(theirs.keys, width, -2)])
        mine.values = torch.cat(
            [_pad_left(mine.values, width, -2), _pad_left(theirs.values, width, -2)]
        )
    running.mask = torch.cat(
        [_pad_left(running.mask, width, -1), _pad_left(joining.mask, width, -1)]
    )
    running.pending = torch.cat([running.pending, joining.pending])
    running.rows = running.rows + joining.rows
    return running


def _select_rows(batch: _Batch, keep: list[int]) -> None:
    """Keep only rows ``keep`` and drop cache columns that are padding for every row."""
    batch.rows = [batch.rows[i] for i in keep]
    if not keep:
        return
    index = torch.tensor(keep, dtype=torch.long)
    mask = batch.mask[index]
    first = int(mask.any(dim=0).nonzero()[0]) if bool(mask.any()) else 0
    batch.mask = mask[:, first:]
    batch.pending = batch.pending[index]
    for layer in batch.cache.layers:
        layer.keys = layer.keys[index, :, first:]
        layer.values = layer.values[index, :, first:]


def _pad_left(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    pad = [0, 0] * (-dim - 1) + [missing, 0]
    return F.pad(tensor, pad)


def _zero_padding(cache: Any, mask: torch.Tensor) -> None:
    """Zero the cache at padded positions: whatever the model computed there stays inert."""
    if bool(mask.all()):
        return
    keep = mask.bool()[:, None, :, None]
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise ReplicaError(
                f"unsupported KV cache layer {type(layer).__name__} (sliding window?)"
            )
        layer.keys = torch.where(keep, layer.keys, 0.0)
        layer.values = torch.where(keep, layer.values, 0.0)


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
