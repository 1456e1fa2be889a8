"""The sampled acceptance rule on the device (:func:`splitspec.engine.acceptance.sampled_decisions`) against a host
reference written from the rule itself: Python floats for the acceptance tests, numpy's float64 cumulative sum for
the draw — the same random numbers, consumed in the same order, give the same decisions, one sequence at a time and
batched with others."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitspec.engine.acceptance import (SCAN_BLOCK, blocked_cumsum, greedy_ids, sampled_decisions, sampled_rows,
                                       target_probs)
from splitspec.engine.plan import SampledDraw, SeqWork
from splitspec.runtime.sampling import draw_cycle, read_decision, verify
from splitspec.runtime.types import SamplingParams


def reference(logits: torch.Tensor, drafts: list[int], params: SamplingParams, gen: torch.Generator) -> tuple[int, list[int]]:
    """Speculative sampling with a greedy drafter, one draft at a time on the host: accept d_i when u_i < p_i(d_i), else
    draw from p_i without d_i; after k acceptances draw from p_k. k float32 uniforms first, then one float64."""
    p = target_probs(logits, params).numpy()
    k = len(drafts)
    u = torch.rand(k, generator=gen).tolist() if k else []
    v = float(torch.rand(1, generator=gen, dtype=torch.float64))
    a = next((i for i in range(k) if not u[i] < float(p[i, drafts[i]])), k)
    row = p[a].copy()
    if a < k:
        row[drafts[a]] = 0.0
    c = np.cumsum(row.astype(np.float64))
    index = min(int(np.searchsorted(c, v * c[-1], side="right")), int(np.searchsorted(c, c[-1], side="left")))
    return a, drafts[:a] + [index]


FILTERS = [SamplingParams(1.0), SamplingParams(0.7, top_p=0.9), SamplingParams(1.3, top_k=5), SamplingParams(0.5, 0.8, 12)]


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_one_sequence_matches_the_host_reference(k):
    """400 cycles per k over random logits sharp enough that drafts are often accepted, drafts drawn half from the
    argmax and half at random, each filter: verify() (one sequence, through the device rule) equals the reference."""
    g = torch.Generator().manual_seed(k)
    for trial in range(400):
        sp = FILTERS[trial % len(FILTERS)]
        logits = torch.randn(k + 1, 50, generator=g) * 3
        drafts = [int(logits[i].argmax()) if torch.rand(1, generator=g) < 0.5 else int(torch.randint(0, 50, (1,), generator=g))
                  for i in range(k)]
        seed = int(torch.randint(0, 2**31, (1,), generator=g))
        want = reference(logits, drafts, sp, torch.Generator().manual_seed(seed))
        got = verify(logits, drafts, sp, draw_cycle(sp, k, torch.Generator().manual_seed(seed)))
        assert got == want, (trial, sp, drafts)


@pytest.mark.parametrize("V", [1, SCAN_BLOCK - 1, SCAN_BLOCK, SCAN_BLOCK + 1, 5 * SCAN_BLOCK, 5 * SCAN_BLOCK + 7])
@pytest.mark.parametrize("rows", [(1, 2), (3, 8)])
def test_blocked_cumsum_is_the_cumulative_sum(V, rows):
    """Blocks of SCAN_BLOCK plus the sum of the blocks before: numpy's sequential sum, float64 and float32, and on
    the CPU never decreasing over weights ≥ 0."""
    x = torch.rand(*rows, V, generator=torch.Generator().manual_seed(V), dtype=torch.float64)
    x[0, 1, V // 2:] = 0.0  # a run of zero weights: equal sums, not smaller ones
    want = np.cumsum(x.numpy(), -1)
    got = blocked_cumsum(x)
    assert got.shape == x.shape and np.allclose(got.numpy(), want, rtol=1e-13, atol=0)
    assert (got.diff(dim=-1) >= 0).all()
    assert np.allclose(blocked_cumsum(x.float()).numpy(), want, rtol=2e-6)


def test_a_rows_sums_do_not_depend_on_the_rows_beside_it():
    """The top-p filter's scan of 8 sequences' k + 1 = 4 rows together gives each sequence's rows the sums they get
    alone, bit for bit, float32 and float64: a seeded request's tokens must not depend on its batch."""
    x = torch.rand(8, 4, 5 * SCAN_BLOCK + 7, generator=torch.Generator().manual_seed(2))
    for t in (x, x.double()):
        together = blocked_cumsum(t)
        for b in range(8):
            assert torch.equal(blocked_cumsum(t[b]), together[b]) and torch.equal(blocked_cumsum(t[b, :1]), together[b, :1])


