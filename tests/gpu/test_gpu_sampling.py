"""Sampled decoding on a GPU engine: the request's generator is a CPU one while the logits live on the GPU, so every
draw must take its random numbers on the host and search on the device (:func:`splitspec.runtime.sampling.draw`).
The rejection sampler's outcomes on CUDA logits follow the target distribution (chi-square), and sampled requests
with and without drafts run through the engine, a seeded one reproducibly."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from splitspec.engine.acceptance import blocked_cumsum, inverse_transform
from splitspec.runtime.sampling import SamplingParams, draw_cycle, target_probs, verify
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.settings import ServeConfig

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def test_rejection_sampler_on_cuda_logits_matches_the_target():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0)).cuda() * 2
    sp = SamplingParams(temperature=1.0)
    p = target_probs(logits, sp).cpu().double()
    d1 = int(p[0].argmax())
    gen = torch.Generator().manual_seed(0)
    first = [verify(logits, [d1, 0], sp, draw_cycle(sp, 2, gen))[1][0] for _ in range(6000)]
    counts = torch.bincount(torch.tensor(first), minlength=40)
    expected = p[0] / p[0].sum() * len(first)  # float64, summing to the draw count as chisquare requires
    assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3


@pytest.mark.timeout(600)
def test_sampled_requests_run_on_the_gpu_engine(engines_for):
    prompt = "def fibonacci(n):"
    with SpeculativeEngine.load(ServeConfig(engines_for(1), target_device_ids=[0], draft_tp=1, max_batch_size=2)) as eng:
        ids = eng.tokenizer.encode(prompt)
        for k in (0, 3):
            runs = [eng.generate(ids, 24, num_draft_tokens=k, sampling=SamplingParams(0.8, top_p=0.95, seed=11),
                                 stop_token_ids=set()).token_ids for _ in range(2)]
            assert len(runs[0]) == 24 and runs[0] == runs[1], f"k={k}: a seeded sampled request differs between runs"
            vocab = eng.group.rank0.cfg.vocab_size
            assert all(0 <= t < vocab for t in runs[0])


def test_blocked_scan_on_cuda_draws_what_the_host_draws():
    """Kimi's vocabulary (160 scan blocks, 64 rows): the blocked cumulative sum on the GPU is the CPU's to 1e-12 and
    dips, over runs of zero weights, by at most a few ulps (a GPU's scan is not sequential); the inverse-transform draw
    of 64 rows picks the index the CPU picks from the same weights and uniforms."""
    g = torch.Generator().manual_seed(0)
    w = torch.rand(64, 163840, generator=g, dtype=torch.float64) ** 8
    w[:, ::3] = 0.0
    v = torch.rand(64, generator=g, dtype=torch.float64)
    c = blocked_cumsum(w.cuda())
    assert torch.allclose(c.cpu(), w.cumsum(-1), rtol=1e-12, atol=0)
    assert (c.diff(dim=-1) >= -8 * torch.finfo(torch.float64).eps * c[:, 1:]).all()
    assert torch.equal(inverse_transform(w.cuda(), v.cuda())[:, 0].cpu(), inverse_transform(w, v)[:, 0])
