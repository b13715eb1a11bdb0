"""Sampling one token per row of a decode step, in float32, with each request's generator.

Sampling is done in float32 (also for a bfloat16 model: its logits are cast first, and the
logprob returned is that of the float32 distribution the token was drawn from) with
inverse-CDF draws from each request's own ``torch.Generator`` (``torch.multinomial`` over a
152k vocabulary costs ~80 ms a step on CPU; cumsum + searchsorted ~2 ms), and the logprob of
each sampled token is taken in the loop, never by keeping logits.
"""

from __future__ import annotations

import secrets

import torch

from rolloutbus.replica.generation import GenerationRequest

__all__ = ["generator_for", "sample_tokens"]


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


def generator_for(request: GenerationRequest) -> torch.Generator | None:
    """The request's own generator (seeded when it gives a seed); None for a greedy one."""
    if request.sampling.greedy:
        return None
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)
