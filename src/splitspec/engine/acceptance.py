"""The verify's acceptance rules as device-tensor functions: no copy to the host, so that the leader's host and a
draft launched ahead (:mod:`splitspec.engine.draft_ahead`) act on one decision computed once.

Greedy: a sequence accepts its leading drafts equal to the target's argmax there, then the argmax after them.

Sampled — speculative (rejection) sampling with a greedy drafter (Leviathan et al. 2023, arXiv:2211.17192; Chen et
al. 2023, arXiv:2302.01318): the drafter proposes d_i with q_i one-hot on d_i, so draft i is accepted when
u_i < p_i(d_i); at the first rejection the token is drawn from p_i with d_i removed (norm(max(0, p_i − q_i))), and
after k acceptances from p_k. Every random number is drawn by the host from the request's generator before the cycle
(:class:`~splitspec.engine.plan.SampledDraw`): k float32 uniforms for the tests, then one float64 for the inverse-transform draw — the
order :func:`splitspec.runtime.sampling.verify` has always drawn them in, so a seed gives the same stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitspec.engine.plan import SampledDraw
from splitspec.models import batch

SCAN_BLOCK = 1024  # elements per block of blocked_cumsum


def blocked_cumsum(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum over the last dimension of ``x`` [..., V] (same dtype): ``x.cumsum(-1)`` up to rounding. Above
    :data:`SCAN_BLOCK` elements, as a scan within blocks of SCAN_BLOCK plus the exclusive scan of the blocks' totals:
    on a GPU torch scans each row of a multi-row tensor in one thread block (0.2 ms for a row of 163,840 on an H100,
    whatever the number of rows), while the blocks run in parallel. The form depends on V only, never on how many
    rows are scanned together: on a CPU a row's sums, so a seeded request's tokens, do not depend on its batch (on a
    GPU torch scans a lone row with cub's device-wide scan and several with its row kernel, which may round
    differently). A GPU's scan is not sequential, so over a run of zeros the sum may dip by an ulp
    (docs/lab/2026-12-05-h100-draft-ahead-sampled)."""
    V = x.shape[-1]
    if V <= SCAN_BLOCK:
        return x.cumsum(-1)
    nb = -(-V // SCAN_BLOCK)
    padded = x if V == nb * SCAN_BLOCK else F.pad(x, (0, nb * SCAN_BLOCK - V))
    inner = padded.reshape(*x.shape[:-1], nb, SCAN_BLOCK).cumsum(-1)
    before = F.pad(inner[..., :-1, -1].cumsum(-1), (1, 0))  # the sum of the blocks before each block
    return (inner + before[..., None]).flatten(-2)[..., :V]


def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
    """Filtered sampling distribution: logits [..., V] → probabilities [..., V] float32 (temperature, then top-k,
    then top-p: the smallest prefix of the sorted probabilities reaching top_p); ``params`` has ``temperature`` > 0,
    ``top_k`` (0: all) and ``top_p`` in (0, 1]."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    p = x.softmax(-1)
    del x  # not alive through the sort
    if params.top_p < 1:
        sp, idx = p.sort(-1, descending=True)
        drop = blocked_cumsum(sp) - sp >= params.top_p  # keep the smallest prefix reaching top_p
        p = p.masked_fill(drop.scatter(-1, idx, drop), 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def inverse_transform(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Per row of ``weights`` [R, V] (≥ 0, not normalised), the first index whose cumulative sum (float64,
    :func:`blocked_cumsum`) exceeds v · Σ, for ``v`` [R] float64 uniforms in [0, 1): index i with probability
    weights[i] / Σ. A weight of 0 is never drawn (nor past the last positive one, should v · Σ round up to Σ).
    Returns [R, 2] float64: index, Σ (checked by the reader: 0, NaN or inf mean the row cannot be drawn from)."""
    c = blocked_cumsum(weights.double()).contiguous()
    total = c[:, -1:].contiguous()
    i = torch.minimum(torch.searchsorted(c, v[:, None] * total, right=True), torch.searchsorted(c, total))
    return torch.cat((i.double(), total), 1)


def greedy_ids(logits: torch.Tensor, best: torch.Tensor | None = None) -> torch.Tensor:
    """The target's argmax per row of ``logits`` [R, V] (``best`` [R] int64 when taken already) as int64 [R], −1
    where the row's largest value is NaN or ±inf — torch's argmax picks a NaN first, so one gather finds it — so
    that the host refuses that row (:func:`splitspec.runtime.sampling.verify`) instead of emitting a token no
    finite logit chose."""
    best = logits.argmax(-1) if best is None else best
    return torch.where(torch.isfinite(logits.gather(-1, best[..., None])[..., 0]), best, -1)


def accepted(best: torch.Tensor, drafts: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per sequence, a [B] int64: ``forced[b]`` where it is ≥ 0 (decided already: synthetic
    acceptance, or a sampled decision), else the number of leading drafts equal to the target's argmax at their
    position (greedy).

    best [B, k + 1] int64 (the target's argmax at the verified positions), drafts [B, k] int64, forced [B] int64."""
    k = drafts.shape[1]
    miss = drafts != best[:, :k]
    match = torch.where(miss.any(1), miss.int().argmax(1), k)  # the first draft that differs (argmax: the first max)
    return torch.where(forced >= 0, forced, match)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a tensor on ``device``, through pinned memory on a GPU: a copy from pageable memory would wait
    for the stream's queued work (the verify) first."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def sampled_decisions(logits: torch.Tensor, drafts: torch.Tensor, draws: list[SampledDraw]) -> torch.Tensor:
    """Speculative sampling for S sequences sharing one filter: logits [S, k + 1, V] at the verified positions,
    drafts [S, k] int64 (target ids), ``draws`` their S :class:`SampledDraw` (equal filters, k uniforms each).
    Returns [S, 3] int64 on the logits' device: drafts accepted a, the token after them, and 1 where the row it was
    drawn from could be drawn from (its Σ finite and > 0; 0 for NaN or inf logits: :func:`inverse_transform`)."""
    S, n, V = logits.shape
    k, dev = n - 1, logits.device
    p = target_probs(logits, draws[0])
    x = to_device([d.u[:k] + (d.v,) for d in draws], torch.float64, dev)  # float32 values are float64 values too
    if k:
        refused = ~(x[:, :k].float() < p[:, :k].gather(2, drafts[:, :, None])[..., 0])  # NaN refuses: u < NaN is False
        a = torch.cat((refused, refused.new_ones(S, 1)), 1).int().argmax(1)  # the first refusal, else k
    else:
        a = torch.zeros(S, dtype=torch.int64, device=dev)
    row = p.gather(1, a[:, None, None].expand(S, 1, V))[:, 0]
    d = torch.cat((drafts, drafts.new_zeros(S, 1)), 1).gather(1, a[:, None])  # the rejected draft (a < k)
    row = row.scatter(1, d, torch.where(a[:, None] < k, 0.0, row.gather(1, d)))  # removed from what is drawn
    index, total = inverse_transform(row, x[:, k]).unbind(1)
    # a row of NaN or inf draws index V: kept a token id (refused by the reader) for a draft launched ahead to embed
    return torch.stack((a, index.long().clamp(max=V - 1), ((total > 0) & (total < float("inf"))).long()), 1)


def sampled_rows(work, logits: torch.Tensor, drafts: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
    """:func:`sampled_decisions` for the works of a steady cycle that carry a :class:`SampledDraw` (``SeqWork.sampled``),
    grouped by filter, in chunks of at most :data:`~splitspec.models.batch.SAMPLING_CHUNK` logits (at least one
    sequence). logits [B, k + 1, V], drafts [B, k]. Returns the works' indices and their decisions [S, 3] in that
    order (None when no work samples)."""
    groups: dict[tuple, list[int]] = {}
    for b, w in enumerate(work):
        if w.sampled is not None:
            groups.setdefault(w.sampled.filter, []).append(b)
    if not groups:
        return [], None
    per_chunk = max(1, batch.SAMPLING_CHUNK // (logits.shape[1] * logits.shape[2]))
    rows, parts = [], []
    for g in groups.values():
        for c in range(0, len(g), per_chunk):
            chunk = g[c:c + per_chunk]
            draws = [work[b].sampled for b in chunk]
            if chunk == list(range(chunk[0], chunk[-1] + 1)):  # consecutive works: a slice, no gather
                parts.append(sampled_decisions(logits[chunk[0]:chunk[-1] + 1], drafts[chunk[0]:chunk[-1] + 1], draws))
            else:
                i = to_device(chunk, torch.int64, logits.device)
                parts.append(sampled_decisions(logits[i], drafts[i], draws))
            rows += chunk
    return rows, torch.cat(parts) if len(parts) > 1 else parts[0]
