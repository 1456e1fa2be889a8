"""Draft-ahead: the next steady cycle's draft phase launched right behind this cycle's verify, before the host has
seen the verify's result.

A steady cycle's draft extends the drafter over the tokens the last verify accepted and then takes k − 1 steps
(:meth:`~splitspec.engine.rank.RankRunner.draft_padded`). Filled by the host, those inputs exist only once the host
has copied the verify's argmax back and accepted, so the GPU idles through that wait, the scheduler's acceptance and
events, the next plan and the draft's own input fill. Here the acceptance is also known on the device — greedy by
:func:`~splitspec.engine.acceptance.accepted`, sampled by the leader's decision on the device
(:func:`~splitspec.engine.acceptance.sampled_rows`, the one its host reads too), synthetic as drawn before the
cycle — and the next draft's token ids, logits rows and step positions follow from it in the draft's graph
(:func:`next_draft_inputs`); the rest of its inputs (the row table, the extend's positions and write rows) do not
depend on the acceptance: they are the verify's, which the host filled for it, copied. Its forwards are the
host-filled draft's, over a key window wide enough for any acceptance (every start + 2k): the same drafts, bit for
bit where attention's sum order does not follow the window (the CPU; on a GPU the paged-attention kernel splits
keys by window size, so a last bit may differ). The next cycle uses those drafts
when its plan is the one predicted (:meth:`DraftAhead.take`: the same sequences in the same order, extending where
this cycle verified); otherwise they are dropped. Either way the verify
decides every token, so output does not depend on this; a dropped draft only wrote drafter K/V rows at or past each
sequence's extend start, which the draft that replaces it (queued after it on the same stream) writes again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitspec.engine.acceptance import accepted, to_device
from splitspec.engine.graphs import GraphCache
from splitspec.engine.plan import CyclePlan
from splitspec.models.batch import bucket, field_views, padded_fields


def next_draft_inputs(best: torch.Tensor, drafts: torch.Tensor, forced: torch.Tensor, over: torch.Tensor,
                      starts: torch.Tensor, table: torch.Tensor, every: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The acceptance-dependent inputs of the draft phase after a verify, on the device (no host copy).

    Args:
        best: [B, n] int64, the target's argmax at the n = k + 1 verified positions of each sequence.
        drafts: [B, k] int64, the drafts verified; ``forced``: [B] (:func:`~splitspec.engine.acceptance.accepted`).
        over: [B, 2] int64, a sampled sequence's decision (drafts accepted, the token after them;
            :func:`~splitspec.engine.acceptance.sampled_decisions`), or −1 in its first column (greedy or forced).
        starts: [B] int64, each sequence's first verified position (its next extend starts there).
        table: [B, S] int64, the draft's row table; ``every``: [B] int64, 0 .. B − 1.
    Returns:
        ids [B, n] (the a accepted drafts, the target's token after them, zeros past it), last [B] (each sequence's
        last extend row of the flat [B·n] extend: b·n + a), step_pos and step_rows [k − 1, B] (step i at position
        start + a + i, and its cache row; positions clamped below S).
    """
    B, n = best.shape
    k = n - 1
    j = torch.arange(n, device=best.device)
    sampled = over[:, :1] >= 0
    forced = torch.where(sampled[:, 0], over[:, 0], forced)
    best = torch.where(sampled & (j == over[:, :1]), over[:, 1:], best)  # a sampled token replaces the argmax
    a = accepted(best, drafts, forced)[:, None]
    ids = torch.where(j < a, torch.cat((drafts, drafts.new_zeros(B, 1)), 1),
                      torch.where(j == a, best.gather(1, a), 0))
    last = every * n + a[:, 0]
    step_pos = (starts[:, None] + a + torch.arange(1, k, device=best.device)).clamp(max=table.shape[1] - 1)
    step_rows = table.gather(1, step_pos)
    return ids, last, step_pos.T.contiguous(), step_rows.T.contiguous()


