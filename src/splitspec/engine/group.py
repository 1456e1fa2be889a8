"""Engines on their ranks: the target's tensor-parallel group and the drafter, driven by the leader.

The leader (rank 0) lives in the caller's process (the Triton ``spec_decode`` model or the CLI) and
starts ranks 1..N−1 as worker processes (``python -m splitspec.engine.worker``). All ranks join one
``torch.distributed`` group (gloo on CPU; NCCL for GPU tensors with a gloo group for the control plane),
meeting at a ``TCPStore`` the leader opens on a free loopback port.

Each cycle the leader broadcasts one :class:`CyclePlan`; every rank executes it with
:meth:`RankRunner.execute`. Only the leader decides which tokens are accepted; the decision reaches the
other ranks as the next plan (accepted counts and tokens), so ranks never diverge on near-tied logits.

Draft placement: ``draft_tp=1`` — the drafter lives on the leader only (its own device, default target
rank 0's), it drafts before the plan is sent, and workers only verify. ``draft_tp=N`` — the drafter is
sharded over the target's group (the layout SGLang/vLLM/TensorRT-LLM use): every rank drafts with its
shard, paying the group's collectives on every draft step. Both can be loaded at once (per batch-size
bucket placement, ``splitspec tune``): each plan names the placement that drafts it, and a change of
placement first moves the decoding sequences' drafter K/V rows into the other layout
(:meth:`RankRunner.switch_placement`).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from splitspec.config import DrafterConfig, Mapping, TargetConfig
from splitspec.errors import CheckpointError, ConfigError, SplitspecError
from splitspec.files import read_json
from splitspec.engine.kv import BLOCK_SIZE
from splitspec.models.layers import TPComm
from splitspec.models.batch import ForwardBatch, padded, to_device
from splitspec.models.drafter import DrafterKVCache, DrafterModel, shard_drafter
from splitspec.models.target import TargetKVCache, TargetModel
from splitspec.settings import ServeConfig

#: Seconds close() waits for the workers to take the shutdown plan (an idle worker takes it at once; one
#: left inside a collective by an interrupted cycle never does) before it kills them.
SHUTDOWN_WAIT_S = 2.0
# Workers wait for the next cycle plan on a control group of their own: an idle server may wait for
# requests indefinitely (a leader that dies closes the connection, which ends the wait at once).
IDLE_TIMEOUT = datetime.timedelta(days=365)


class EngineError(SplitspecError):
    """The engine cannot serve: a worker process died or the group broke."""


def read_engine_meta(folder: Path, kind: str) -> dict:
    """Read and check ``engine.json`` of a built ``kind`` ('target' or 'drafter') engine: its kind, its config (and,
    for the target, mapping and limits) readable as ``splitspec build`` writes them. Raises CheckpointError naming the
    file and the field."""
    path = Path(folder) / "engine.json"
    meta = read_json(path)  # a JSON object, or CheckpointError
    if meta.get("kind") != kind:
        raise CheckpointError(f"{path}: kind {meta.get('kind')!r}, expected {kind!r}")
    try:
        (TargetConfig if kind == "target" else DrafterConfig).from_dict(meta["config"])
        if kind == "target":
            Mapping.from_dict(meta["mapping"])
            for name in ("max_batch_size", "max_seq_len", "max_draft_len"):
                v = meta["limits"][name]
                if not isinstance(v, int) or isinstance(v, bool) or v < (name != "max_draft_len"):
                    raise ValueError(f"limits.{name} = {v!r}, expected a positive integer")
    except KeyError as e:
        raise CheckpointError(f"{path}: field {e} missing (not an engine.json of splitspec build?)") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return meta


def load_rank_weights(folder: Path, rank: int, device: str, meta: dict | None = None, shapes: dict | None = None) -> dict[str, torch.Tensor]:
    """Runtime-layout weights of one rank: ``rank{i}.safetensors``, or, for a synthetic engine
    (``engine.json`` ``weights.synthetic``), seeded random tensors of ``shapes`` made on ``device``."""
    synthetic = (meta or {}).get("weights", {}).get("synthetic")
    if synthetic is not None:
        from splitspec.build.synthetic import random_weights

        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[meta["dtype"]]
        return random_weights(shapes, dtype, device, int(synthetic.get("seed", 0)) * 1000 + rank)
    path = Path(folder) / f"rank{rank}.safetensors"
    if not path.exists():
        raise CheckpointError(f"{path}: engine weights missing")
    return load_file(str(path), device=device)


@dataclass
class SeqWork:
    """One sequence's share of a cycle.

    kind 'prefill': ``tokens`` at positions start.. (a chunk of the prompt); ``final`` = last chunk.
    kind 'decode': verify ``tokens`` = [last known token] (+ this cycle's drafts) at positions start..;
    the drafter first extends rows extend_start.. with ``extend_tokens``, then takes k − 1 more steps.
    ``keep_aux``: rows of the previous verify's aux states still valid (accepted + 1); None keeps all.
    """

    sid: int
    blocks: list[int]
    kind: str
    start: int
    tokens: list[int]
    final: bool = True
    k: int = 0
    extend_start: int = 0
    extend_tokens: list[int] = field(default_factory=list)
    keep_aux: int | None = None


@dataclass
class CyclePlan:
    """Everything every rank needs for one cycle; ``drafts`` is filled by a TP1 drafter before sending.
    ``draft_tp``: the placement that drafts (None: the one drafting so far); ``placement_switch``: this
    message only makes ``draft_tp`` the drafting placement (:meth:`RankRunner.switch_placement`)."""

    work: list[SeqWork]
    finished: list[int] = field(default_factory=list)
    drafts: dict[int, list[int]] | None = None
    shutdown: bool = False
    padded_k: int | None = None  # set by the leader: a steady decode cycle run in the static-shape form
    draft_tp: int | None = None
    placement_switch: bool = False


@dataclass
class CycleOutput:
    """What the leader gets back: logits [R, V] (decode works: k+1 rows each; final prefill: 1 row),
    the drafts used, and times in ms."""

    logits: torch.Tensor
    drafts: dict[int, list[int]]
    draft_ms: float
    verify_ms: float
    greedy: list[int] | None = None  # argmax of every logits row, fetched with the drafts in one copy


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class PhaseClock:
    """Splits a steady cycle's wall time (ms) into its draft part and its verify part without waiting for the GPU
    in between: on CUDA the draft's end is a CUDA event recorded on ``device``'s current stream once the drafts are
    there, read after the cycle's one device-to-host copy (when it has completed); on the CPU a host clock.

    ``draft_ms``: from :meth:`start` (on CUDA: when the device reached the start event, right away when idle) to the
    drafts being on ``device``; ``verify_ms``: the rest of the wall time up to :meth:`split` — with a TP1 drafter in a
    group, sending the plan and the drafts to the workers too. GPU work queued before :meth:`start` and not waited
    for (a placement switch's scatter or gather) delays the start event, so it counts as verify time."""

    def __init__(self, device: str):
        self.device, self.cuda = device, device.startswith("cuda")
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda else ()
        self.t0 = self.t1 = 0.0

    def start(self) -> None:
        self.t0 = self.t1 = time.perf_counter()
        if self.cuda:
            self.events[0].record(torch.cuda.current_stream(self.device))

    def draft_done(self) -> None:
        if self.cuda:
            self.events[1].record(torch.cuda.current_stream(self.device))
        else:
            self.t1 = time.perf_counter()

    def split(self) -> tuple[float, float]:
        """(draft_ms, verify_ms); call after the host has waited for the work recorded since :meth:`start`."""
        total = (time.perf_counter() - self.t0) * 1e3
        draft = self.events[0].elapsed_time(self.events[1]) if self.cuda else (self.t1 - self.t0) * 1e3
        return draft, max(0.0, total - draft)


class RankRunner:
    """One rank: the target shard + its latent KV cache, and the drafter (shard) where it lives here.

    Args:
        engines_dir: folder with ``target/`` and ``drafter/`` engines.
        rank, world: position in the target's group; ``comm`` its collectives.
        placements: the draft_tp values loaded, each 1 (drafter on the leader, at ``draft_device``) or world
            (sharded over the group); the first drafts until :meth:`switch_placement`.
        compile, cuda_graphs: on a GPU, ``torch.compile`` the target's layers / replay steady cycles from CUDA graphs
            (:class:`splitspec.settings.ServeConfig`).
    """

    def __init__(self, engines_dir: Path, rank: int, world: int, comm: TPComm, device: str, placements: tuple[int, ...],
                 draft_device: str | None = None, kv_tokens: int | None = None, compile: bool = True,
                 cuda_graphs: bool = True):
        engines_dir = Path(engines_dir)
        meta = read_engine_meta(engines_dir / "target", "target")
        self.cfg = TargetConfig.from_dict(meta["config"])
        self.mapping = Mapping.from_dict(meta["mapping"])
        self.limits = meta["limits"]
        self.device = device
        from splitspec.build.synthetic import drafter_shapes, target_shapes

        weights = load_rank_weights(engines_dir / "target", rank, device, meta, target_shapes(self.cfg, self.mapping))
        self.dtype = weights["embed_tokens"].dtype
        self.target = TargetModel(self.cfg, self.mapping, rank, weights, comm)
        self.graphs = GraphCache(device, cuda_graphs)
        self.clock = PhaseClock(device)
        if self.graphs.on and compile:
            self.target.compile()  # fused layer halves inside the CUDA graphs
        self.kv_blocks = kv_blocks_for(self.limits, kv_tokens)
        rows = (self.kv_blocks + 1) * BLOCK_SIZE  # one extra block: the scratch rows padded sequences write
        self.scratch_row = self.kv_blocks * BLOCK_SIZE
        self.window = -(-self.limits["max_seq_len"] // BLOCK_SIZE) * BLOCK_SIZE
        self.tcache = TargetKVCache(self.cfg, rows, self.dtype, device)
        self.rank, self.world = rank, world
        self.capture: tuple[int, ...] = ()
        self.aux: dict[int, torch.Tensor] = {}
        # per placement here: (drafter, its K/V cache, the graph cache it drafts on); none for a TP1 drafter off rank 0
        self.slots: dict[int, tuple[DrafterModel, DrafterKVCache, GraphCache]] = {}
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
            dw = shard_drafter(loaded[ddev], dcfg, rank if draft_tp > 1 else 0, draft_tp)
            graphs = GraphCache(ddev, cuda_graphs) if torch.device(ddev) != torch.device(device) else self.graphs
            self.slots[draft_tp] = (DrafterModel(dcfg, dw, comm if draft_tp > 1 else TPComm()),
                                    DrafterKVCache(dcfg, rows, dw["fc"].dtype, ddev, draft_tp), graphs)
        self._use(placements[0])

    def _use(self, draft_tp: int) -> None:
        """Draft with the drafter of placement ``draft_tp`` from now on (None here: a TP1 drafter on rank 0)."""
        self.draft_tp = draft_tp
        self.drafter, self.dcache, self.draft_graphs = self.slots.get(draft_tp, (None, None, self.graphs))

    def switch_placement(self, draft_tp: int, work: list[SeqWork]) -> None:
        """Make placement ``draft_tp`` the drafting one, on every rank of the group at once (collectives).

        Moves the drafter K/V rows of every decode work with k > 0 — a sequence's drafter K/V is written while
        it drafts only and holds positions 0 .. extend_start − 1 before the cycle's extend; whole blocks move —
        from the layout of the placement drafting so far to the other: TP1 [rows, H, D] on rank 0 → shard r
        [rows, H/N, D] (a scatter from rank 0: rank r receives heads r·H/N.. only), or the shards → TP1 (a gather
        to rank 0, which concatenates them by head, :func:`shard_drafter`'s order). Each rank sends or receives
        its 1/N of the rows' K/V: rows × H/N × D × dtype bytes per K and per V. A no-op when ``draft_tp``
        drafts already. Raises ConfigError for a placement not loaded here."""
        old = self.draft_tp
        if draft_tp == old:
            return
        if draft_tp not in self.slots and not (draft_tp == 1 and self.rank != 0):
            raise ConfigError(f"draft_tp = {draft_tp}: not loaded (placements here: {sorted(self.slots)})")
        # the blocks holding each drafting sequence's drafter K/V so far: positions 0 .. extend_start − 1
        blocks = [b for w in work if w.kind == "decode" and w.k > 0 for b in w.blocks[:-(-w.extend_start // BLOCK_SIZE)]]
        if blocks:
            shard = self.slots[self.world][1]
            rows = (torch.tensor(blocks)[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten().to(self.device)
            for name in ("k", "v"):
                local = getattr(shard, name)
                mine = local.new_empty((len(rows), *local.shape[1:]))
                full = getattr(self.slots[1][1], name) if self.rank == 0 else None
                if old == 1:  # rank 0 cuts its TP1 rows by head and sends each rank its own heads only
                    parts = ([c.contiguous() for c in full[rows.to(full.device)].to(self.device).chunk(self.world, 1)]
                             if self.rank == 0 else None)
                    dist.scatter(mine, parts, src=0)
                    local[rows] = mine
                else:  # every shard's rows to rank 0 only, which concatenates them by head
                    mine.copy_(local[rows])
                    parts = [torch.empty_like(mine) for _ in range(self.world)] if self.rank == 0 else None
                    dist.gather(mine, parts, dst=0)
                    if self.rank == 0:
                        full[rows.to(full.device)] = torch.cat(parts, 1).to(full.device)
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
        if k and (self.drafter is None or any(w.sid not in self.aux or self.aux[w.sid].shape[0] != k + 1 or w.keep_aux is None
                                              for w in ws)):
            return None
        return k

    def window_for(self, plan: CyclePlan) -> int:
        """Key window S of a steady cycle's padded attention: the smallest power of two ≥ every verified position
        + 1 (at least 256 tokens, at most max_seq_len rounded to blocks). Attention reads S rows per sequence and
        layer, so S follows the batch's longest sequence instead of max_seq_len; one CUDA graph per S bucket."""
        need = max(w.start for w in plan.work) + plan.padded_k + 1
        return min(self.window, max(256, 1 << (need - 1).bit_length()))

    def _padded(self, seqs, pad_to: int, window: int, device: str | torch.device | None = None):
        return padded(seqs, window, device or self.device, scratch_row=self.scratch_row, pad_to=pad_to)

    def draft_padded(self, plan: CyclePlan) -> torch.Tensor:
        """Static-shape draft phase of a steady cycle, one CUDA graph per (batch bucket, k, window): extend over
        k+1 (padded) rows, then k−1 single-token steps whose positions and cache rows are computed on the device.
        Returns drafts [B_pad, k] int64 on the drafter's device; no host synchronisation."""
        ws, k = plan.work, plan.padded_k
        B, n = len(ws), k + 1
        Bp = bucket(B)
        m, dev = self.drafter, self.drafter.device
        S = self.window_for(plan)
        ext = self._padded([(w.blocks, w.extend_start, w.extend_tokens + [0] * (n - len(w.extend_tokens))) for w in ws], Bp, S, "cpu")
        aux = torch.cat([self.aux[w.sid] for w in ws]).to(dev)  # the target's hidden states, on the drafter's device
        aux = torch.cat((aux, aux.new_zeros((Bp - B) * n, aux.shape[1])))
        # step i (1..k−1) drafts at position start − 1 + i; padding rows write the scratch row
        last = torch.tensor([b * n + len(w.extend_tokens) - 1 for b, w in enumerate(ws)] + [b * n for b in range(B, Bp)])
        first_step = torch.tensor([w.start for w in ws] + [0] * (Bp - B))
        ids, pos, table, rows, last, first_step = to_device(dev, ext.input_ids, ext.positions, ext.table, ext.write_rows, last,
                                                            first_step)  # one copy up, the host not waiting
        real = torch.arange(Bp, device=dev) < B
        scratch = self.scratch_row

        def draft(ids, pos, table, rows, aux_in, last_rows, step_pos, real_rows):
            logits, h = m.forward(ForwardBatch(ids, pos, [], [], last_rows, table, rows), m.fuse(aux_in), self.dcache)
            out, h = [m.propose(logits)], h[last_rows]
            every = torch.arange(Bp, device=ids.device)
            for i in range(1, k):
                p = step_pos + (i - 1)
                r = torch.where(real_rows, torch.gather(table, 1, p[:, None])[:, 0], scratch)
                logits, h = m.forward(ForwardBatch(out[-1], p, [], [], every, table, r), h, self.dcache)
                out.append(m.propose(logits))
            return torch.stack(out, 1)

        drafts = self.draft_graphs.run(("draft", self.draft_tp, Bp, k, S), draft, ids, pos, table, rows, aux, last, first_step, real)
        return drafts.clone()  # graph outputs are overwritten by the next replay

    def verify_padded(self, plan: CyclePlan, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Static-shape verify of a steady cycle: [last token] + k drafts per sequence. Returns logits [B·(k+1), V]
        and keeps each sequence's k+1 aux rows for the next extend."""
        ws, k = plan.work, plan.padded_k
        B, n = len(ws), k + 1
        Bp = bucket(B)
        S = self.window_for(plan)
        vb = self._padded([(w.blocks, w.start, [w.tokens[0]] * n) for w in ws], Bp, S)
        ids = vb.input_ids.view(Bp, n).clone()
        ids[:, 1:] = drafts.to(self.device)
        ids[B:] = 0

        def verify(ids, pos, table, rows):
            return self.target.forward(ForwardBatch(ids, pos, [], [], torch.arange(ids.numel(), device=ids.device), table, rows),
                                       self.tcache, self.capture)

        logits, aux = self.graphs.run(("verify", Bp, n, S), verify, ids.flatten(), vb.positions, vb.table, vb.write_rows)
        if aux is not None:
            for b, w in enumerate(ws):
                self.aux[w.sid] = aux[b * n:(b + 1) * n].clone()
        return logits[: B * n], aux

    def execute_padded(self, plan: CyclePlan, drafts: torch.Tensor | None, draft_timed: bool = False,
                       on_launched: Callable[[], None] | None = None) -> CycleOutput:
        """Run a steady cycle in the static-shape form (CUDA graphs on GPU). ``drafts`` [B_pad, k] int64 comes from the
        leader's TP1 drafter (None: draft here, the drafter being sharded over the group; ``draft_timed``: the
        caller timed that draft on :attr:`clock`). The host waits for the GPU once, at the copy of the verified
        tokens and drafts to the host, for greedy requests (sampled ones wait again in the acceptance test): inputs
        go up from pinned memory without waiting (:func:`to_device`), the verify is queued behind the draft, and
        ``on_launched`` runs once both are queued, before that wait (host work there overlaps the GPU's)."""
        k = plan.padded_k
        if not draft_timed:
            self.clock.start()
            if drafts is None:
                drafts = self.draft_padded(plan) if k else torch.zeros(bucket(len(plan.work)), 0, dtype=torch.int64, device=self.device)
            self.clock.draft_done()
        logits, _ = self.verify_padded(plan, drafts)
        B, n = len(plan.work), k + 1
        both = torch.cat((logits.argmax(-1), drafts[:B].flatten().to(logits.device)))
        if on_launched is not None:
            on_launched()
        host = both.tolist()  # the one copy to the host
        greedy, flat = host[: B * n], host[B * n:]
        out_drafts = {w.sid: flat[b * k:(b + 1) * k] for b, w in enumerate(plan.work)}
        return CycleOutput(logits, out_drafts, *self.clock.split(), greedy)

    def execute(self, plan: CyclePlan, on_launched: Callable[[], None] | None = None) -> CycleOutput:
        """Run one cycle on this rank: draft (if the drafter is sharded here and drafts were not given),
        then one target forward over every decode work's k+1 tokens and every prefill chunk (eagerly, waiting for
        the GPU after each draft step and at the end; ``on_launched`` runs before that last wait)."""
        for sid in plan.finished:
            self.aux.pop(sid, None)
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


def kv_blocks_for(limits: dict, kv_tokens: int | None) -> int:
    """KV blocks for a token budget (default: the engine's max_batch_size × max_seq_len)."""
    tokens = kv_tokens or limits.get("kv_tokens") or limits["max_batch_size"] * limits["max_seq_len"]
    if tokens < 1:
        raise ConfigError(f"kv_tokens = {tokens}, expected a positive token budget")
    return -(-int(tokens) // BLOCK_SIZE)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(batch: int) -> int:
    """The smallest batch bucket holding ``batch`` sequences (padded sequences write scratch rows)."""
    return next(b for b in BATCH_BUCKETS if b >= batch) if batch <= BATCH_BUCKETS[-1] else batch


class GraphCache:
    """CUDA graphs of static-shape functions on one device, captured on first use per key (eager on CPU or when
    not ``enabled``: ``ServeConfig.cuda_graphs``). Inputs are copied into the graph's static buffers before each replay;
    outputs are the graph's static output tensors (valid until the next replay of the same key). Capture and
    replay run with ``device`` current, whatever the calling thread's current device, and capture on a stream
    of this device: ``torch.cuda.graph``'s default capture stream is one per process, made on the device
    current at the first capture, and a graph captured on another device's stream records none of this
    device's kernels (its replays then return the capture-time outputs)."""

    def __init__(self, device: str, enabled: bool = True):
        self.on = device.startswith("cuda") and enabled
        self.device = torch.device(device)
        self.graphs: dict = {}
        self.pool = self.capture_stream = None
        if self.on:
            with torch.cuda.device(self.device):
                self.pool = torch.cuda.graph_pool_handle()
                self.capture_stream = torch.cuda.Stream()

    def clear(self) -> None:
        """Drop every graph (before the process group they captured collectives of is destroyed)."""
        if self.on:
            torch.cuda.synchronize(self.device)
        self.graphs.clear()

    def run(self, key, fn, *inputs):
        if not self.on:
            return fn(*inputs)
        with torch.cuda.device(self.device):
            return self._run(key, fn, *inputs)

    def _run(self, key, fn, *inputs):
        entry = self.graphs.get(key)
        if entry is None:
            static = [x.clone() for x in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*static)  # warm-up outside the graph (allocator, lazy init)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                outputs = fn(*static)
            entry = self.graphs[key] = (graph, static, outputs)
        graph, static, outputs = entry
        for buf, x in zip(static, inputs):
            buf.copy_(x, non_blocking=True)
        graph.replay()
        return outputs


def _threads_per_rank(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def worker_loop(engines_dir: Path, rank: int, world: int, store_port: int, device: str, placements: tuple[int, ...],
                kv_tokens: int | None = None, compile: bool = True, cuda_graphs: bool = True,
                collective_timeout_s: int = 300) -> None:
    """Body of a worker rank: join the group, load its shards, execute plans until shutdown. The switches are
    the leader's :class:`ServeConfig`'s, passed on the worker's command line."""
    torch.set_num_threads(_threads_per_rank(world))
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timeout)
    store.set(f"up/{rank}", "1")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    runner = RankRunner(engines_dir, rank, world, TPComm(rank, world), device, placements, kv_tokens=kv_tokens,
                        compile=compile, cuda_graphs=cuda_graphs)
    store.set(f"ready/{rank}", "1")
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, 0, group=control)
            plan: CyclePlan = box[0]
            if plan.shutdown:
                runner.graphs.clear()
                break
            if plan.placement_switch:
                runner.switch_placement(plan.draft_tp, plan.work)
                continue
            if plan.padded_k is not None:
                drafts = None
                if runner.draft_tp == 1 and plan.padded_k:
                    drafts = torch.empty(bucket(len(plan.work)), plan.padded_k, dtype=torch.int64, device=device)
                    dist.broadcast(drafts, 0)
                for sid in plan.finished:
                    runner.aux.pop(sid, None)
                runner.execute_padded(plan, drafts)
            else:
                runner.execute(plan)
    dist.destroy_process_group()


class Group:
    """The leader's handle on the target's TP group (rank 0 here, workers started here) and the drafter.

    Args:
        cfg: the deployment: engines_dir, target_device_ids (``()``: CPU), draft_device_id (a TP1 drafter's GPU; None:
            rank 0's), kv_tokens and the switches padded, compile, cuda_graphs, collective_timeout_s.
        placements: the draft_tp values to load, 1 and/or the target's TP size (the first drafts until a plan names
            the other); None: ``(cfg.draft_tp or 1,)``.
    Raises:
        ConfigError: a placement the engines cannot take. EngineError: a worker fails to start or dies.
    """

    def __init__(self, cfg: ServeConfig, placements: tuple[int, ...] | None = None, start_timeout_s: float = 300.0):
        self.config = cfg
        self.engines_dir = cfg.engines_dir
        device_ids, kv_tokens = list(cfg.target_device_ids), cfg.kv_tokens
        draft_tp = (cfg.draft_tp or 1,) if placements is None else placements
        meta = read_engine_meta(self.engines_dir / "target", "target")
        self.world = int(meta["mapping"]["tp_size"])
        self.placements = tuple(dict.fromkeys((draft_tp,) if isinstance(draft_tp, int) else draft_tp))
        for dtp in self.placements or (None,):
            if dtp not in (1, self.world):
                raise ConfigError(f"draft_tp = {dtp}: expected 1 (split placement) or {self.world} (sharded over the target's TP group)")
        if device_ids and len(device_ids) != self.world:
            raise ConfigError(f"target engine is TP{self.world} but {len(device_ids)} target device ids were given")
        if device_ids and (not torch.cuda.is_available() or max(device_ids) >= torch.cuda.device_count()):
            raise ConfigError(f"target_device_ids {device_ids}: this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s)")
        self.devices = [f"cuda:{i}" for i in device_ids] if device_ids else ["cpu"] * self.world
        draft_device = f"cuda:{cfg.draft_device_id}" if cfg.draft_device_id is not None else None
        # steady decode cycles in the static-shape form: always on GPU (CUDA graphs), opt-in on CPU
        self.padded = bool(device_ids) or cfg.padded
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        self.procs: list[subprocess.Popen] = []
        self.control = None
        self.closed = False
        self._sending_plan = False  # a plan broadcast started and did not finish (interrupted: see close())
        cuda = self.devices[0].startswith("cuda")
        if cuda:
            torch.cuda.set_device(self.devices[0])
        if self.world > 1:
            if dist.is_initialized():
                raise EngineError("a torch.distributed group already exists in this process; one target group per process")
            self.store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False, timeout=timeout)
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            for r in range(1, self.world):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "splitspec.engine.worker", "--engines", str(self.engines_dir), "--rank", str(r),
                     "--world", str(self.world), "--store-port", str(self.store.port), "--device", self.devices[r],
                     "--draft-tp", ",".join(map(str, self.placements)), "--kv-tokens", str(kv_tokens or 0),
                     "--collective-timeout-s", str(cfg.collective_timeout_s)]
                    + ["--no-compile"] * (not cfg.compile) + ["--no-cuda-graphs"] * (not cfg.cuda_graphs), env=env))
            torch.set_num_threads(_threads_per_rank(self.world))
            try:
                # join only once every worker is up: init_process_group cannot notice a worker that died
                # starting (or be interrupted by Ctrl-C) until its timeout
                self._wait_for("up", start_timeout_s)
                dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=self.store, rank=0,
                                        world_size=self.world, timeout=timeout)
                self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            except BaseException:
                self._kill()
                raise
        try:
            self.rank0 = RankRunner(self.engines_dir, 0, self.world, TPComm(0, self.world), self.devices[0], self.placements,
                                    draft_device, kv_tokens, cfg.compile, cfg.cuda_graphs)
            self._wait_for("ready", start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_for(self, what: str, timeout_s: float) -> None:
        """Wait until every worker has set ``what/<rank>`` in the store, checking that each is alive (a
        Python loop: Ctrl-C interrupts it). Raises EngineError for a dead worker or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for r in range(1, self.world):
            while True:
                self.check_workers()
                if self.store.check([f"{what}/{r}"]):
                    break
                if time.monotonic() > deadline:
                    raise EngineError(f"target worker rank {r} did not become {what} in {timeout_s:.0f} s")
                time.sleep(0.05)

    @property
    def draft_tp(self) -> int:
        """The placement drafting now (1 or the target's TP size)."""
        return self.rank0.draft_tp

    @property
    def cfg(self) -> TargetConfig:
        return self.rank0.cfg

    @property
    def limits(self) -> dict:
        return self.rank0.limits

    def check_workers(self) -> None:
        """Raise EngineError if any worker process has exited."""
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise EngineError(f"target worker rank {r} (pid {p.pid}) exited with status {p.returncode}")

    def run(self, plan: CyclePlan, on_launched: Callable[[], None] | None = None) -> CycleOutput:
        """Execute one cycle on every rank and return rank 0's output. A change of placement (``plan.draft_tp``)
        comes first, on every rank (:meth:`RankRunner.switch_placement`); its host time counts as draft time.
        ``on_launched``: called once the cycle's GPU work is queued, before the host waits for it."""
        if self.closed:
            raise EngineError("the engine is closed")
        r0, switch_ms = self.rank0, 0.0
        if plan.draft_tp is not None and plan.draft_tp != r0.draft_tp:
            if plan.draft_tp not in self.placements:
                raise ConfigError(f"draft_tp = {plan.draft_tp}: not loaded (placements {list(self.placements)})")
            t0 = time.perf_counter()
            if self.world > 1:
                self.check_workers()
                self._send_plan(CyclePlan(plan.work, draft_tp=plan.draft_tp, placement_switch=True))
            r0.switch_placement(plan.draft_tp, plan.work)
            switch_ms = (time.perf_counter() - t0) * 1e3
        out = self._cycle(plan, on_launched)
        out.draft_ms += switch_ms
        return out

    def _cycle(self, plan: CyclePlan, on_launched: Callable[[], None] | None) -> CycleOutput:
        r0 = self.rank0
        if self.padded:
            for sid in plan.finished:
                r0.aux.pop(sid, None)
            plan.padded_k = r0.padded_k(plan)
        if plan.padded_k is not None:
            drafts = None
            if r0.draft_tp == 1 and plan.padded_k:
                r0.clock.start()
                # from a drafter on its own GPU: to the GPU of rank 0's NCCL communicator (queued behind the draft)
                drafts = r0.draft_padded(plan).to(r0.device)
                r0.clock.draft_done()
            if self.world > 1:
                self.check_workers()
                self._send_plan(plan)
                if drafts is not None:
                    dist.broadcast(drafts, 0)
            return r0.execute_padded(plan, drafts, draft_timed=drafts is not None, on_launched=on_launched)
        t0 = time.perf_counter()
        if r0.draft_tp == 1 and r0.drafter is not None:
            plan.drafts = r0.draft_phase(plan)
        draft_ms = (time.perf_counter() - t0) * 1e3
        if self.world > 1:
            self.check_workers()
            self._send_plan(plan)
        out = r0.execute(plan, on_launched)
        if r0.draft_tp == 1:
            out.draft_ms = draft_ms
        return out

    def _send_plan(self, plan: CyclePlan) -> None:
        """Broadcast ``plan`` to the workers. ``broadcast_object_list`` is two broadcasts (size, then bytes): a
        KeyboardInterrupt between them leaves the workers expecting bytes, and a shutdown plan sent after it
        would be unpickled from its size header — so :meth:`close` kills the workers instead."""
        self._sending_plan = True
        dist.broadcast_object_list([plan], 0, group=self.control)
        self._sending_plan = False

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stop the workers (shutdown plan, then kill stragglers) and leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        group, t = self.world > 1 and dist.is_initialized(), None
        if group:
            if not self._sending_plan:  # else the control group is mid-message (see _send_plan): kill the workers
                sent = threading.Event()

                def shutdown() -> None:
                    try:
                        self.check_workers()
                        dist.broadcast_object_list([CyclePlan(work=[], shutdown=True)], 0, group=self.control)
                        sent.set()
                        for p in self.procs:
                            p.wait(timeout=10)
                    except Exception:
                        pass

                # in a thread: after an interrupted cycle a worker may sit in a collective and never take the
                # shutdown plan; killing it then releases the broadcast
                t = threading.Thread(target=shutdown, name="splitspec-group-shutdown", daemon=True)
                t.start()
                if sent.wait(timeout=SHUTDOWN_WAIT_S):  # taken: let the workers exit on their own
                    t.join(timeout=10)
            self._kill()
            if t is not None:
                t.join(timeout=5)
        # the graphs (and their memory pools) go now, with one rank too, not whenever the runner is collected; with a
        # group, after its workers and before leaving it (they hold its collectives)
        self._release_graphs()
        if group and (t is None or not t.is_alive()):  # else leaving the group could block as well; the process is ending anyway
            dist.destroy_process_group()
        self._kill()
        self.procs = []

    def _release_graphs(self) -> None:
        runner = getattr(self, "rank0", None)
        if runner is not None:
            for graphs in {id(g): g for g in [runner.graphs] + [slot[2] for slot in runner.slots.values()]}.values():
                graphs.clear()
