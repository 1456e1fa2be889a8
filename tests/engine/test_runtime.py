"""The serving runtime: continuous batching, chunked prefill, KV budget, both draft placements,
speculative sampling's distribution, stop strings, synthetic acceptance."""

from __future__ import annotations

import time

import pytest
import torch
from scipy.stats import chisquare

from splitspec.engine.plan import CyclePlan, SeqWork
from splitspec.errors import ConfigError
from splitspec.models.batch import single_blocks
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request
from splitspec.runtime.sampling import SamplingParams, draw_cycle, target_probs, verify
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.settings import ServeConfig

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self",
    "x",
    "# Copyright 2001 Python Software Foundation. All rights reserved.\n\"\"\"Utilities for path handling.\"\"\"\n\nimport os\n\ndef join(a, *p):",
    "for i in range(10):\n    print(",
    "while True:",
]


@pytest.fixture(scope="module")
def tok(demo_models):
    return ChatTokenizer.from_dir(demo_models / "target")


@pytest.fixture(scope="module")
def reference(built_engines, tok):
    """Per-sequence, target-only greedy outputs (TP2, k = 0, one request at a time)."""
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=0)) as eng:
        return {p: eng.generate(tok.encode(p), 20, stop_token_ids=set()).token_ids for p in PROMPTS}


def _requests(tok, k, max_tokens=20):
    return [Request(tok.encode(p), max_tokens, num_draft_tokens=k, stop_token_ids=set()) for p in PROMPTS]


@pytest.mark.parametrize("draft_tp, padded", [(1, False), (2, False), (1, True)])
def test_batched_joining_midflight_equals_per_sequence(built_engines, tok, reference, draft_tp, padded):
    """Requests of mixed prompt lengths join while others decode; long prompts are prefilled in chunks;
    greedy output equals per-sequence target-only output for both draft placements. ``padded``: the steady
    cycles between joins in the static-shape form (batches padded to their bucket; a verify's aux states kept
    whole for the next draft while the batch stays the same)."""
    with SpeculativeEngine.load(ServeConfig(built_engines, draft_tp=draft_tp, num_draft_tokens=3, max_batch_size=8, kv_tokens=2048,
                                            max_prefill_tokens=8, padded=padded)) as eng:
        run, steady = eng.group.run, []  # per cycle: its batch when steady (static-shape form), else 0
        eng.group.run = lambda plan, *a: (run(plan, *a), steady.append(len(plan.work) if plan.padded_k is not None else 0))[0]
        reqs = _requests(tok, 3)
        out = {}
        ids = {eng.submit(r): p for r, p in zip(reqs[:3], PROMPTS[:3])}
        for _ in range(4):
            for e in eng.step():
                out.setdefault(e.request_id, []).extend(e.token_ids)
        assert any(out.values()), "first requests should be decoding before the others join"
        ids |= {eng.submit(r): p for r, p in zip(reqs[3:], PROMPTS[3:])}
        batch_sizes = []
        while eng.has_work():
            for e in eng.step():
                out.setdefault(e.request_id, []).extend(e.token_ids)
            batch_sizes.append(eng.last_cycle.decode_seqs)
        assert max(batch_sizes) >= 4
        for rid, p in ids.items():
            assert out[rid] == reference[p], p
    if padded:  # steady batches off their bucket's size (padding), and the same batch in consecutive cycles
        assert any(b not in (0, 1, 2, 4, 8) for b in steady) and any(a and a == b for a, b in zip(steady, steady[1:])), steady


def test_kv_budget_queues_then_completes_and_impossible_request_errors(built_engines, tok, reference):
    # each request reserves prompt + 20 + 3 + 1 tokens (≤ 80 → 5 blocks); 10 blocks fit two at a time
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=3, max_batch_size=8, kv_tokens=160)) as eng:
        with pytest.raises(ConfigError, match="can never fit"):
            eng.submit(Request(tok.encode("x" * 10), 200, num_draft_tokens=3))
        ids = {eng.submit(r): p for r, p in zip(_requests(tok, 3), PROMPTS)}
        queued, out = [], {}
        while eng.has_work():
            for e in eng.step():
                out.setdefault(e.request_id, []).extend(e.token_ids)
            queued.append(eng.num_queued)
            assert eng.alloc.used <= eng.alloc.num_blocks
        assert max(queued) >= 3, "requests should have waited for KV space"
        assert eng.alloc.used == 0
        for rid, p in ids.items():
            assert out[rid] == reference[p]