@dataclass
class Launched:
    """A draft launched ahead: for sequences ``sids`` (in this order) extending at ``starts``, k drafts each, by
    placement ``draft_tp``; ``drafts`` [B_pad, k] int64 on the drafter's device (its graph's output)."""

    sids: tuple[int, ...]
    starts: tuple[int, ...]
    k: int
    draft_tp: int
    drafts: torch.Tensor


class DraftAhead:
    """A rank's draft-ahead state: its graphs (a pool of their own, so that their replays never reuse memory holding a
    verify's outputs; reading the verify's hand-off buffer in place), the launch pending, and the pinned host buffers
    the verify's result goes down into before the draft is queued behind it."""

    def __init__(self, device: str, enabled: bool, handoff_of: GraphCache | None):
        self.graphs = GraphCache(device, enabled)
        if handoff_of is not None and handoff_of.device == self.graphs.device:
            self.graphs.buffers = handoff_of.buffers  # the verify's aux hand-off, read in place
        self.pending: Launched | None = None
        self.host: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.no_sampled: dict[tuple[int, str], torch.Tensor] = {}
        self.inputs = next_draft_inputs

    def compile(self, pdl: bool = False) -> None:
        """:func:`next_draft_inputs` through ``torch.compile`` (the CUDA-graph path, as the drafter's parts): its dozen
        small element-wise ops and gathers in a few fused kernels at the head of each draft-ahead graph."""
        from splitspec.models.layers import compile_parts

        (self.inputs,) = compile_parts(next_draft_inputs, pdl=pdl)

    def drop(self) -> None:
        """Forget the launch pending: a cycle that does not use it, or the graphs' pool holding its drafts released."""
        self.pending = None

    def take(self, work, k: int, draft_tp: int) -> torch.Tensor | None:
        """The drafts launched ahead for a steady cycle of ``work`` (SeqWork list) with ``k`` drafts, placement
        ``draft_tp``, when it is the cycle they were launched for; else None. Either way nothing stays pending."""
        p, self.pending = self.pending, None
        if p is None or p.k != k or p.draft_tp != draft_tp or p.sids != tuple(w.sid for w in work):
            return None
        if p.starts != tuple(w.extend_start for w in work):
            return None
        return p.drafts

    @staticmethod
    def wanted(runner, plan) -> bool:
        """Whether ``runner`` (a RankRunner) launches the cycle after steady cycle ``plan`` ahead: the plan asks (the
        leader expects the same batch next), k > 0, and the drafter drafting is the TP1 one, on this rank."""
        return bool(plan.ahead and plan.padded_k and runner.draft_tp == 1 and runner.drafter is not None)

    def launch(self, runner, plan, best: torch.Tensor, verified: torch.Tensor, sampled: tuple[list[int], torch.Tensor | None],
               filled: tuple[CyclePlan, np.ndarray, np.ndarray, np.ndarray]) -> None:
        """Launch on ``runner`` (a RankRunner) the draft phase of the steady cycle expected after ``plan`` — the same
        sequences, each extending over what this cycle accepts — queued behind this cycle's verify. ``best`` [B·(k+1)]
        int64: the verify's argmax per row (real sequences); ``verified`` [B_pad, k]: the drafts it verified;
        ``sampled``: the indices of the works that sample and their decisions [S, 3] on the target's device
        (:func:`~splitspec.engine.acceptance.sampled_rows`); ``filled``: the verify's plan (``plan`` itself, else
        ValueError: another verify's rows would be copied), positions [B_pad, k+1], row table [B_pad, S_v] and write
        rows [B_pad, k+1] as the host filled them (:attr:`RankRunner.verify_fill`), which
        the extend reuses: copied, not filled again (the table too where S_v is this draft's window; a wider one, for
        a last step past S_v, gets a table filled). The acceptance is decided on the device (a sampled
        decision, ``SeqWork.accept`` where drawn already, else greedy); the drafts wait in :attr:`pending` for
        :meth:`take`. One CUDA graph per (batch bucket, k, window), the window wide enough for the next draft's last
        step (every start + 2k); the drafter's forwards are the host-filled draft's (``runner._draft_steps``)."""
        ws, k = plan.work, plan.padded_k
        B, n = len(ws), k + 1
        Bp = bucket(B)
        dev = runner.drafter.device
        need = max(w.start for w in ws) + 2 * k + 1
        S = min(runner.window, max(256, 1 << (need - 1).bit_length()))
        key = ("ahead", runner.draft_tp, Bp, k, S)
        shapes = (*padded_fields(Bp, n, S), (Bp,), (Bp,), (Bp,))  # positions, row table, write rows; starts, forced, every
        flat, (pos, table, rows, starts, forced, every) = self.graphs.staging(key, shapes)
        vplan, vpos, vtable, vrows = filled  # the extend at the verify's positions and rows, over the same blocks
        if vplan is not plan:  # another verify's fill: its positions and rows are not this plan's (same shapes or not)
            raise ValueError("draft-ahead: the filled positions and rows are another verify's, not this plan's")
        if vpos.shape != pos.shape:
            raise ValueError(f"draft-ahead: filled positions {vpos.shape}, expected this plan's {pos.shape}")
        np.copyto(pos, vpos)
        np.copyto(rows, vrows)
        if vtable.shape == table.shape:
            np.copyto(table, vtable)
        else:  # a wider window than the verify's: its last step reaches past the verify's table
            runner.fill.table(table, [w.blocks for w in ws])
        starts[:B] = [w.start for w in ws]
        forced[:B] = [-1 if w.accept is None else w.accept for w in ws]
        if Bp > B:
            starts[B:], forced[B:] = 0, 0
            best = torch.cat((best, best.new_zeros((Bp - B) * n)))
        every[:] = runner.fill.arange(Bp)
        handoff = runner.handoff(Bp, n)  # the verify's aux states where its graph left them, else the kept batch
        aux = handoff if handoff is not None and handoff.device == self.graphs.device else runner.aux.whole

        def draft(flat, best, drafts, over, aux_in):
            pos, table, rows, starts, forced, every = field_views(flat, shapes)
            ids, last, step_pos, step_rows = self.inputs(best.view(Bp, n), drafts, forced, over, starts, table, every)
            return runner._draft_steps(ids, pos, table, rows, last, step_pos, step_rows, every, aux_in, k)

        # from the target's GPU: the drafter's stream waits for them
        inputs = best.to(dev), verified.to(dev), self._overrides(Bp, *sampled, best.device).to(dev), aux.to(dev)
        runner.clock.ahead_start(str(dev))  # so this start is the verify's end there too
        drafts = self.graphs.run(key, draft, flat, *inputs)
        runner.clock.ahead_done()
        self.pending = Launched(tuple(w.sid for w in ws), tuple(w.start for w in ws), k, runner.draft_tp, drafts)

    def _overrides(self, Bp: int, rows: list[int], decisions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The ``over`` input of :func:`next_draft_inputs` [Bp, 2] int64: the sampled works' (accepted, token), −1
        elsewhere; one tensor of −1 per bucket, reused, when nothing samples."""
        if decisions is None:
            none = self.no_sampled.get((Bp, str(device)))
            if none is None:
                none = self.no_sampled[(Bp, str(device))] = torch.full((Bp, 2), -1, dtype=torch.int64, device=device)
            return none
        over = torch.full((Bp, 2), -1, dtype=torch.int64, device=device)
        over[to_device(rows, torch.int64, device)] = decisions[:, :2]
        return over

    def to_host(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Queue the copy of the 1-D int64 ``values`` into a pinned buffer (one per length, reused) and return it with
        the event to wait on before reading it (None on the CPU: copied already)."""
        n = values.numel()
        if not values.is_cuda:
            return values, None
        buf, event = self.host.get(n) or (torch.empty(n, dtype=torch.int64, pin_memory=True), torch.cuda.Event())
        self.host[n] = (buf, event)
        buf.copy_(values, non_blocking=True)
        event.record(torch.cuda.current_stream(values.device))
        return buf, event
