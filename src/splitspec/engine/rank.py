"""One rank of the target's group: its target shard, its latent KV cache and the drafter (shard) where it lives
here, executing cycle plans (:mod:`splitspec.engine.plan`) eagerly or, for steady decode cycles, in the
static-shape form replayed from CUDA graphs (:mod:`splitspec.engine.graphs`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from splitspec.config import Mapping, TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.engine.acceptance import greedy_ids, sampled_rows
from splitspec.engine.aux_states import AuxStates
from splitspec.engine.engine_files import load_rank_weights, read_engine_meta
from splitspec.engine.draft_ahead import DraftAhead
from splitspec.engine.drafter_kv_move import move_rows
from splitspec.engine.graphs import GraphCache
from splitspec.engine.phase_clock import PhaseClock
from splitspec.models.kv import BLOCK_SIZE, kv_blocks_for
from splitspec.engine.plan import CycleOutput, CyclePlan, SeqWork
from splitspec.errors import ConfigError
from splitspec.models.batch import ForwardBatch, RowFiller, bucket, field_views, padded_fields
from splitspec.models.drafter import Eagle3Drafter
from splitspec.models.drafters import drafter_cache, drafter_model, shard_drafter_weights
from splitspec.models.layers import TPComm
from splitspec.models.shapes import drafter_shapes, target_shapes
from splitspec.models.target import TargetKVCache, TargetModel


def threads_per_rank(world: int) -> int:
    """CPU threads of one rank when ``world`` ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // world)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class RankRunner:
    """One rank: the target shard + its latent KV cache, and the drafter (shard) where it lives here.

    Args:
        engines_dir: folder with ``target/`` and ``drafter/`` engines.
        rank, world: position in the target's group; ``comm`` its collectives.
        placements: the draft_tp values loaded, each 1 (drafter on the leader, at ``draft_device``) or world
            (sharded over the group); the first drafts until :meth:`switch_placement`.
        compile, cuda_graphs: on a GPU, ``torch.compile`` the target's layers and the drafter's parts / replay steady
            cycles from CUDA graphs (:class:`splitspec.settings.ServeConfig`).
        skinny_gemm: the target's bf16 linears of a few tokens through the skinny-GEMM kernel (ServeConfig's switch,
            :class:`splitspec.models.target.TargetModel`).
        pdl: the compiled parts' Triton kernels with programmatic dependent launch (ServeConfig's switch,
            :func:`splitspec.models.layers.compile_parts`).
    """

    def __init__(self, engines_dir: Path, rank: int, world: int, comm: TPComm, device: str, placements: tuple[int, ...],
                 draft_device: str | None = None, kv_tokens: int | None = None, compile: bool = True,
                 cuda_graphs: bool = True, skinny_gemm: bool = False, pdl: bool = False):
        engines_dir = Path(engines_dir)
        meta = read_engine_meta(engines_dir / "target", "target")
        self.cfg = TargetConfig.from_dict(meta["config"])
        self.mapping = Mapping.from_dict(meta["mapping"])
        self.limits = meta["limits"]
        self.device = device
        weights = load_rank_weights(engines_dir / "target", rank, device, meta, target_shapes(self.cfg, self.mapping))
        self.dtype = weights["embed_tokens"].dtype
        self.target = TargetModel(self.cfg, self.mapping, rank, weights, comm, skinny_gemm=skinny_gemm)
        self.graphs = GraphCache(device, cuda_graphs)
        self.clock = PhaseClock(device)
        if self.graphs.on and compile:
            self.target.compile(pdl)  # fused layer halves inside the CUDA graphs
        self.kv_blocks = kv_blocks_for(self.limits, kv_tokens)
        rows = (self.kv_blocks + 1) * BLOCK_SIZE  # one extra block: the scratch rows padded sequences write
        self.scratch_row = self.kv_blocks * BLOCK_SIZE
        self.fill = RowFiller(self.kv_blocks, self.scratch_row)  # the steady phases' row tables, positions, write rows
        self.window = -(-self.limits["max_seq_len"] // BLOCK_SIZE) * BLOCK_SIZE
        self.tcache = TargetKVCache(self.cfg, rows, self.dtype, device)
        self.rank, self.world = rank, world
        self.capture: tuple[int, ...] = ()
        self.aux = AuxStates()
        # the last verify's plan, then its positions [B_pad, n], row table [B_pad, S] and write rows [B_pad, n]: numpy
        # views of its staging buffer, as the host filled them; a draft launched ahead behind that verify (of that plan
        # only) copies them (DraftAhead.launch)
        self.verify_fill: tuple[CyclePlan, np.ndarray, np.ndarray, np.ndarray] | None = None
        # {(Bp, n): the aux states that handoff holds a copy of}, for the latest writer only (older states are never
        # handed to a draft again: it gets the last verify's or a fresh concatenation)
        self.handed: dict[tuple[int, int], torch.Tensor] = {}
        # per placement here: (drafter, its K/V cache, the graph cache it drafts on); none for a TP1 drafter off rank 0
        self.slots: dict[int, tuple[Eagle3Drafter, object, GraphCache]] = {}
        here = [d for d in dict.fromkeys(placements) if d == world or rank == 0]
        if here:
            dmeta = read_engine_meta(engines_dir / "drafter", "drafter")
            dcfg = DrafterConfig.from_dict(dmeta["config"])
            self.capture = tuple(dmeta["capture_points"])
            if any(p > self.cfg.num_hidden_layers for p in self.capture):
                raise ConfigError(f"drafter capture points {self.capture} exceed the target's {self.cfg.num_hidden_layers} layers")
        loaded: dict[str, dict[str, torch.Tensor]] = {}  # the drafter's weights, read once per device (a shard's views share them)
        for draft_tp in here:
            ddev = device if draft_tp > 1 else (draft_device or device)
            if ddev not in loaded:
                loaded[ddev] = load_rank_weights(engines_dir / "drafter", 0, ddev, dmeta, drafter_shapes(dcfg))
            dw = shard_drafter_weights(loaded[ddev], dcfg, rank if draft_tp > 1 else 0, draft_tp)
            graphs = GraphCache(ddev, cuda_graphs) if torch.device(ddev) != torch.device(device) else self.graphs
            model = drafter_model(dcfg, dw, comm if draft_tp > 1 else TPComm())
            if graphs.on and compile:
                model.compile(pdl)  # fused drafter parts inside the draft phase's CUDA graphs
            self.slots[draft_tp] = (model, drafter_cache(dcfg, rows, dw["embed_tokens"].dtype, ddev, draft_tp), graphs)
        # the TP1 drafter's launches ahead (steady cycles whose plan asks: ServeConfig.draft_ahead), where it lives
        self.ahead = DraftAhead(str(self.slots[1][0].device), cuda_graphs, self.graphs) if 1 in self.slots else None
        if self.ahead is not None and self.ahead.graphs.on and compile:
            self.ahead.compile(pdl)
        self._use(placements[0])

    def _use(self, draft_tp: int) -> None:
        """Draft with the drafter of placement ``draft_tp`` from now on (None here: a TP1 drafter on rank 0)."""
        self.draft_tp = draft_tp
        self.drafter, self.dcache, self.draft_graphs = self.slots.get(draft_tp, (None, None, self.graphs))

    def switch_placement(self, draft_tp: int, work: list[SeqWork]) -> None:
        """Make placement ``draft_tp`` the drafting one, on every rank of the group at once (collectives).

        Moves the drafter KV rows of every decode work with k > 0 — a sequence's drafter KV is written while
        it drafts only and holds positions 0 .. extend_start − 1 before the cycle's extend; whole blocks move —
        from the layout of the placement drafting so far to the other. A cache split by head (the Llama drafter's
        K/V, ``shard_dim`` 1): TP1 [rows, H, D] on rank 0 → shard r [rows, H/N, D] (a scatter from rank 0: rank r
        receives heads r·H/N.. only), or the shards → TP1 (a gather to rank 0, which concatenates them by head,
        the shard functions' order); each rank sends or receives its 1/N of the rows. A cache every rank holds
        whole (the MLA drafter's latent, ``shard_dim`` None): TP1 → shards is a broadcast from rank 0, shards → TP1
        a copy on rank 0. A no-op when ``draft_tp`` drafts already. Raises ConfigError for a placement not loaded here."""
        old = self.draft_tp
        if draft_tp == old:
            return
        if draft_tp not in self.slots and not (draft_tp == 1 and self.rank != 0):
            raise ConfigError(f"draft_tp = {draft_tp}: not loaded (placements here: {sorted(self.slots)})")
        # the blocks holding each drafting sequence's drafter KV so far: positions 0 .. extend_start − 1
        blocks = [b for w in work if w.kind == "decode" and w.k > 0 for b in w.blocks[:-(-w.extend_start // BLOCK_SIZE)]]
        if blocks:
            shard = self.slots[self.world][1]
            rows = (torch.tensor(blocks)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten().to(self.device)
            for name, local in shard.parts().items():
                full = self.slots[1][1].parts()[name] if self.rank == 0 else None
                move_rows(local, full, rows, shard.shard_dim, old == 1, self.rank, self.world, self.device)
        self._use(draft_tp)

    def draft_phase(self, plan: CyclePlan) -> dict[int, list[int]]:
        """Extend the drafter over last cycle's accepted tokens, then draft: k tokens per decode work."""
        for w in plan.work:
            if w.kind == "decode" and w.keep_aux is not None and w.sid in self.aux:
                self.aux[w.sid] = self.aux[w.sid][: w.keep_aux]
        ws = [w for w in plan.work if w.kind == "decode" and w.k > 0]
        drafts: dict[int, list[int]] = {w.sid: [] for w in plan.work if w.kind == "decode"}
        if not ws:
            return drafts
        m, dev = self.drafter, self.drafter.device
        ext = ForwardBatch.build([(w.blocks, w.extend_start, w.extend_tokens) for w in ws], "last", dev)
        hidden = m.fuse(torch.cat([self.aux[w.sid] for w in ws]).to(dev))
        logits, h = m.forward(ext, hidden, self.dcache)
        h = h[ext.logits_rows]
        last = m.propose(logits).tolist()
        for w, d in zip(ws, last):
            drafts[w.sid].append(d)
        for i in range(1, max(w.k for w in ws)):
            active = [j for j, w in enumerate(ws) if w.k > i]
            step = ForwardBatch.build([(ws[j].blocks, ws[j].start - 1 + i, [drafts[ws[j].sid][-1]]) for j in active], "last", dev)
            logits, hs = m.forward(step, h[active], self.dcache)
            h = h.clone()
            h[active] = hs
            for j, d in zip(active, m.propose(logits).tolist()):
                drafts[ws[j].sid].append(d)
        return drafts

    def padded_k(self, plan: CyclePlan) -> int | None:
        """k if ``plan`` is a steady decode cycle (every work decodes with the same k and, with a drafter, each
        holds exactly the k+1 aux rows of its previous verify), else None. Decided by the leader."""
        ws = plan.work
        if not ws or any(w.kind != "decode" or w.k != ws[0].k for w in ws):
            return None
        k = ws[0].k
        if k and (self.drafter is None or any(w.sid not in self.aux or self.aux.rows(w.sid) != k + 1 or w.keep_aux is None
                                              for w in ws)):
            return None
        return k

    def window_for(self, plan: CyclePlan) -> int:
        """Key window S of a steady cycle's padded attention: the smallest power of two ≥ every verified position
        + 1 (at least 256 tokens, at most max_seq_len rounded to blocks). Attention reads S rows per sequence and
        layer, so S follows the batch's longest sequence instead of max_seq_len; one CUDA graph per S bucket."""
        need = max(w.start for w in plan.work) + plan.padded_k + 1
        return min(self.window, max(256, 1 << (need - 1).bit_length()))

    def draft_padded(self, plan: CyclePlan) -> torch.Tensor:
        """Static-shape draft phase of a steady cycle, one CUDA graph per (batch bucket, k, window): extend over
        k+1 (padded) rows, then k−1 single-token steps, each step a :meth:`Eagle3Drafter.draft` (with the compiled parts
        on one rank every op of a step is inside a compiled part; the greedy proposal and the map to target ids too).
        Returns drafts [B_pad, k] int64 on the drafter's device; no host synchronisation. The host fills the key's
        pinned buffer (:meth:`GraphCache.staging`, its copy up captured in the graph) — the extend's inputs and every
        step's positions and cache rows — and a drafter on the target's GPU reads the last verify's aux states where
        that verify's graph wrote them (:meth:`handoff`; copied there first when the batch changed since): a replay is
        one launch (a TP1 drafter on a GPU of its own gets them copied into the graph's input first). On
        CUDA graphs the drafts are the graph's output tensor itself, not a copy: valid until the next replay of a graph
        of the same cache (:class:`GraphCache`) — the verify copies them into its own input before it runs, and
        :meth:`verify_padded` returns that copy."""
        ws, k = plan.work, plan.padded_k
        B, n = len(ws), k + 1
        Bp = bucket(B)
        dev = self.drafter.device
        S = self.window_for(plan)
        key = ("draft", self.draft_tp, Bp, k, S)
        # extend ids [Bp, n], its positions, row table, write rows; each sequence's last extend row; the steps'
        # positions and write rows [k − 1, Bp] (step i at start − 1 + i); every row of a step [Bp]
        shapes = ((Bp, n), *padded_fields(Bp, n, S), (Bp,), (k - 1, Bp), (k - 1, Bp), (Bp,))
        flat, (ids, pos, table, rows, last, step_pos, step_rows, every) = self.draft_graphs.staging(key, shapes)
        ext = [w.extend_tokens for w in ws]
        ids[:B] = [t + [0] * (n - len(t)) for t in ext]
        last[:] = [b * n + len(t) - 1 for b, t in enumerate(ext)] + list(range(B * n, Bp * n, n))
        if Bp > B:
            ids[B:] = 0
        self.fill(pos, table, rows, [w.blocks for w in ws], [w.extend_start for w in ws])
        if k > 1:  # a padding sequence's steps: position 0, its table's scratch row
            self.fill.rows(step_pos.T, step_rows.T, table, [w.start for w in ws])
        every[:] = self.fill.arange(Bp)
        aux = self.aux.batch_for([w.sid for w in ws], Bp * n, dev)  # the target's hidden states, on the drafter's device
        handoff = self.handoff(Bp, n) if self.draft_graphs is self.graphs else None
        if handoff is not None and self.handed.get((Bp, n)) is not aux:  # not what the handoff holds
            handoff.copy_(aux)
            self.handed = {(Bp, n): aux}

        def draft(flat, aux_in):
            return self._draft_steps(*field_views(flat, shapes), aux_in, k)

        return self.draft_graphs.run(key, draft, flat, aux if handoff is None else handoff)

    def _draft_steps(self, ids, pos, table, rows, last_rows, step_pos, step_rows, every, aux_in, k: int) -> torch.Tensor:
        """The draft phase's forwards (:meth:`draft_padded`'s fields, as device tensors): the extend over ids [Bp, n]
        at positions ``pos`` writing ``rows``, the proposals at its ``last_rows``, then k − 1 single-token steps at
        ``step_pos`` / ``step_rows`` [k − 1, Bp]. Returns drafts [Bp, k] int64."""
        m = self.drafter
        tokens, h = m.draft(ForwardBatch(ids.flatten(), pos.flatten(), [], [], last_rows, table, rows.flatten()),
                            m.fuse(aux_in), self.dcache)
        out = [tokens]
        for i in range(k - 1):
            tokens, h = m.draft(ForwardBatch(tokens, step_pos[i], [], [], every, table, step_rows[i]), h, self.dcache)
            out.append(tokens)
        return torch.stack(out, 1) if k > 1 else tokens[:, None]

    def drafts_ahead(self, plan: CyclePlan) -> torch.Tensor | None:
        """The drafts [B_pad, k] launched by the cycle before for steady cycle ``plan`` (:meth:`DraftAhead.take`), or
        None; the clock then starts an ahead cycle."""
        if self.ahead is None:
            return None
        drafts = self.ahead.take(plan.work, plan.padded_k, self.draft_tp)
        if drafts is not None:
            self.clock.start(ahead=True)
        return drafts

    def handoff(self, Bp: int, n: int) -> torch.Tensor | None:
        """Where the verify graph of (batch bucket ``Bp``, ``n`` tokens per sequence) leaves its aux states
        [Bp·n, len(capture)·H] for the next draft graph on this device to read in place (:meth:`GraphCache.shared`);
        None when graphs are off or no drafter here drafts on the target's device."""
        if not self.capture or not any(g is self.graphs for _, _, g in self.slots.values()):
            return None
        return self.graphs.shared(("aux", Bp, n), (Bp * n, len(self.capture) * self.cfg.hidden_size), self.dtype)

    def verify_padded(self, plan: CyclePlan, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Static-shape verify of a steady cycle: [last token] + k drafts per sequence (padding sequences: zeros).
        Returns (logits [B·(k+1), V], the aux states [B_pad·(k+1), 3·H] or None — both the graph's outputs, padding
        rows as computed —, the drafts [B_pad, k] it verified: on CUDA graphs the graph's own copy of ``drafts``, which
        outlives the replay where the draft graph's output need not (a graph captured later in the shared pool may
        hold it in what this one frees, :class:`GraphCache`); eagerly ``drafts`` itself) and keeps each sequence's
        k+1 aux rows for the next extend (one tensor for the batch, padding rows zero, :meth:`AuxStates.keep_batch`)."""
        ws, k = plan.work, plan.padded_k
        B, n = len(ws), k + 1
        Bp = bucket(B)
        S = self.window_for(plan)
        key = ("verify", Bp, n, S)
        # positions, row table, write rows; each sequence's last known token; 1 for a real sequence, 0 for padding
        shapes = (*padded_fields(Bp, n, S), (Bp,), (Bp,))
        flat, (pos, table, rows, first, real) = self.graphs.staging(key, shapes)
        self.fill(pos, table, rows, [w.blocks for w in ws], [w.start for w in ws])
        self.verify_fill = (plan, pos, table, rows)
        first[:B] = [w.tokens[0] for w in ws]
        real[:B] = 1
        if Bp > B:
            first[B:], real[B:] = 0, 0
        handoff = self.handoff(Bp, n) if k else None

        def verify(flat, drafts):
            pos, table, rows, first, real = field_views(flat, shapes)
            ids = torch.cat((first[:, None], drafts * real[:, None]), 1).flatten()
            logits, aux = self.target.forward(ForwardBatch(ids, pos.flatten(), [], [], torch.arange(ids.numel(), device=ids.device),
                                                           table, rows.flatten()), self.tcache, self.capture)
            if handoff is not None:
                handoff.copy_(aux)  # for the next draft graph (padding rows as computed, not zeroed: their drafts are dropped)
            return logits, aux, drafts

        logits, aux, verified = self.graphs.run(key, verify, flat, drafts.to(self.device))
        if aux is not None:
            whole = aux.clone()  # graph outputs are overwritten by the next replay
            if Bp > B:
                whole[B * n:] = 0
            self.aux.keep_batch([w.sid for w in ws], whole, n)
            if handoff is not None:
                self.handed = {(Bp, n): whole}  # the verify's graph wrote its real rows there
        return logits[: B * n], aux, verified

    def execute_padded(self, plan: CyclePlan, drafts: torch.Tensor | None, draft_timed: bool = False,
                       on_launched: Callable[[], None] | None = None) -> CycleOutput:
        """Run a steady cycle in the static-shape form (CUDA graphs on GPU). ``drafts`` [B_pad, k] int64 comes from the
        leader's TP1 drafter (None: draft here, the drafter being sharded over the group; ``draft_timed``: the
        caller timed that draft on :attr:`clock`). The host waits for the GPU once, at the copy of the verified
        tokens' argmax and drafts to the host, with the sampled works' decisions made on the device
        (:func:`~splitspec.engine.acceptance.sampled_rows`; ``CycleOutput.sampled``): inputs go up from pinned
        memory without waiting (:meth:`GraphCache.staging`), the verify is queued behind the draft, and
        ``on_launched`` runs once both are queued, before that wait (host work there overlaps the GPU's)."""
        k = plan.padded_k
        if not draft_timed:
            self.clock.start()
            if drafts is None:
                drafts = self.draft_padded(plan) if k else torch.zeros(bucket(len(plan.work)), 0, dtype=torch.int64, device=self.device)
            self.clock.draft_done()
        logits, _, drafts = self.verify_padded(plan, drafts)
        B, n = len(plan.work), k + 1
        best = logits.argmax(-1)
        if self.clock.taken is not None:  # this cycle's drafts came ahead: the verify's end is the clock's second mark
            self.clock.verify_done()
        # the leader decides its sampled works here, on the device: for its host and a draft launched ahead alike
        rows, decided = sampled_rows(plan.work, logits.view(B, n, -1), drafts[:B]) if self.rank == 0 else ([], None)
        # the host's argmax marks a NaN or inf row −1 (greedy_ids); a draft launched ahead embeds ``best`` as it is
        both = torch.cat((greedy_ids(logits, best), drafts[:B].flatten()) + (() if decided is None else (decided.flatten(),)))
        ready = None
        if self.ahead is not None and self.ahead.wanted(self, plan):
            both, ready = self.ahead.to_host(both)  # queued before the next draft: the host need not wait for it
            self.ahead.launch(self, plan, best, drafts, (rows, decided), self.verify_fill)
        elif self.ahead is not None:
            self.ahead.drop()
        if on_launched is not None:
            on_launched()
        if ready is not None:
            ready.synchronize()
        host = both.tolist()  # the one copy to the host: argmax, drafts, sampled decisions
        greedy, flat, values = host[: B * n], host[B * n:B * n + B * k], host[B * n + B * k:]
        out_drafts = {w.sid: flat[b * k:(b + 1) * k] for b, w in enumerate(plan.work)}
        sampled = {plan.work[b].sid: values[3 * i:3 * i + 3] for i, b in enumerate(rows)} if rows else None
        return CycleOutput(logits, out_drafts, *self.clock.split(), greedy, sampled)

    def execute(self, plan: CyclePlan, on_launched: Callable[[], None] | None = None) -> CycleOutput:
        """Run one cycle on this rank: draft (if the drafter is sharded here and drafts were not given),
        then one target forward over every decode work's k+1 tokens and every prefill chunk (eagerly, waiting for
        the GPU after each draft step and at the end; ``on_launched`` runs before that last wait)."""
        for sid in plan.finished:
            self.aux.pop(sid, None)
        if self.ahead is not None:
            self.ahead.drop()
        t0 = time.perf_counter()
        drafts = plan.drafts
        if drafts is None:
            drafts = self.draft_phase(plan) if (self.draft_tp > 1 and self.drafter is not None) else {}
        _sync(self.device)
        t1 = time.perf_counter()
        seqs, wants = [], []
        for w in plan.work:
            if w.kind == "decode":
                seqs.append((w.blocks, w.start, w.tokens + drafts.get(w.sid, [])))
                wants.append("all")
            else:
                seqs.append((w.blocks, w.start, w.tokens))
                wants.append("last" if w.final else "none")
        batch = ForwardBatch.build(seqs, wants, self.device)
        logits, aux = self.target.forward(batch, self.tcache, self.capture)
        if aux is not None:
            t = 0
            for (_, _, toks), w in zip(seqs, plan.work):
                rows = aux[t:t + len(toks)]
                if w.kind == "decode":
                    self.aux[w.sid] = rows
                else:
                    self.aux[w.sid] = torch.cat((self.aux[w.sid], rows)) if w.start > 0 and w.sid in self.aux else rows
                t += len(toks)
        if on_launched is not None:
            on_launched()
        _sync(self.device)
        return CycleOutput(logits, drafts, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
