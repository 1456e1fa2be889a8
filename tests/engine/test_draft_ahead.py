"""Draft-ahead (:mod:`splitspec.engine.draft_ahead`): the next cycle's draft launched behind this cycle's verify, with
its acceptance decided on the device, drafts what the host-filled draft phase drafts, and serving with it stays
token-identical to target-only greedy decoding."""

from __future__ import annotations

import pytest
import torch

from splitspec.engine.acceptance import accepted
from splitspec.engine.draft_ahead import next_draft_inputs
from splitspec.engine.plan import CyclePlan, SeqWork
from splitspec.models.batch import single_blocks
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.runtime.types import Request, SamplingParams
from splitspec.settings import ServeConfig

PROMPT = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self"


def test_acceptance_and_next_inputs_by_hand():
    """Three sequences, k 3: greedy acceptance of 2 (third draft differs), of 0, and a forced (synthetic) 3."""
    best = torch.tensor([[5, 6, 9, 8], [1, 2, 3, 4], [7, 7, 7, 7]])
    drafts = torch.tensor([[5, 6, 7], [9, 2, 3], [0, 0, 0]])
    forced = torch.tensor([-1, -1, 3])
    assert accepted(best, drafts, forced).tolist() == [2, 0, 3]
    S = 16
    table = torch.arange(3 * S).reshape(3, S) + 100
    starts = torch.tensor([4, 0, 10])
    none = torch.full((3, 2), -1)
    ids, last, step_pos, step_rows = next_draft_inputs(best, drafts, forced, none, starts, table, torch.arange(3))
    # accepted drafts, then the target's token at the first rejection (or the bonus), zeros past it
    assert ids.tolist() == [[5, 6, 9, 0], [1, 0, 0, 0], [0, 0, 0, 7]]
    assert last.tolist() == [0 * 4 + 2, 1 * 4 + 0, 2 * 4 + 3]
    # step i (1 .. k − 1) at start + a + i; the third sequence's second step clamped below S = 16
    assert step_pos.tolist() == [[7, 1, 14], [8, 2, 15]]
    assert step_rows.tolist() == [[100 + 7, 116 + 1, 132 + 14], [100 + 8, 116 + 2, 132 + 15]]
    starts[2] = 12
    _, _, step_pos, _ = next_draft_inputs(best, drafts, forced, none, starts, table, torch.arange(3))
    assert step_pos[:, 2].tolist() == [15, 15]
    # sampled decisions made on the device: the first sequence accepts 1 then samples 4; the second accepts all 3
    # drafts and samples 8 after them (its drafts 9, 2, 3 would be refused by greedy acceptance)
    over = torch.tensor([[1, 4], [3, 8], [-1, 0]])
    ids, last, step_pos, _ = next_draft_inputs(best, drafts, forced, over, starts, table, torch.arange(3))
    assert ids.tolist() == [[5, 4, 0, 0], [9, 2, 3, 8], [0, 0, 0, 7]]
    assert last.tolist() == [1, 4 + 3, 8 + 3] and step_pos.tolist() == [[6, 4, 15], [7, 5, 15]]


def test_compiled_next_draft_inputs_match_eager():
    """The draft-ahead graphs' inputs through ``torch.compile`` (dynamic shapes, as on the CUDA-graph path) give the eager
    values, over batch buckets, k and windows, greedy and forced acceptance (one compilation for all)."""
    from splitspec.engine.draft_ahead import DraftAhead

    from torch._dynamo.utils import counters

    ahead = DraftAhead("cpu", False, None)
    ahead.compile()
    before = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(9)
    for B, k, S in ((1, 1, 256), (4, 3, 256), (8, 5, 512)):
        best = torch.randint(0, 3, (B, k + 1), generator=g)
        drafts = torch.randint(0, 3, (B, k), generator=g)
        forced = torch.where(torch.rand(B, generator=g) < 0.3, torch.randint(0, k + 1, (B,), generator=g), -1)
        over = torch.where(torch.rand(B, 1, generator=g) < 0.3, torch.randint(0, k + 1, (B, 2), generator=g), -1)
        starts = torch.randint(0, S - 2 * k, (B,), generator=g)
        table = torch.randint(0, 10_000, (B, S), generator=g)
        args = (best, drafts, forced, over, starts, table, torch.arange(B))
        for got, want in zip(ahead.inputs(*args), next_draft_inputs(*args)):
            assert torch.equal(got, want), (B, k, S)
    assert counters["stats"]["unique_graphs"] > before, "next_draft_inputs was not compiled (ran eagerly)"


