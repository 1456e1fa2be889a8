"""Token selection at verify time: greedy, speculative (rejection) sampling, and synthetic acceptance.

Speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318):
draft token d_i proposed with probability q_i is accepted with probability min(1, p_i(d_i)/q_i(d_i));
on rejection the token is drawn from norm(max(0, p_i − q_i)); if all k drafts are accepted a bonus token is
drawn from p_k. The emitted tokens are then distributed exactly as target-only sampling from p.
Our drafter proposes greedily, so q_i is one-hot on d_i: accept with probability p_i(d_i), resample
from p_i with d_i removed.

Logits stay on the engine's device (the CPU or a GPU): every random number comes from the request's CPU generator
(``Sequence.gen``, seeded by ``SamplingParams.seed``), and only what the decisions need crosses to the host — the k
drafts' probabilities, and the index :func:`draw` finds by inverse transform on the device.
"""

from __future__ import annotations


import torch

from splitspec.runtime.types import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Filtered sampling distribution: logits [R, V] → probabilities [R, V] float32 (temperature, top-k, top-p)."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = x.softmax(-1)
    if params.top_p < 1:
        sp, idx = p.sort(-1, descending=True)
        drop = sp.cumsum(-1) - sp >= params.top_p  # keep the smallest prefix reaching top_p
        p = p.masked_fill(drop.scatter(-1, idx, drop), 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """One index of ``weights`` [V] (≥ 0, not all 0, any device, not normalised) drawn with probability weights[i] /
    Σ weights, by inverse transform sampling: a uniform u in [0, 1) from the CPU generator ``gen``, then the first i
    whose cumulative sum (float64) exceeds u · Σ weights, searched where the weights are (one wait for the device, for
    the index and Σ together). A weight of 0 is never drawn (nor past the last positive one, should u · Σ round up to
    Σ). Raises ValueError when Σ is 0, NaN or infinite (NaN or inf in the logits): the search would then return an
    index past the end, or a weight of 0."""
    if weights.ndim != 1 or not weights.numel():
        raise ValueError(f"draw: weights of shape {tuple(weights.shape)}, expected one non-empty row [V]")
    c = weights.double().cumsum(0)
    total = c[-1:]
    u = torch.rand(1, generator=gen, dtype=torch.float64).to(c.device) * total
    i = torch.minimum(torch.searchsorted(c, u, right=True), torch.searchsorted(c, total))
    index, s = torch.cat((i.double(), total)).tolist()  # the one copy to the host
    if not 0 < s < float("inf"):
        raise ValueError(f"draw: weights sum to {s}, expected a finite sum > 0 (NaN or inf in the logits?)")
    return int(index)


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, gen: torch.Generator | None,
           best: list[int] | None = None) -> tuple[int, list[int]]:
    """Decide one sequence's cycle.

    Args:
        logits: [k+1, V] target logits at the verified positions, on any device.
        drafts: the k draft tokens (target ids), proposed greedily.
        gen: the request's generator (CPU).
        best: the rows' argmax when already on the host (saves a device-to-host copy).
    Returns:
        (number of drafts accepted a, emitted tokens = drafts[:a] + [one target token]).
    """
    k = len(drafts)
    if params.greedy:
        best = best if best is not None else logits.argmax(-1).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        return a, drafts[:a] + [best[a]]
    p = target_probs(logits, params)
    u = torch.rand(k, generator=gen).tolist() if k else []
    # p_i(d_i) for the k drafts, in one copy to the host
    accept = p[torch.arange(k, device=p.device), torch.tensor(drafts, dtype=torch.long, device=p.device)].tolist() if k else []
    for i, d in enumerate(drafts):
        if u[i] < accept[i]:
            continue
        residual = p[i].clone()
        residual[d] = 0.0
        return i, drafts[:i] + [draw(residual, gen)]
    return k, drafts + [draw(p[k], gen)]


def synthetic_accept(k: int, profile: list[float], gen: torch.Generator) -> int:
    """Benchmark-only: how many of k drafts a cycle accepts when draft i is accepted with conditional probability
    ``profile[i]`` (the last entry for positions past it) regardless of its value. Drawn from the request's generator
    before the cycle runs (:attr:`SeqWork.accept`), so that the device can act on it before the host sees the
    verify (:mod:`splitspec.engine.draft_ahead`)."""
    a = 0
    while a < k and float(torch.rand(1, generator=gen)) < profile[min(a, len(profile) - 1)]:
        a += 1
    return a


def verify_synthetic(logits: torch.Tensor, drafts: list[int], a: int, best: list[int] | None = None) -> tuple[int, list[int]]:
    """Benchmark-only: accept the first ``a`` drafts (:func:`synthetic_accept`); the token after them is the target's
    argmax there, from ``best`` (the rows' argmax, already on the host) when given — so that the benchmark's host work
    per cycle is the greedy path's, without a device-to-host wait per sequence — else from ``logits``.

    Output tokens are NOT the target's; only the costs (cycle counts, KV use) are realistic.
    """
    if not 0 <= a <= len(drafts):
        raise ValueError(f"verify_synthetic: {a} drafts accepted of {len(drafts)}")
    return a, drafts[:a] + [best[a] if best is not None else int(logits[a].argmax())]
