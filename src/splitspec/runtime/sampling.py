"""Token selection at verify time: greedy, speculative (rejection) sampling, and synthetic acceptance.

Speculative sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023, arXiv:2302.01318):
draft token d_i proposed with probability q_i is accepted with probability min(1, p_i(d_i)/q_i(d_i));
on rejection the token is drawn from norm(max(0, p_i − q_i)); if all k drafts are accepted a bonus token is
drawn from p_k. The emitted tokens are then distributed exactly as target-only sampling from p.
Our drafter proposes greedily, so q_i is one-hot on d_i: accept with probability p_i(d_i), resample
from p_i with d_i removed.

Logits stay on the engine's device (the CPU or a GPU): every random number comes from the request's CPU generator
(``Sequence.gen``, seeded by ``SamplingParams.seed``), drawn before the cycle (:class:`SampledDraw`), and the decision
is made on the device (:mod:`splitspec.engine.acceptance`); only its result crosses to the host, in one copy.
"""

from __future__ import annotations

import torch

from splitspec.engine.acceptance import greedy_ids, inverse_transform, sampled_decisions, target_probs
from splitspec.engine.plan import SampledDraw
from splitspec.runtime.types import SamplingParams

__all__ = ["SampledDraw", "SamplingParams", "draw", "draw_cycle", "greedy_ids", "greedy_token", "read_decision",
           "synthetic_accept", "target_probs", "verify", "verify_synthetic"]


def draw_cycle(params: SamplingParams, k: int, gen: torch.Generator | None) -> SampledDraw:
    """A sampled cycle's random numbers for ``k`` drafts, from the request's generator ``gen``: k float32 uniforms
    for the acceptance tests, then one float64 for the token drawn after them."""
    u = tuple(torch.rand(k, generator=gen).tolist()) if k else ()
    v = float(torch.rand(1, generator=gen, dtype=torch.float64))
    return SampledDraw(params.temperature, params.top_p, params.top_k, u, v)


def draw(weights: torch.Tensor, gen: torch.Generator | None) -> int:
    """One index of ``weights`` [V] (≥ 0, not all 0, any device, not normalised) drawn with probability weights[i] /
    Σ weights: a float64 uniform from the CPU generator ``gen``, then :func:`inverse_transform` where the weights are
    (one wait for the device, for the index and Σ together). Raises ValueError when Σ is 0, NaN or infinite (NaN or
    inf in the logits)."""
    if weights.ndim != 1 or not weights.numel():
        raise ValueError(f"draw: weights of shape {tuple(weights.shape)}, expected one non-empty row [V]")
    v = torch.rand(1, generator=gen, dtype=torch.float64).to(weights.device)
    index, s = inverse_transform(weights[None], v)[0].tolist()  # the one copy to the host
    _check_sum(s)
    return int(index)


def _check_sum(s: float) -> None:
    if not 0 < s < float("inf"):
        raise ValueError(f"draw: weights sum to {s}, expected a finite sum > 0 (NaN or inf in the logits?)")


def greedy_token(token: int, row: int) -> int:
    """A row's argmax as copied to the host (:func:`~splitspec.engine.acceptance.greedy_ids`); raises ValueError for
    −1, a row whose largest logit is NaN or inf."""
    if token < 0:
        raise ValueError(f"greedy: the target's logits at verified row {row} are NaN or inf, expected finite values")
    return token


def read_decision(values: list[int], drafts: list[int]) -> tuple[int, list[int]]:
    """A sampled sequence's decision as copied to the host (a row of :func:`sampled_decisions`: accepted a, the token
    after, whether its row could be drawn from) → (a, emitted tokens). Raises ValueError when it could not (the
    weights summed to 0, NaN or inf)."""
    a, index, ok = values
    if not ok:
        raise ValueError("draw: weights sum to 0, NaN or inf, expected a finite sum > 0 (NaN or inf in the logits?)")
    return a, drafts[:a] + [index]


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, sampled: SampledDraw | None = None,
           best: list[int] | None = None) -> tuple[int, list[int]]:
    """Decide one sequence's cycle.

    Args:
        logits: [k+1, V] target logits at the verified positions, on any device.
        drafts: the k draft tokens (target ids), proposed greedily.
        sampled: the cycle's random numbers (:func:`draw_cycle`, from the request's generator); needed unless
            ``params`` is greedy.
        best: the rows' argmax when already on the host (saves a device-to-host copy), −1 for a row whose largest
            logit is NaN or inf (:func:`~splitspec.engine.acceptance.greedy_ids`).
    Returns:
        (number of drafts accepted a, emitted tokens = drafts[:a] + [one target token]).
    Raises:
        ValueError: the row the token comes from holds NaN or inf (greedy: its largest logit; sampled: the weights).
    """
    k = len(drafts)
    if params.greedy:
        best = best if best is not None else greedy_ids(logits).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        return a, drafts[:a] + [greedy_token(best[a], a)]
    if sampled is None or len(sampled.u) < k:
        raise ValueError(f"verify: a sampled cycle of {k} drafts needs {k} uniforms drawn before it, got {sampled}")
    d = torch.tensor(drafts, dtype=torch.long, device=logits.device)[None]
    return read_decision(sampled_decisions(logits[None], d, [sampled])[0].tolist(), drafts)  # one copy to the host


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
    return a, drafts[:a] + [greedy_token(best[a] if best is not None else int(greedy_ids(logits[a:a + 1])[0]), a)]
