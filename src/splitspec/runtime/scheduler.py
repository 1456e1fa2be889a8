"""Continuous-batching speculative decoding over the target group and the EAGLE-3 drafter.

A *cycle* (docs/architecture.md) runs one batched draft phase — the drafter extends over the
tokens each sequence accepted last cycle, then takes k − 1 more steps — and one batched target forward that
verifies every decoding sequence's k + 1 positions and prefills chunks of newly admitted prompts. Sequences
join and leave between cycles. Acceptance is decided here, once, on the leader (:mod:`splitspec.runtime.sampling`):
greedy output is token-for-token identical to target-only greedy decoding; sampled output has the target's
distribution.

Indexing: with n known tokens x_0..x_{n−1}, the target's KV cache and aux states cover positions 0..n−2;
drafter row j pairs aux(j) with token x_{j+1} at rotary position j and predicts x_{j+2}.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from splitspec.engine.group import Group
from splitspec.models.kv import BlockAllocator
from splitspec.engine.plan import CyclePlan, EngineError, SeqWork
from splitspec.errors import ConfigError
from splitspec.runtime.admission import AdmissionQueue
from splitspec.runtime.placement import SWITCH_AFTER_CYCLES, by_bucket, next_placement, tuned_choice
from splitspec.runtime.sampling import (SamplingParams, draw, draw_cycle, greedy_ids, greedy_token, read_decision,
                                       synthetic_accept, target_probs, verify, verify_synthetic)
from splitspec.runtime.sequence import Sequence
from splitspec.runtime.types import CycleStats, GenerationResult, Request, RequestOutput
from splitspec.settings import ServeConfig


class SpeculativeEngine:
    """Continuous-batching EAGLE-3 speculation over a target TP group and a drafter (TP1 or TP-N).

    Single-threaded core: :meth:`submit` (thread-safe) queues requests, :meth:`step` runs one cycle.
    :meth:`generate` runs one request to completion; :class:`~splitspec.runtime.loop.EngineLoop` runs cycles in a
    background thread.

    The deployment's settings are the group's :class:`~splitspec.settings.ServeConfig` (``group.config``):
    num_draft_tokens (default k per request; 0 disables speculation; None: 4), max_batch_size (sequences decoded at
    once; None: the engine's), max_prefill_tokens (prompt tokens prefilled per cycle) and synthetic_acceptance
    (benchmark only — per-position acceptance probabilities; outputs are then NOT the target's and every result
    is labelled ``synthetic``), max_queue_s (a request queued longer ends with finish_reason ``"busy"``; None: no
    limit). ``tokenizer``: for stop strings and text (None: token ids only).
    """

    def __init__(self, group: Group, tokenizer=None):
        self.group = group
        self.config = cfg = group.config
        limits = group.limits
        self.max_seq_len, self.max_draft_len = limits["max_seq_len"], limits["max_draft_len"]
        self.max_batch_size = limits["max_batch_size"] if cfg.max_batch_size is None else cfg.max_batch_size
        self.max_prefill_tokens = cfg.max_prefill_tokens
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size = {self.max_batch_size!r}, expected an integer ≥ 1")
        num_draft_tokens = 4 if cfg.num_draft_tokens is None else cfg.num_draft_tokens
        synthetic_acceptance = None if cfg.synthetic_acceptance is None else list(cfg.synthetic_acceptance)
        self.num_draft_tokens = num_draft_tokens
        self._check_k(num_draft_tokens)
        if num_draft_tokens and group.rank0.drafter is None:
            raise ConfigError("speculation requested but no drafter is loaded")
        self.tokenizer = tokenizer
        self.synthetic = synthetic_acceptance
        self.vocab_size = group.cfg.vocab_size
        self.alloc = BlockAllocator(group.rank0.kv_blocks)
        self.queue = AdmissionQueue(cfg.max_queue_s)  # submitted, waiting for a batch slot and KV blocks
        self.running: list[Sequence] = []
        self.seqs: dict[int, Sequence] = {}
        self._finished_ids: list[int] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[RequestOutput], None]] = {}
        self._emitting = threading.Lock()  # held while events go to callbacks: a request's final event is its last
        self.failed: str | None = None  # why the engine stopped serving (fail_requests)
        self.k_by_batch: dict[int, int] = {}
        self.draft_tp_by_batch: dict[int, int] = {}  # several placements loaded: which drafts per batch bucket
        self.switch_after = SWITCH_AFTER_CYCLES
        self._wanting_other = 0  # consecutive drafting cycles whose bucket wanted the other placement (next_placement)
        self.on_cycle: Callable[[CycleStats], None] | None = None
        # called on the stepping thread once a cycle's GPU work is queued, before the host waits for it: host work
        # there (the engine process sends the previous cycle's events) overlaps the GPU's
        self.on_launched: Callable[[], None] | None = None
        self.last_cycle: CycleStats | None = None

    @classmethod
    def load(cls, cfg: ServeConfig, tokenizer_dir: Path | None = None) -> "SpeculativeEngine":
        """Start the target group, load the drafter, and return the engine for the deployment ``cfg``.

        ``cfg.draft_tp`` / ``cfg.num_draft_tokens`` left None follow ``engines_dir/tuning.json``
        (:func:`~splitspec.runtime.placement.tuned_choice`), else draft_tp 1 and k 4.
        ``tokenizer_dir``: folder of tokenizer files for stop strings and text (default ``engines_dir/target``;
        ``tokenizer.json`` or ``tiktoken.model``, see :class:`~splitspec.runtime.tokenizer.ChatTokenizer`).
        """
        choice = tuned_choice(cfg)
        tok = None
        tdir = Path(tokenizer_dir) if tokenizer_dir else cfg.engines_dir / "target"
        from splitspec.runtime.tokenizer import ChatTokenizer, has_tokenizer

        if has_tokenizer(tdir):
            tok = ChatTokenizer.from_dir(tdir, trust_remote_code=cfg.trust_remote_code)
        group = Group(cfg, choice.placements)
        try:
            eng = cls(group, tok)
            eng.k_by_batch, eng.draft_tp_by_batch = dict(choice.k_by_batch), dict(choice.draft_tp_by_batch)
            return eng
        except BaseException:
            group.close()
            raise

    def close(self) -> None:
        """Stop the target's worker processes. Idempotent."""
        self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- requests

    def default_k(self) -> int:
        """k for a request that does not ask: the tuned k of the batch bucket the engine is in (running +
        queued + this request), else the deployment's default."""
        if not self.k_by_batch:
            return self.num_draft_tokens
        return by_bucket(self.k_by_batch, len(self.running) + len(self.queue) + 1)

    def draft_tp_for(self, batch: int) -> int:
        """The placement wanted for a cycle of ``batch`` drafting sequences: the tuned one of its bucket where
        several are loaded, else the one loaded."""
        return by_bucket(self.draft_tp_by_batch, batch) if self.draft_tp_by_batch else self.group.draft_tp

    def _placement(self, drafting: int) -> int | None:
        """The placement this cycle drafts with (:func:`~splitspec.runtime.placement.next_placement` over
        :meth:`draft_tp_for` and ``switch_after``); None (no change) when nothing drafts."""
        if not drafting:
            return None
        placement, self._wanting_other = next_placement(self.group.draft_tp, self.draft_tp_for(drafting),
                                                        self._wanting_other, self.switch_after)
        return placement

    def _check_k(self, k: int) -> None:
        if not 0 <= k <= self.max_draft_len:
            raise ConfigError(f"num_draft_tokens = {k}, expected 0..{self.max_draft_len} (engine max_draft_len)")

    def check_request(self, req: Request) -> int:
        """Validate a request (:meth:`Request.check`) and against the engine's limits; return its k.

        Raises:
            ConfigError: a malformed request, an out-of-vocabulary prompt, a k beyond max_draft_len (or > 0 without a
                drafter), stop strings without a tokenizer, or prompt + max_tokens + k + 1 beyond max_seq_len or the
                KV budget.
        """
        req.check()
        k = self.default_k() if req.num_draft_tokens is None else req.num_draft_tokens
        bad = [(i, t) for i, t in enumerate(req.prompt_ids) if not 0 <= t < self.vocab_size]
        if bad:
            where = ", ".join(f"{t} at position {i}" for i, t in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise ConfigError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {where}")
        self._check_k(k)
        if k and self.group.rank0.drafter is None:
            raise ConfigError("num_draft_tokens > 0 but no drafter is loaded")
        if req.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer (none found beside the target engine)")
        need = len(req.prompt_ids) + req.max_tokens + k + 1
        if need > self.max_seq_len:
            raise ConfigError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) + draft length ({k}) + 1 "
                              f"= {need} exceeds the engine's max_seq_len = {self.max_seq_len}")
        if not BlockAllocator(self.alloc.num_blocks).can_allocate(need):
            raise ConfigError(f"request needs {need} KV tokens but the whole KV budget is "
                              f"{self.alloc.num_blocks * self.alloc.block_size} tokens: it can never fit")
        return k

    def submit(self, req: Request, callback: Callable[[RequestOutput], None] | None = None) -> int:
        """Queue a request (thread-safe); return its id. ``callback`` gets every :class:`RequestOutput`.

        Raises ConfigError at once for a request that can never be served; a request that merely does not
        fit the free KV space now waits in the queue.
        """
        k = self.check_request(req)
        stops = set(req.stop_token_ids) if req.stop_token_ids is not None else set(self.tokenizer.stop_token_ids if self.tokenizer else ())
        detok = None
        if self.tokenizer is not None:
            from splitspec.runtime.detok import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer.decode, req.stop)
        with self._lock:
            if self.failed is not None:
                raise EngineError(f"engine is not ready: {self.failed}")
            seq = Sequence(next(self._ids), req, k, stops, detok)
            seq.stats.synthetic = self.synthetic is not None
            self.seqs[seq.id] = seq
            if callback is not None:
                self._callbacks[seq.id] = callback
        self.queue.put(seq)
        return seq.id

    def cancel(self, request_id: int, reason: str = "cancelled") -> None:
        """Cancel a request (thread-safe); its slot and KV are freed at the start of the next cycle, and its final
        event carries ``finish_reason`` ``reason`` (e.g. ``"shutdown"``) with what it generated so far."""
        with self._lock:
            seq = self.seqs.get(request_id)
            if seq is not None and not seq.cancelled:
                seq.cancelled, seq.cancel_reason = True, reason

    def _expire(self) -> None:
        """Cancel, as ``"timeout"``, every sequence past its deadline (:attr:`Request.timeout_s`)."""
        now = time.perf_counter()
        with self._lock:
            for seq in self.seqs.values():
                if seq.deadline is not None and now >= seq.deadline and not seq.cancelled:
                    seq.cancelled, seq.cancel_reason = True, "timeout"

    def fail_requests(self, message: str) -> None:
        """The engine cannot go on: end every running and queued request at once with one final error event carrying
        ``message`` (the first failure's, if called again). Thread-safe, and it does not wait for the stepping thread,
        which may be blocked in a cycle (a collective with a worker that died): events of a cycle that ends later
        are dropped, as are later calls' (nothing is left to end). Later submits raise EngineError."""
        with self._emitting:
            with self._lock:
                self.failed = self.failed or message
                callbacks, self._callbacks = self._callbacks, {}
                stats = {rid: seq.stats for rid, seq in self.seqs.items()}
            for rid, cb in callbacks.items():
                cb(RequestOutput(rid, [], "", True, "error", stats.get(rid), self.failed))

    def fail_all(self, message: str) -> None:
        """:meth:`fail_requests`, then forget the running and queued sequences: on the stepping thread, which owns them
        (:class:`~splitspec.runtime.loop.EngineLoop` calls this when a cycle fails)."""
        self.fail_requests(message)
        with self._lock:
            self.running = []
        self.queue.drain()

    def has_work(self) -> bool:
        return bool(self.queue or self.running)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    @property
    def num_active(self) -> int:
        return len(self.running)

    # ---------------------------------------------------------------- the cycle

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> RequestOutput:
        """End ``seq``: free its KV blocks and slot (its workers forget it with the next plan); its final event."""
        if seq.blocks:
            self.alloc.release(seq.blocks)
            seq.blocks = []
        if seq in self.running:
            self.running.remove(seq)
            self._finished_ids.append(seq.id)
        self.seqs.pop(seq.id, None)
        return seq.finish(reason, error)

    def _emit(self, seq: Sequence, new: list[int], accepted: int | None) -> list[RequestOutput]:
        """Append tokens up to a stop or max_tokens (:meth:`Sequence.emit`); returns the events (delta and/or finish)."""
        events, reason = seq.emit(new, accepted)
        if reason:
            events.append(self._finish(seq, reason))
        return events

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one cycle over every active sequence; return (and send to callbacks) the events it produced.

        Raises:
            EngineError: a worker died (the caller should fail the requests and stop).
        """
        events: list[RequestOutput] = []
        self._expire()
        for seq in [s for s in self.running if s.cancelled]:
            events.append(self._finish(seq, seq.cancel_reason))
        for seq in self.queue.take_cancelled():
            events.append(self._finish(seq, seq.cancel_reason))
        self.queue.admit(self.running, self.max_batch_size, self.alloc)
        events += [self._finish(seq, "busy", message) for seq, message in self.queue.expired()]
        work, budget = [], self.max_prefill_tokens
        for seq in self.running:
            if seq.decoding:
                n = len(seq.tokens)
                accept = synthetic_accept(seq.k, self.synthetic, seq.gen) if self.synthetic is not None and seq.k else None
                sp = seq.req.sampling
                sampled = draw_cycle(sp, seq.k, seq.gen) if accept is None and not sp.greedy else None
                work.append(SeqWork(seq.id, seq.blocks, "decode", n - 1, [seq.tokens[-1]], k=seq.k,
                                    extend_start=seq.extend_start, extend_tokens=seq.tokens[seq.extend_start + 1:n],
                                    keep_aux=seq.keep_aux, accept=accept, sampled=sampled))
            elif budget > 0:
                p = len(seq.req.prompt_ids)
                chunk = min(p - seq.prefilled, budget)
                budget -= chunk
                work.append(SeqWork(seq.id, seq.blocks, "prefill", seq.prefilled,
                                    seq.req.prompt_ids[seq.prefilled:seq.prefilled + chunk], final=seq.prefilled + chunk == p))
        if work:
            drafting = sum(w.kind == "decode" and w.k > 0 for w in work)  # none: the drafting placement stays
            plan = CyclePlan(work, finished=self._finished_ids, draft_tp=self._placement(drafting),
                             ahead=self._next_is_alike(work))
            switched = plan.draft_tp not in (None, self.group.draft_tp)
            self._finished_ids = []
            out = self.group.run(plan, self.on_launched)
            events += self._decide(work, out, self.group.draft_tp if drafting else 0, switched)
        with self._emitting:  # not while fail_requests ends the requests: their events from here on are dropped
            for e in events:
                cb = self._callbacks.pop(e.request_id, None) if e.finished else self._callbacks.get(e.request_id)
                if cb:
                    cb(e)
        return events

    def _next_is_alike(self, work: list[SeqWork]) -> bool:
        """Whether a cycle of ``work`` may launch the next cycle's draft ahead (``ServeConfig.draft_ahead``): every
        work drafts (its acceptance decidable on the device: greedy, synthetic or sampled, their random numbers drawn
        already), no free batch slot has a request waiting for it, and no sequence can reach max_tokens in this cycle —
        so the next cycle is expected to decode the same sequences (a stop token, a cancel or a deadline may still change
        it: the drafts are then dropped)."""
        if not self.config.draft_ahead or (self.queue and len(self.running) < self.max_batch_size):
            return False
        for w in work:
            seq = self.seqs.get(w.sid)
            if seq is None or w.kind != "decode" or not w.k or len(seq.output) + w.k + 1 >= seq.req.max_tokens:
                return False
        return True

    def _decide(self, work: list[SeqWork], out, draft_tp: int, switched: bool) -> list[RequestOutput]:
        events, row = [], 0
        emitted, accepted_pos, prefill_tokens = [], [0] * self.max_draft_len, 0
        for w in work:
            seq = self.seqs.get(w.sid)
            if w.kind == "prefill":
                prefill_tokens += len(w.tokens)
                if seq is None:
                    row += int(w.final)
                    continue
                seq.prefilled += len(w.tokens)
                if not w.final:
                    continue
                logits = out.logits[row:row + 1]
                row += 1
                sp = seq.req.sampling
                try:
                    first = (greedy_token(int(greedy_ids(logits)[0]), 0) if sp.greedy
                             else draw(target_probs(logits, sp)[0], seq.gen))
                except ValueError as e:  # NaN or inf logits: this request fails, the others go on
                    events.append(self._finish(seq, "error", f"sampling: {e}"))
                    continue
                seq.tokens.append(first)
                seq.extend_start, seq.keep_aux = 0, None
                events += self._emit(seq, [first], None)
                continue
            drafts = out.drafts.get(w.sid, [])
            logits = out.logits[row:row + len(drafts) + 1]
            best = out.greedy[row:row + len(drafts) + 1] if out.greedy is not None else None
            row += len(drafts) + 1
            if seq is None:
                continue
            seq.stats.num_cycles += 1
            seq.stats.drafted_tokens += len(drafts)
            seq.stats.draft_ms += out.draft_ms
            seq.stats.verify_ms += out.verify_ms
            try:
                if w.accept is not None and drafts:
                    a, new = verify_synthetic(logits, drafts, w.accept, best)
                elif out.sampled and w.sid in out.sampled:  # decided on the device already (a steady cycle)
                    a, new = read_decision(out.sampled[w.sid], drafts)
                else:
                    a, new = verify(logits, drafts, seq.req.sampling, w.sampled, best)
            except ValueError as e:  # NaN or inf logits: this request fails, the others go on
                events.append(self._finish(seq, "error", f"sampling: {e}"))
                continue
            n = len(seq.tokens)
            seq.tokens += new
            seq.extend_start, seq.keep_aux = n - 1, a + 1
            before = seq.emitted_in_cycles
            events += self._emit(seq, new, a)
            emitted.append(seq.emitted_in_cycles - before)
            for i in range(min(a, emitted[-1])):
                accepted_pos[i] += 1
        self.last_cycle = CycleStats(len(emitted), prefill_tokens, out.draft_ms, out.verify_ms, emitted, accepted_pos,
                                     self.alloc.used, self.alloc.num_blocks, len(self.queue), draft_tp, switched)
        if self.on_cycle:
            self.on_cycle(self.last_cycle)
        return events

    # ---------------------------------------------------------------- conveniences

    def run(self, requests: list[Request]) -> list[GenerationResult]:
        """Submit all ``requests`` at once and run cycles until every one has finished (batch mode)."""
        results: dict[int, GenerationResult] = {}
        ids = []
        for r in requests:
            ids.append(self.submit(r))
        pending = set(ids)
        toks: dict[int, list[int]] = {i: [] for i in ids}
        texts: dict[int, str] = {i: "" for i in ids}
        while pending:
            for e in self.step():
                if e.request_id not in pending:
                    continue
                toks[e.request_id] += e.token_ids
                texts[e.request_id] += e.text
                if e.finished:
                    pending.discard(e.request_id)
                    results[e.request_id] = GenerationResult(toks[e.request_id], texts[e.request_id], e.finish_reason, e.stats)
        return [results[i] for i in ids]

    def generate(self, prompt_ids: list[int], max_tokens: int, num_draft_tokens: int | None = None,
                 stop_token_ids: set[int] | None = None, on_tokens: Callable[[list[int]], None] | None = None,
                 sampling: SamplingParams | None = None, stop: list[str] | None = None) -> GenerationResult:
        """Run one request to completion (no background loop may be running).

        ``stop_token_ids`` None means the tokenizer's EOS and <|im_end|>; pass ``set()`` for none.
        Raises ConfigError for a request the engine cannot serve, EngineError if a worker dies.
        """
        req = Request(list(prompt_ids), max_tokens, sampling or SamplingParams(), num_draft_tokens, stop or [], stop_token_ids)
        if on_tokens is None:
            return self.run([req])[0]
        rid = self.submit(req)
        toks, text = [], ""
        while True:
            for e in self.step():
                if e.request_id != rid:
                    continue
                toks += e.token_ids
                text += e.text
                if e.token_ids:
                    on_tokens(e.token_ids)
                if e.finished:
                    return GenerationResult(toks, text, e.finish_reason, e.stats)
