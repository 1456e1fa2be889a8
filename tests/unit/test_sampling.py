"""The sampler's pieces on small hand-made distributions: :func:`draw` (inverse transform with the request's CPU
generator, the search on the weights' device) and the synthetic verify's use of the host argmax. The rejection
sampler's distribution on real logits: tests/engine/test_runtime.py; on a GPU's logits: tests/gpu/test_gpu_sampling.py."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from splitspec.runtime.sampling import draw, synthetic_accept, verify_synthetic


def test_draw_follows_the_weights_and_never_draws_a_zero():
    w = torch.tensor([0.0, 1.0, 0.0, 3.0, 0.5, 0.0])  # not normalised
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(w, gen) for _ in range(20_000)]), minlength=6)
    assert counts[w == 0].sum() == 0
    support = w > 0
    stat = chisquare(counts[support].numpy(), (w[support].double() / w.sum() * 20_000).numpy())
    assert stat.pvalue > 1e-3


def test_draw_is_reproducible_from_the_generator_and_single_weights():
    w = torch.rand(1000, generator=torch.Generator().manual_seed(1))
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [draw(w, a) for _ in range(50)] == [draw(w, b) for _ in range(50)]
    assert draw(torch.tensor([2.0]), a) == 0 and draw(torch.tensor([0.0, 0.0, 7.0]), a) == 2


def test_draw_stays_on_the_last_positive_weight_when_the_uniform_rounds_up(monkeypatch):
    """u · Σ may round up to Σ in float64: the draw is then the last positive weight, not a zero past it."""
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert draw(torch.tensor([1.0, 2.0, 0.0, 0.0]), None) == 1


def test_synthetic_verify_takes_the_host_argmax_when_given():
    logits = torch.zeros(3, 10)
    logits[:, 5] = 1.0  # the device argmax would be 5 at every row
    assert verify_synthetic(logits, [3, 4], 0, best=[7, 8, 9]) == (0, [7])
    assert verify_synthetic(logits, [3, 4], 2, best=[7, 8, 9]) == (2, [3, 4, 9])
    assert verify_synthetic(logits, [3, 4], 0) == (0, [5])
    with pytest.raises(ValueError, match="3 drafts accepted of 2"):
        verify_synthetic(logits, [3, 4], 3)


def test_synthetic_accept_follows_the_profile_per_position():
    """Draft i is accepted with conditional probability profile[i] (the last entry past the profile): the counts of
    a over many cycles match the geometric-like law those give, by a chi-square test; 0 and 1 are exact."""
    gen = torch.Generator().manual_seed(3)
    assert {synthetic_accept(4, [0.0], gen) for _ in range(50)} == {0}
    assert {synthetic_accept(4, [1.0], gen) for _ in range(50)} == {4}
    assert synthetic_accept(0, [1.0], gen) == 0
    profile, k, n = [0.8, 0.5], 3, 20_000
    counts = torch.bincount(torch.tensor([synthetic_accept(k, profile, gen) for _ in range(n)]), minlength=k + 1)
    p = [0.2, 0.8 * 0.5, 0.8 * 0.5 * 0.5, 0.8 * 0.5 * 0.5]  # a = 0, 1, 2, 3
    assert chisquare(counts.numpy(), [q * n for q in p]).pvalue > 1e-3


def test_draw_refuses_weights_it_cannot_draw_from():
    """NaN or inf logits make weights whose search would return an index past the vocabulary (a token id the engine
    would then embed) or a zero weight: refused by name instead."""
    gen = torch.Generator().manual_seed(0)
    for bad in (torch.zeros(4), torch.tensor([1.0, float("nan"), 2.0]), torch.full((3,), float("nan")),
                torch.tensor([1.0, float("inf")])):
        with pytest.raises(ValueError, match="draw: weights sum to"):
            draw(bad, gen)
    for bad in (torch.zeros(0), torch.ones(2, 3), torch.tensor(1.0)):
        with pytest.raises(ValueError, match="draw: weights of shape"):
            draw(bad, gen)