def test_a_vocabulary_of_several_scan_blocks_matches_the_host_reference():
    """V = 3000 (three scan blocks), k 2, 12 sequences a cycle (blocked scans in sampled_rows), each filter: every
    decision equals the one-sequence reference; NaN logits there are still refused with a token id in the vocabulary."""
    g = torch.Generator().manual_seed(11)
    k, V, B = 2, 3000, 12
    for trial in range(12):
        sp = FILTERS[trial % len(FILTERS)]
        logits = torch.randn(B, k + 1, V, generator=g) * 4
        drafts = logits[:, :k].argmax(-1)
        drafts[::2, 1] = torch.randint(0, V, (B // 2,), generator=g)  # drafts the target does not favour
        seeds = torch.randint(0, 2**31, (B,), generator=g).tolist()
        work = [SeqWork(b, [], "decode", 0, [0], k=k, sampled=draw_cycle(sp, k, torch.Generator().manual_seed(s)))
                for b, s in enumerate(seeds)]
        rows, decisions = sampled_rows(work, logits, drafts)
        for b, values in zip(rows, decisions.tolist()):
            want = reference(logits[b], drafts[b].tolist(), sp, torch.Generator().manual_seed(seeds[b]))
            assert read_decision(values, drafts[b].tolist()) == want, (trial, sp, b)
    nan = torch.full((B, k + 1, V), float("nan"))
    decisions = sampled_decisions(nan, drafts, [draw_cycle(FILTERS[1], k, g) for _ in range(B)])
    assert (decisions[:, 2] == 0).all() and (decisions[:, 1] >= 0).all() and (decisions[:, 1] < V).all()


def test_a_batch_grouped_by_filter_matches_each_sequence_alone():
    """sampled_rows over 7 works (two greedy, five sampled with three filters): the decisions, in the order of the
    indices it returns, are each sequence's own."""
    g = torch.Generator().manual_seed(3)
    k, V = 3, 40
    logits = torch.randn(7, k + 1, V, generator=g) * 3
    drafts = logits[:, :k].argmax(-1)
    drafts[2, 1] = (drafts[2, 1] + 1) % V  # a draft the target does not favour
    filters = [None, FILTERS[1], FILTERS[0], None, FILTERS[1], FILTERS[2], FILTERS[0]]
    work = [SeqWork(b, [], "decode", 0, [0], k=k, sampled=None if f is None else draw_cycle(f, k, torch.Generator().manual_seed(b)))
            for b, f in enumerate(filters)]
    rows, decisions = sampled_rows(work, logits, drafts)
    assert sorted(rows) == [1, 2, 4, 5, 6] and decisions.shape == (5, 3)
    for b, values in zip(rows, decisions.tolist()):
        want = reference(logits[b], drafts[b].tolist(), filters[b], torch.Generator().manual_seed(b))
        assert read_decision(values, drafts[b].tolist()) == want, b
    assert sampled_rows(work[:1] + work[3:4], logits, drafts) == ([], None)


def test_chunks_decide_what_one_call_decides(monkeypatch):
    """Chunks of at most SAMPLING_CHUNK logits (here 2 sequences, then 1), slices for consecutive works and gathers
    for the rest: the same decisions for each work as in one call."""
    from splitspec.models import batch

    g = torch.Generator().manual_seed(5)
    k, V = 2, 30
    logits = torch.randn(9, k + 1, V, generator=g) * 3
    drafts = logits[:, :k].argmax(-1)
    filters = [FILTERS[b % 2] if b != 4 else None for b in range(9)]
    work = [SeqWork(b, [], "decode", 0, [0], k=k, sampled=None if f is None else draw_cycle(f, k, torch.Generator().manual_seed(b)))
            for b, f in enumerate(filters)]
    rows, whole = sampled_rows(work, logits, drafts)
    want = dict(zip(rows, whole.tolist()))
    for per_chunk in (2, 1):
        monkeypatch.setattr(batch, "SAMPLING_CHUNK", per_chunk * (k + 1) * V)
        rows, chunked = sampled_rows(work, logits, drafts)
        assert dict(zip(rows, chunked.tolist())) == want and sorted(rows) == sorted(want)


def test_distribution_of_the_emitted_tokens():
    """20,000 cycles of k 2 on fixed logits: the first emitted token follows p_0 (the rejection rule's guarantee), by a
    chi-square test — drafts accepted or not, resampled or bonus."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g) * 1.5
    sp = SamplingParams(1.0)
    drafts = [int(logits[0].argmax()), 4]
    draws = [draw_cycle(sp, 2, g) for _ in range(20_000)]
    d = torch.tensor([drafts] * len(draws))
    out = sampled_decisions(logits.expand(len(draws), 3, 12), d, draws)
    first = [drafts[0] if a >= 1 else int(t) for a, t, _ in out.tolist()]
    p = target_probs(logits[0], sp).double()
    assert chisquare(torch.bincount(torch.tensor(first), minlength=12).numpy(), (p * len(first)).numpy()).pvalue > 1e-3


def test_nan_logits_are_refused_by_name():
    """NaN logits at the rejected position: the decision's Σ says so and the reader refuses it (a ValueError naming the
    draw), as the host draw always did; a NaN only past the decided row does not matter."""
    sp = SamplingParams(1.0)
    logits = torch.randn(3, 8)
    logits[0] = float("nan")
    with pytest.raises(ValueError, match="draw: weights sum to 0, NaN or inf"):
        verify(logits, [1, 2], sp, SampledDraw(1.0, 1.0, 0, (0.5, 0.5), 0.5))
    ok = torch.full((3, 8), -10.0)
    ok[0, 1] = ok[1, 3] = 10.0
    ok[2] = float("nan")  # row 2 is never read: draft 1 is refused at row 1 (p(2) ≈ 0)
    a, new = verify(ok, [1, 2], sp, SampledDraw(1.0, 1.0, 0, (0.5, 0.5), 0.5))
    assert (a, new) == (1, [1, 3])
    # the device's decision keeps a token id in the vocabulary (a draft launched ahead embeds it), flagged undrawable
    bad = torch.full((1, 3, 8), float("nan"))
    assert sampled_decisions(bad, torch.tensor([[1, 2]]), [SampledDraw(1.0, 1.0, 0, (0.5, 0.5), 0.5)]).tolist() == [[0, 7, 0]]
    with pytest.raises(ValueError, match="2 drafts needs 2 uniforms"):
        verify(ok, [1, 2], sp, SampledDraw(1.0, 1.0, 0, (0.5,), 0.5))


def test_greedy_ids_mark_rows_whose_largest_logit_is_not_finite():
    """argmax per row, −1 where the largest value is NaN (argmax picks it first), +inf, or the row is all −inf; a row
    with some −inf and a finite maximum keeps its argmax."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.0, nan, 9.0], [1.0, inf, 2.0], [-inf, -inf, -inf], [-inf, 3.0, 1.0], [nan, nan, nan]])
    for x in (logits, logits.bfloat16()):
        assert greedy_ids(x).tolist() == [-1, -1, -1, 1, -1]
        assert greedy_ids(x, x.argmax(-1)).tolist() == [-1, -1, -1, 1, -1]
    with pytest.raises(ValueError, match="verified row 1 are NaN or inf"):
        verify(torch.tensor([[5.0, 0.0], [nan, 1.0]]), [0], SamplingParams())