def test_cancel_frees_kv(built_engines, tok):
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=2, max_batch_size=4, kv_tokens=1024)) as eng:
        a = eng.submit(Request(tok.encode(PROMPTS[0]), 50, stop_token_ids=set()))
        b = eng.submit(Request(tok.encode(PROMPTS[1]), 10, stop_token_ids=set()))
        eng.step()
        eng.step()
        used = eng.alloc.used
        eng.cancel(a)
        events = eng.step()
        assert any(e.request_id == a and e.finish_reason == "cancelled" for e in events)
        assert eng.alloc.used < used and eng.num_active == 1
        while eng.has_work():
            eng.step()
        assert eng.alloc.used == 0 and b not in eng.seqs
        # a cancellation's reason becomes the finish reason; a deadline ends a request as "timeout", keeping its tokens
        c = eng.submit(Request(tok.encode(PROMPTS[0]), 50, stop_token_ids=set()))
        d = eng.submit(Request(tok.encode(PROMPTS[1]), 50, stop_token_ids=set(), timeout_s=0.05))
        eng.step()
        eng.cancel(c, "shutdown")
        time.sleep(0.06)
        events = eng.step()
        assert {e.request_id: e.finish_reason for e in events if e.finished} == {c: "shutdown", d: "timeout"}
        assert eng.alloc.used == 0 and not eng.has_work()


def test_rejection_sampler_matches_target_distribution(built_engines, tok):
    """Chi-square over ≥ 10,000 verify() outcomes each, on real target logits: the first emitted token has the
    target's distribution p_0, and the token after an accepted draft has p_1 (context + draft)."""
    ids = tok.encode(PROMPTS[1])
    sp = SamplingParams(temperature=1.0, top_k=6)
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=0)) as eng:
        p_ctx = _logits(eng, ids)[-1:]
        d1 = int(p_ctx.argmax())  # a likely draft, so it is often accepted
        p_d1 = _logits(eng, [d1], start=len(ids))  # the prompt's K/V is in the cache
        d2 = int(p_d1.argmax())
        logits = torch.cat((p_ctx, p_d1, _logits(eng, [d2], start=len(ids) + 1)))
    probs = target_probs(logits, sp)
    gen = torch.Generator().manual_seed(0)
    first, second = [], []
    while len(second) < 10_000:  # the draft is accepted with probability p_0(d1)
        a, new = verify(logits, [d1, d2], sp, draw_cycle(sp, 2, gen))
        first.append(new[0])
        if a >= 1:
            second.append(new[1])
    for samples, p in ((first, probs[0]), (second, probs[1])):
        support = p.nonzero().flatten().tolist()
        counts = torch.bincount(torch.tensor(samples), minlength=p.numel())
        assert counts.sum() == counts[support].sum(), "sampled outside the top-k support"
        stat = chisquare(counts[support].numpy(), (p[support].double() / p[support].double().sum() * len(samples)).numpy())
        print(f"chi-square over {len(samples)} samples, {len(support)} bins: p-value {stat.pvalue:.3f}")
        assert len(samples) >= 10_000 and stat.pvalue > 1e-3


def _logits(eng, ids, start=0):
    """Target logits [len(ids), V] of sequence 0 at positions start.. (one token per prefill cycle), ``ids`` there; the
    cache must hold the tokens before ``start``."""
    blocks = single_blocks(0, 256)
    with torch.inference_mode():
        return torch.cat([eng.group.run(CyclePlan([SeqWork(0, blocks, "prefill", start + i, [t], final=True)])).logits
                          for i, t in enumerate(ids)])


def test_engine_sampling_first_token_distribution_and_seed(built_engines, tok):
    """End to end through the engine: 3,000 sampled first tokens (seeds 0 … 2999) follow the target's distribution;
    a seeded request is reproducible. The prompt is one token ("x"): every request prefills it, and the distribution's
    shape (about 1,500 tokens in the top-p support) is that of a longer prompt's."""
    ids = tok.encode(PROMPTS[2])
    assert len(ids) == 1
    sp = SamplingParams(temperature=0.8, top_p=0.9)
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=2, max_batch_size=64, kv_tokens=64 * 48)) as eng:
        p = target_probs(_logits(eng, ids)[-1:], sp)[0]
        # seeded (request i with seed i): the outcome is fixed, not a fresh 0.1% chance of a false alarm each run
        res = eng.run([Request(ids, 1, SamplingParams(0.8, 0.9, seed=i), stop_token_ids=set()) for i in range(3000)])
        counts = torch.bincount(torch.tensor([r.token_ids[0] for r in res]), minlength=p.numel())
        support = p.nonzero().flatten()
        assert counts.sum() == counts[support].sum()
        stat = chisquare(counts[support].numpy(), (p[support].double() / p[support].double().sum() * 3000).numpy())
        assert stat.pvalue > 1e-3
        seeded = [eng.generate(ids, 12, sampling=SamplingParams(1.0, seed=7), stop_token_ids=set()).token_ids for _ in range(2)]
        assert seeded[0] == seeded[1]