@pytest.mark.parametrize("handoff, base", [(False, 20), (True, 20), (False, 232)])
def test_ahead_drafts_equal_the_host_filled_draft(tmp_path, monkeypatch, handoff, base):
    """After a steady verify of 3 sequences (bucket 4), the draft launched ahead — greedy acceptance on the device, and
    forced — equals, bit for bit, the draft a second runner with the same history makes from the plan the scheduler
    would build once it has accepted on the host. ``handoff``: the verify's aux states read where its graph leaves
    them (the CUDA-graph path's buffer, forced on for the CPU's eager runs), not from the kept batch. The launch
    fills no row table of its own where the verify's window (256) holds its last step: it copies the verify's; from
    ``base`` 232 (last start 250, k 3) its steps reach past 256, and it fills one of 512."""
    from splitspec.build.synthetic import write_synthetic_engines
    from splitspec.engine.rank import RankRunner
    from splitspec.models.layers import TPComm

    eng = write_synthetic_engines(tmp_path, num_layers=1, tp_size=1, max_batch_size=4, max_seq_len=512, tiny=True)
    g = torch.Generator().manual_seed(7)
    k, sids = 3, [7, 2, 5]
    with torch.inference_mode():
        runners = [RankRunner(eng, 0, 1, TPComm(), "cpu", placements=(1,), compile=False) for _ in range(2)]
        if handoff:
            graphs = runners[0].graphs
            monkeypatch.setattr(graphs, "shared", lambda name, shape, dtype: graphs.buffers.setdefault(name, torch.zeros(shape, dtype=dtype)))
            read = []
            run = runners[0].ahead.graphs.run
            monkeypatch.setattr(runners[0].ahead.graphs, "run", lambda key, fn, *x: (read.append(x[-1]), run(key, fn, *x))[1])
        fills, table = [], runners[0].fill.table  # the row tables runner 0 fills: their shapes [B_pad, S]
        monkeypatch.setattr(runners[0].fill, "table", lambda out, blocks: (fills.append(out.shape), table(out, blocks))[1])
        states = {sid: torch.randn(k + 1, 3 * runners[0].drafter.cfg.target_hidden_size, generator=g) for sid in sids}
        for forced in (None, [0, 3, 1]):
            for r in runners:
                for sid, t in states.items():
                    r.aux[sid] = t.clone()
            plan = CyclePlan([SeqWork(sid, single_blocks(b, 512), "decode", base + 9 * b, [11 + b], k=k,
                                      extend_start=base - 2 + 9 * b, extend_tokens=[3 + b, 11 + b], keep_aux=2,
                                      accept=None if forced is None else forced[b])
                              for b, sid in enumerate(sids)], padded_k=k, ahead=True)
            outs = []
            for r in runners:
                drafts = r.draft_padded(plan)
                logits, _, verified = r.verify_padded(plan, drafts)
                outs.append((logits.argmax(-1), verified))
            best, verified = outs[0]
            assert torch.equal(best, outs[1][0]) and torch.equal(verified, outs[1][1])
            assert fills[-1] == (4, 256), "the verify's window"
            fills.clear()
            runners[0].ahead.launch(runners[0], plan, best, verified, ([], None), runners[0].verify_fill)
            assert fills == ([] if base == 20 else [(4, 512)]), "the verify's row table filled once, copied ahead"
            # the host's side: accept (greedy or forced), then the next plan as the scheduler builds it
            nxt, host_best = [], best.view(len(sids), k + 1).tolist()
            for b, w in enumerate(plan.work):
                d = verified[b].tolist()
                a = 0 if forced is None else forced[b]
                if forced is None:
                    while a < k and d[a] == host_best[b][a]:
                        a += 1
                new = d[:a] + [host_best[b][a]]
                nxt.append(SeqWork(w.sid, w.blocks, "decode", w.start + a + 1, [new[-1]], k=k, extend_start=w.start,
                                   extend_tokens=new, keep_aux=a + 1))
            nxt = CyclePlan(nxt, padded_k=k)
            ahead = runners[0].drafts_ahead(nxt)
            assert ahead is not None, "the next plan is the one launched for"
            assert torch.equal(ahead[:3], runners[1].draft_padded(nxt)[:3]), forced
            assert runners[0].drafts_ahead(nxt) is None, "taken once"
        if handoff:
            assert len(read) == 2 and all(x is graphs.buffers[("aux", 4, k + 1)] for x in read)


