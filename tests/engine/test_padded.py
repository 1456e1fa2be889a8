"""The padded (static-shape, CUDA-graph friendly) batch form computes what the general form computes."""

from __future__ import annotations

import torch

from splitspec.engine.group import Group
from splitspec.models.batch import ForwardBatch, padded, single_blocks
from splitspec.settings import ServeConfig


def test_padded_target_and_drafter_match_general_form(engines_for):
    group = Group(ServeConfig(engines_for(1)))
    r = group.rank0
    g = torch.Generator().manual_seed(0)
    blocks = [single_blocks(s, 64) for s in range(3)]
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (9, 17, 5)]
    try:
        with torch.inference_mode():
            pre = ForwardBatch.build([(b, 0, p[:-3]) for b, p in zip(blocks, prompts)], "all")
            r.target.forward(pre, r.tcache)
            tails = [(b, len(p) - 3, p[-3:]) for b, p in zip(blocks, prompts)]
            general, _ = r.target.forward(ForwardBatch.build(tails, "all"), r.tcache, (1, 2))
            scratch = r.tcache.c_kv.shape[1] - 1
            pb = padded(tails, window=32, scratch_row=scratch, pad_to=4)
            pad_logits, pad_aux = r.target.forward(pb, r.tcache, (1, 2))
            assert (pad_logits[:9] - general).abs().max() < 1e-4
            # drafter: the same rows in both forms
            m, dc = r.drafter, r.dcache
            hidden = torch.randn(9, m.cfg.hidden_size, generator=g)
            m.forward(ForwardBatch.build([(b, 0, p[:-3]) for b, p in zip(blocks, prompts)], "all"),
                      torch.randn(sum(len(p) - 3 for p in prompts), m.cfg.hidden_size, generator=g), dc)
            dg, hg = m.forward(ForwardBatch.build(tails, "all"), hidden, dc)
            dp, hp = m.forward(pb, torch.cat((hidden, torch.zeros(3, m.cfg.hidden_size))), dc)
            assert (dp[:9] - dg).abs().max() < 1e-4 and (hp[:9] - hg).abs().max() < 1e-4
    finally:
        group.close()


def test_compiled_target_is_freed_without_the_garbage_collector(engines_for):
    """A closed engine's compiled target goes with its last reference, not at the collector's next run: the
    tuner loads engines one after another, and a reference cycle through the compiled halves kept each load's
    weights on the GPU (three Kimi-width loads filled an H200)."""
    import gc
    import weakref

    group = Group(ServeConfig(engines_for(1)))
    r = group.rank0
    g = torch.Generator().manual_seed(2)
    gc.disable()
    try:
        with torch.inference_mode():
            # two sequences of three tokens: the dynamic-shape graphs test_compiled_layers_match_eager's (4, 3) batch
            # then reuses (one sequence would compile graphs of their own, specialised to a batch of one)
            seqs = [(single_blocks(s, 64), 7, torch.randint(0, 4000, (3,), generator=g).tolist()) for s in range(2)]
            r.target.compile()
            r.target.forward(padded(seqs, window=32, scratch_row=r.tcache.kv.shape[1] - 1), r.tcache)
        target, weight = weakref.ref(r.target), weakref.ref(r.target.w["embed_tokens"])
        group.close()
        del group, r
        assert target() is None and weight() is None, "the compiled target outlived its engine"
    finally:
        gc.enable()


def test_compiled_layers_match_eager(engines_for):
    """torch.compile'd layer halves (the CUDA-graph path's) compute what the eager ones compute, across
    batch shapes (dynamic shapes: no recompilation per shape)."""
    group = Group(ServeConfig(engines_for(1)))
    r = group.rank0
    g = torch.Generator().manual_seed(1)
    try:
        with torch.inference_mode():
            for B, n in ((2, 1), (4, 3)):
                blocks = [single_blocks(s, 64) for s in range(B)]
                seqs = [(b, 7, torch.randint(0, 4000, (n,), generator=g).tolist()) for b in blocks]
                pb = padded(seqs, window=32, scratch_row=r.tcache.kv.shape[1] - 1)
                r.target.fast = None
                eager, _ = r.target.forward(pb, r.tcache)
                r.target.compile()
                fast, _ = r.target.forward(pb, r.tcache)
                assert (fast - eager).abs().max() < 1e-4, (B, n)
    finally:
        group.close()
