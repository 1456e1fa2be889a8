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


def test_compiled_drafter_matches_eager(engines_for):
    """The drafter's torch.compile'd parts (the draft phase's CUDA-graph path) compute what the eager ones compute,
    on an extend over 2 sequences of 3 tokens; :meth:`Eagle3Drafter.draft` through them proposes the eager tokens."""
    group = Group(ServeConfig(engines_for(1)))
    r = group.rank0
    m, dc = r.drafter, r.dcache
    g = torch.Generator().manual_seed(4)
    try:
        with torch.inference_mode():
            seqs = [(single_blocks(s, 64), 7, torch.randint(0, 4000, (3,), generator=g).tolist()) for s in range(2)]
            pb = padded(seqs, window=32, scratch_row=dc.k.shape[0] - 1)
            hidden = torch.randn(6, m.cfg.hidden_size, generator=g)
            m.fast = None
            eager = m.forward(pb, hidden, dc)
            from torch._dynamo.utils import counters

            compiled = counters["stats"]["unique_graphs"]
            m.compile()
            fast = m.forward(pb, hidden, dc)
            assert counters["stats"]["unique_graphs"] >= compiled + 3, "a drafter part was not compiled"
            assert (fast[0] - eager[0]).abs().max() < 1e-4 and (fast[1] - eager[1]).abs().max() < 1e-4
            # the draft phase's step: the compiled head with argmax and the map to target ids, on the last rows only
            rows = torch.tensor([2, 5])
            pb.logits_rows = rows
            tokens, states = m.draft(pb, hidden, dc)
            assert counters["stats"]["unique_graphs"] >= compiled + 4, "the proposing head was not compiled"
            assert torch.equal(tokens, m.propose(eager[0][rows])) and (states - eager[1][rows]).abs().max() < 1e-4
    finally:
        group.close()


def test_steady_draft_over_the_kept_verify_batch_equals_per_sequence_states(tmp_path):
    """The steady phases keep a verify's aux states as one tensor for the next draft (:class:`AuxStates`): each
    sequence's rows are its rows of the verify's output, the padding rows zero, and the next draft over the batch as
    kept gives exactly the drafts it gives over the same states handed per sequence (a batch of 3 in a bucket of 4)."""
    from splitspec.build.synthetic import write_synthetic_engines
    from splitspec.engine.plan import CyclePlan, SeqWork
    from splitspec.engine.rank import RankRunner
    from splitspec.models.layers import TPComm

    eng = write_synthetic_engines(tmp_path, num_layers=1, tp_size=1, max_batch_size=4, max_seq_len=256, tiny=True)
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        r = RankRunner(eng, 0, 1, TPComm(), "cpu", placements=(1,), compile=False)
        k, sids = 3, [7, 2, 5]

        def plan(start):
            return CyclePlan([SeqWork(sid, single_blocks(b, 256), "decode", start + 9 * b, [11 + b], k=k,
                                      extend_start=start + 9 * b - 2, extend_tokens=[3 + b, 11 + b], keep_aux=2)
                              for b, sid in enumerate(sids)], padded_k=k)

        for sid in sids:
            r.aux[sid] = torch.randn(k + 1, 3 * r.drafter.cfg.target_hidden_size, generator=g)
        first = plan(20)
        drafts = r.draft_padded(first)
        _, aux, verified = r.verify_padded(first, drafts)
        assert torch.equal(verified, drafts), "the verify returns the drafts it verified"
        kept = r.aux.batch_for(sids, 4 * (k + 1), "cpu")
        assert kept is r.aux.whole and not kept[3 * (k + 1):].any()
        assert all(torch.equal(r.aux[sid], aux[b * (k + 1):(b + 1) * (k + 1)]) for b, sid in enumerate(sids))
        after = plan(24)
        batched = r.draft_padded(after)
        for sid in sids:
            r.aux[sid] = r.aux[sid].clone()  # the same states, per sequence
        assert r.aux.batch_for(sids, 4 * (k + 1), "cpu") is not r.aux.whole
        assert torch.equal(r.draft_padded(after), batched)


def test_handoff_bookkeeping_drafts_what_the_plain_path_drafts(tmp_path, monkeypatch):
    """The verify → draft hand-off of aux states (:meth:`RankRunner.handoff`), which only exists with CUDA graphs,
    forced on for the CPU's eager runs: over cycles where the batch keeps, shrinks, reorders and grows, every draft
    equals the drafts of a runner without it, and both of its paths run (read in place; copied in first)."""
    from splitspec.build.synthetic import write_synthetic_engines
    from splitspec.models.batch import bucket
    from splitspec.engine.plan import CyclePlan, SeqWork
    from splitspec.engine.rank import RankRunner
    from splitspec.models.layers import TPComm

    eng = write_synthetic_engines(tmp_path, num_layers=1, tp_size=1, max_batch_size=4, max_seq_len=256, tiny=True)
    g = torch.Generator().manual_seed(5)
    k = 3
    with torch.inference_mode():
        runners = [RankRunner(eng, 0, 1, TPComm(), "cpu", placements=(1,), compile=False) for _ in range(2)]
        graphs = runners[0].graphs
        monkeypatch.setattr(graphs, "shared", lambda name, shape, dtype: graphs.buffers.setdefault(name, torch.zeros(shape, dtype=dtype)))
        states = {sid: torch.randn(k + 1, 3 * runners[0].drafter.cfg.target_hidden_size, generator=g) for sid in (7, 2, 5, 9)}
        for r in runners:
            for sid, t in states.items():
                r.aux[sid] = t.clone()
        paths = []
        for sids, start in [((7, 2, 5), 20), ((7, 2, 5), 24), ((7, 5), 28), ((7, 5), 32), ((5, 7), 36), ((5, 7), 40),
                            ((5, 7, 9), 44), ((5, 7, 9), 48)]:
            plan = CyclePlan([SeqWork(sid, single_blocks(b, 256), "decode", start + 9 * b, [11 + b], k=k,
                                      extend_start=start + 9 * b - 2, extend_tokens=[3 + b, 11 + b], keep_aux=2)
                              for b, sid in enumerate(sids)], padded_k=k)
            key = (bucket(len(sids)), k + 1)
            before = runners[0].handed.get(key)
            drafts = [r.draft_padded(plan).clone() for r in runners]
            paths.append("in place" if runners[0].handed.get(key) is before else "copied")
            assert torch.equal(drafts[0][:len(sids)], drafts[1][:len(sids)]), (sids, start)
            for r, d in zip(runners, drafts):
                r.verify_padded(plan, d)
        assert paths == ["copied", "in place", "copied", "in place", "copied", "in place", "copied", "in place"], paths
        assert set(graphs.buffers) == {("aux", 4, k + 1), ("aux", 2, k + 1)} and not runners[1].graphs.buffers