def test_a_launch_refuses_another_verifys_fill(tmp_path):
    """The launch copies the verify's positions and write rows: given those of another verify (here one at positions
    300.., window 512, where this plan verified at 20.., window 256: the same [4, 4] positions) it would extend the
    drafter at the wrong rows and hand its drafts to the next cycle, whose take() checks the plan's starts only.
    So it takes the fill of its own plan's verify and nothing else."""
    from splitspec.build.synthetic import write_synthetic_engines
    from splitspec.engine.rank import RankRunner
    from splitspec.models.layers import TPComm

    eng = write_synthetic_engines(tmp_path, num_layers=1, tp_size=1, max_batch_size=4, max_seq_len=512, tiny=True)
    k, sids = 3, [7, 2, 5]

    def plan(base):
        return CyclePlan([SeqWork(sid, single_blocks(b, 512), "decode", base + 9 * b, [11 + b], k=k,
                                  extend_start=base - 2 + 9 * b, extend_tokens=[3 + b, 11 + b], keep_aux=2)
                          for b, sid in enumerate(sids)], padded_k=k, ahead=True)

    g = torch.Generator().manual_seed(7)
    with torch.inference_mode():
        r = RankRunner(eng, 0, 1, TPComm(), "cpu", placements=(1,), compile=False)
        states = {sid: torch.randn(k + 1, 3 * r.drafter.cfg.target_hidden_size, generator=g) for sid in sids}
        fills = []
        for base in (300, 20):
            for sid, t in states.items():
                r.aux[sid] = t.clone()
            here = plan(base)
            logits, _, verified = r.verify_padded(here, r.draft_padded(here))
            fills.append(r.verify_fill)
        assert fills[0][1].shape == fills[1][1].shape and fills[0][1][0, 0] == 300
        best = logits.argmax(-1)
        with pytest.raises(ValueError, match="another verify's"):
            r.ahead.launch(r, here, best, verified, ([], None), fills[0])
        assert r.ahead.pending is None
        r.ahead.launch(r, here, best, verified, ([], None), fills[1])
        assert r.ahead.pending is not None and r.ahead.pending.starts == (20, 29, 38)


@pytest.fixture(scope="module")
def tok(demo_models):
    return ChatTokenizer.from_dir(demo_models / "target")


@pytest.fixture(scope="module")
def reference(engines_for, tok):
    """Target-only greedy tokens of PROMPT from the TP1 engine (the module's engines below are TP2)."""
    with SpeculativeEngine.load(ServeConfig(engines_for(1))) as eng:
        return eng.generate(tok.encode(PROMPT), 24, num_draft_tokens=0, stop_token_ids=set()).token_ids


def _counting(eng) -> list[bool]:
    """Record, per steady cycle with a TP1 draft, whether its drafts were the ones launched ahead."""
    seen, take = [], eng.group.rank0.drafts_ahead
    eng.group.rank0.drafts_ahead = lambda plan: (d := take(plan), seen.append(d is not None))[0]
    return seen


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_draft_ahead_equals_target_only(built_engines, tok, reference, k):
    """The default deployment (target TP2, TP1 drafter) with steady cycles padded and drafted ahead: target-only greedy
    tokens; every steady cycle but the first after the prefill and those near max_tokens used the ahead drafts."""
    with SpeculativeEngine.load(ServeConfig(built_engines, padded=True, draft_ahead=True)) as eng:
        taken = _counting(eng)
        res = eng.generate(tok.encode(PROMPT), 24, num_draft_tokens=k, stop_token_ids=set())
        assert res.token_ids == reference
        # not drafted ahead: the first steady cycle, and those after a cycle that could reach max_tokens (≤ k + 1)
        assert taken[0] is False and all(taken[1:len(taken) - k - 1]) and sum(taken) >= 2, taken
        # a batch that changes under it: a second request arriving mid-run, one stopping at a token no plan foresaw
        ids = tok.encode(PROMPT)
        first = eng.submit(Request(ids, 24, num_draft_tokens=k, stop_token_ids=set()))
        out: dict[int, list[int]] = {first: []}
        for step in range(40):
            if step == 3:
                out[eng.submit(Request(ids, 12, num_draft_tokens=k, stop_token_ids={reference[8]}))] = []
            for e in eng.step():
                out[e.request_id] += e.token_ids
            if not eng.has_work():
                break
        second = [rid for rid in out if rid != first][0]
        assert out[first] == reference and out[second] == reference[:reference.index(reference[8]) + 1]


def test_draft_ahead_without_padded_cycles_says_it_has_no_effect(built_engines):
    with pytest.warns(UserWarning, match="draft_ahead has no effect here"):
        SpeculativeEngine.load(ServeConfig(built_engines, draft_ahead=True)).close()


def test_synthetic_acceptance_with_and_without_draft_ahead_counts_alike(built_engines, tok):
    """Synthetic acceptance is drawn before the cycle from the request's seeded generator, so the same request
    accepts the same numbers of drafts cycle by cycle whether the device (draft-ahead) or the host acts on them."""
    stats = []
    for ahead in (False, True):
        cfg = ServeConfig(built_engines, padded=True, draft_ahead=ahead, synthetic_acceptance=(0.9, 0.6, 0.4))
        with SpeculativeEngine.load(cfg) as eng:
            taken = _counting(eng)
            res = eng.generate(tok.encode(PROMPT), 30, num_draft_tokens=3, stop_token_ids=set(),
                               sampling=SamplingParams(seed=11))
            stats.append((res.num_cycles, res.accepted_per_position))
            assert any(taken) == ahead
    assert stats[0] == stats[1] and sum(stats[0][1]) > 0