def test_stop_string_stops_text_and_tokens(built_engines, tok, reference):
    p = PROMPTS[1]
    ref = reference[p]
    full = tok.decode(ref)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=4)) as eng:
        res = eng.generate(tok.encode(p), 20, stop=[stop], stop_token_ids=set())
    assert res.finish_reason == "stop"
    assert res.text == full[: full.index(stop)]
    assert stop in tok.decode(res.token_ids) and stop not in tok.decode(res.token_ids[:-1])
    assert res.token_ids == ref[: len(res.token_ids)]


def test_synthetic_acceptance_is_labelled_and_follows_profile(built_engines, tok):
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=3, synthetic_acceptance=[0.9, 0.8, 0.7])) as eng:
        res = eng.generate(tok.encode(PROMPTS[0]), 120, stop_token_ids=set())
    assert res.stats.synthetic
    expected = 1 + 0.9 + 0.9 * 0.8 + 0.9 * 0.8 * 0.7
    assert abs(res.acceptance_length - expected) < 0.6


def test_bad_request_values_are_refused_and_engine_keeps_serving(built_engines, engines_for, tok):
    """Values that would overflow the sampler or break the engine's state are refused up front."""
    ids = tok.encode(PROMPTS[0])
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=2)) as eng:
        bad = [dict(sampling=SamplingParams(temperature=1e-38)), dict(sampling=SamplingParams(1.0, top_k=1.5)),
               dict(sampling=SamplingParams(1.0, seed=2**70)), dict(stop=[5]), dict(stop=[""]),
               dict(max_tokens=True), dict(prompt_ids=["a"]), dict(num_draft_tokens=2.5)]
        for b in bad:
            req = Request(b.pop("prompt_ids", ids), b.pop("max_tokens", 8), **b)
            with pytest.raises(ConfigError):
                eng.submit(req)
        assert len(eng.generate(ids, 6, stop_token_ids=set()).token_ids) == 6
    for kw in (dict(max_batch_size=-1), dict(max_prefill_tokens=0), dict(synthetic_acceptance=[2.0])):
        with pytest.raises(ConfigError):  # TP1 engines: refused alike, without starting a worker to stop again
            SpeculativeEngine.load(ServeConfig(engines_for(1), **kw))


@pytest.mark.parametrize("first", ["sampled", "greedy"])
@pytest.mark.parametrize("at_call", [1, 3])
def test_nan_logits_fail_the_request_they_hit_and_no_other(built_engines, tok, at_call, first):
    """NaN logits in one sampled or greedy request's rows, at its first token (the prefill's draw or argmax, call 1)
    or in a later eager cycle's verify (call 3): that request ends with a one-line error (not a token the logits never
    chose); the greedy and the sampled request beside it run to their length."""
    with SpeculativeEngine.load(ServeConfig(built_engines, num_draft_tokens=2)) as eng:
        r0, calls = eng.group.rank0, [0]
        forward = r0.target.forward

        def poisoned(batch, *args, **kwargs):
            logits, aux = forward(batch, *args, **kwargs)
            calls[0] += 1
            if calls[0] == at_call:
                logits = logits.clone()
                logits[:1 if at_call == 1 else 3] = float("nan")  # the first request's row(s): 1 prefill row, k + 1
            return logits, aux

        r0.target.forward = poisoned
        ids = tok.encode(PROMPTS[0])
        sampling = [SamplingParams(0.8, seed=1) if first == "sampled" else SamplingParams(), SamplingParams(),
                    SamplingParams(1.0, seed=2)]
        rids = [eng.submit(Request(ids, 12, sp, stop_token_ids=set())) for sp in sampling]
        ends = {}
        while eng.has_work():
            ends.update({e.request_id: (e.finish_reason, e.error) for e in eng.step() if e.finished})
        says = "sampling: draw: weights sum to" if first == "sampled" else "sampling: greedy: the target's logits at"
        assert ends[rids[0]][0] == "error" and ends[rids[0]][1].startswith(says), ends[rids[0]]
        assert ends[rids[1]] == ends[rids[2]] == ("length", None)