def test_a_full_batch_drafts_ahead_with_requests_waiting(built_engines, tok, reference):
    """A request waiting while the batch is full cannot join the next cycle: the running one still drafts ahead (only
    a free slot with a request waiting stops it). Closing the engine releases the draft-ahead graphs and drops the
    drafts pending in them."""
    with SpeculativeEngine.load(ServeConfig(built_engines, padded=True, draft_ahead=True, max_batch_size=1)) as eng:
        taken = _counting(eng)
        ids = tok.encode(PROMPT)
        results = eng.run([Request(ids, 24, num_draft_tokens=2, stop_token_ids=set()) for _ in range(2)])
        assert [r.token_ids for r in results] == [reference, reference]
        assert sum(taken) >= len(taken) - 2 * 4, taken  # per request: its first steady cycle and the last k + 1
        ahead = eng.group.rank0.ahead
        ahead.graphs.graphs["probe"] = object()  # stands for a captured graph (none on the CPU)
    assert not ahead.graphs.graphs and ahead.pending is None


def test_sampled_requests_draft_ahead_and_sample_as_without(built_engines, tok):
    """Sampled requests are decided on the device when the next draft goes ahead: a batch of one greedy and three seeded
    sampled requests (two filters) gives the same tokens with draft-ahead on and off — the same random numbers, drawn
    before each cycle, and the same rule — and with it on the steady cycles use the drafts launched ahead."""
    ids = tok.encode(PROMPT)
    filters = [SamplingParams(), SamplingParams(0.8, top_p=0.95, seed=3), SamplingParams(1.5, seed=4),
               SamplingParams(0.8, top_p=0.95, seed=5)]
    outs = []
    for ahead in (False, True):
        with SpeculativeEngine.load(ServeConfig(built_engines, padded=True, draft_ahead=ahead)) as eng:
            taken = _counting(eng)
            res = eng.run([Request(ids, 28, sp, num_draft_tokens=3, stop_token_ids=set()) for sp in filters])
            outs.append([(r.token_ids, r.num_cycles, r.accepted_per_position) for r in res])
            assert (sum(taken) >= len(taken) // 2) if ahead else not any(taken), taken
    assert outs[0] == outs[1]  # tokens, and the drafts accepted cycle by cycle: the drafts launched ahead were the same
    assert len({tuple(t) for t, _, _ in outs[0]}) == 4, "the sampled requests sampled (each differs from the others)"


@pytest.mark.parametrize("temperature", [0.8, 0.0])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_logits_in_a_cycle_drafting_ahead_fail_that_request_only(built_engines, tok, value, temperature):
    """NaN or inf logits in one sampled or greedy sequence's verify while the next draft goes ahead: that request ends
    with a one-line error (not the drafter embedding an id past the vocabulary, nor the engine stopping, nor a token
    no finite logit chose), and the other request of the batch runs to its length."""
    with SpeculativeEngine.load(ServeConfig(built_engines, padded=True, draft_ahead=True)) as eng:
        taken = _counting(eng)
        r0, calls = eng.group.rank0, [0]
        forward = r0.target.forward

        def poisoned(batch, *args, **kwargs):
            logits, aux = forward(batch, *args, **kwargs)
            calls[0] += 1
            if calls[0] == 6 and sum(taken) >= 1:  # a steady cycle whose drafts came ahead, and that drafts ahead
                logits = logits.clone()
                logits[:4] = value  # the first sequence's k + 1 rows
            return logits, aux

        r0.target.forward = poisoned
        ids = tok.encode(PROMPT)
        ends, tokens = {}, {}
        for seed in (1, 2):
            rid = eng.submit(Request(ids, 30, SamplingParams(temperature, seed=seed), num_draft_tokens=3,
                                     stop_token_ids=set()))
            tokens[rid] = []
        while eng.has_work():
            for e in eng.step():
                tokens[e.request_id] += e.token_ids
                if e.finished:
                    ends[e.request_id] = (e.finish_reason, e.error)
        bad, good = sorted(ends)
        says = ("sampling: draw: weights sum to 0, NaN or inf, expected a finite sum > 0 (NaN or inf in the logits?)"
                if temperature else "sampling: greedy: the target's logits at verified row 0 are NaN or inf, expected "
                "finite values")
        assert calls[0] > 6 and ends[bad] == ("error", says)
        assert ends[good] == ("length", None) and len(tokens[good]) == 30
