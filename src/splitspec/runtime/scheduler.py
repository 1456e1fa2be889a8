"""Continuous-batching speculative decoding over the target group and the EAGLE-3 drafter.

A *cycle* (DESIGN.md, "Speculation, in numbers") runs one batched draft phase — the drafter extends over the
tokens each sequence accepted last cycle, then takes k − 1 more steps — and one batched target forward that
verifies every decoding sequence's k + 1 positions and prefills chunks of newly admitted prompts. Sequences
join and leave between cycles. Acceptance is decided here, once, on the leader (:mod:`splitspec.runtime.sampling`):
greedy output is token-for-token identical to target-only greedy decoding; sampled output has the target's
distribution.

Indexing: with n known tokens x_0..x_{n−1}, the target's KV cache and aux states cover positions 0..n−2;
drafter row j pairs aux(j) with token x_{j+1} at rotary position j and predicts x_{j+2}.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from splitspec.engine.group import Group
from splitspec.engine.engine_files import read_engine_meta
from splitspec.engine.plan import CyclePlan, EngineError, SeqWork
from splitspec.errors import ConfigError
from splitspec.engine.kv import BlockAllocator
from splitspec.runtime.sampling import SamplingParams, target_probs, verify, verify_synthetic
from splitspec.settings import ServeConfig


@dataclass
class Request:
    """A generation request.

    Attributes:
        prompt_ids: prompt token ids.
        max_tokens: at most this many tokens are generated (≥ 1).
        sampling: temperature / top-p / top-k / seed.
        num_draft_tokens: draft tokens per cycle (k); None = the deployment's default; 0 = no speculation.
        stop: stop strings (need a tokenizer); output ends right before the first one.
        stop_token_ids: ids that end generation (they are emitted); None = the tokenizer's EOS / <|im_end|>.
    """

    prompt_ids: list[int]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] | None = None


@dataclass
class RequestStats:
    """Per-request speculation statistics (counting only emitted tokens).

    acceptance_length: emitted tokens per target verify forward (1.0 without speculation).
    accepted_per_position[i]: cycles whose draft i+1 was accepted and emitted.
    draft_ms / verify_ms: summed wall time of the cycles this request took part in.
    ttft_ms: submit → first token; e2e_ms: submit → finish; queue_ms: submit → admission.
    """

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cycles: int = 0
    acceptance_length: float = 1.0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    queue_ms: float = 0.0
    synthetic: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / (self.e2e_ms / 1e3) if self.e2e_ms else 0.0


@dataclass
class RequestOutput:
    """One event of a request: tokens (and text, with a tokenizer) emitted in one cycle, or the end.

    ``error`` is set (and ``finished`` True) when the request failed; ``stats`` is set when finished.
    ``finish_reason``: "stop", "length", "cancelled", "error"; "rejected" for a request the engine process refused
    (:mod:`splitspec.serving.engine_process`; ``error`` says why, no ``stats``).
    """

    request_id: int
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    """A finished request (see :meth:`SpeculativeEngine.generate`)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats

    # Shortcuts used by callers of the single-request API.
    @property
    def acceptance_length(self) -> float:
        return self.stats.acceptance_length

    @property
    def accepted_per_position(self) -> list[int]:
        return self.stats.accepted_per_position

    @property
    def num_cycles(self) -> int:
        return self.stats.num_cycles


@dataclass
class CycleStats:
    """One cycle: sequences decoding / prefilling, draft and verify time (ms), tokens emitted per decoding
    sequence, accepted drafts by position, KV blocks used/total, queued requests, the placement that drafted
    (``draft_tp``; 0: nothing drafted) and whether it took over from the other one this cycle (``switched``)."""

    decode_seqs: int
    prefill_tokens: int
    draft_ms: float
    verify_ms: float
    emitted: list[int]
    accepted_by_position: list[int]
    kv_used_blocks: int
    kv_total_blocks: int
    queued: int
    draft_tp: int = 0
    switched: bool = False


class _Sequence:
    def __init__(self, sid: int, req: Request, k: int, stops: set[int], detok):
        self.id, self.req, self.k = sid, req, k
        self.stops = stops
        self.tokens = list(req.prompt_ids)
        self.prefilled = 0
        self.blocks: list[int] = []
        self.output: list[int] = []
        self.extend_start, self.keep_aux = 0, None
        self.gen = torch.Generator()
        if req.sampling.seed is not None:
            self.gen.manual_seed(req.sampling.seed)
        else:
            self.gen.seed()
        self.detok = detok
        self.stats = RequestStats(num_prompt_tokens=len(req.prompt_ids), accepted_per_position=[0] * k)
        self.t_submit = time.perf_counter()
        self.emitted_in_cycles = 0
        self.text = ""
        self.finish_reason: str | None = None
        self.cancelled = False

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.req.prompt_ids)

    def need_tokens(self) -> int:
        return len(self.req.prompt_ids) + self.req.max_tokens + self.k + 1


class SpeculativeEngine:
    """Continuous-batching EAGLE-3 speculation over a target TP group and a drafter (TP1 or TP-N).

    Single-threaded core: :meth:`submit` (thread-safe) queues requests, :meth:`step` runs one cycle.
    :meth:`generate` runs one request to completion; :class:`EngineLoop` runs cycles in a background thread.

    The deployment's settings are the group's :class:`~splitspec.settings.ServeConfig` (``group.config``):
    num_draft_tokens (default k per request; 0 disables speculation; None: 4), max_batch_size (sequences decoded at
    once; None: the engine's), max_prefill_tokens (prompt tokens prefilled per cycle) and synthetic_acceptance
    (benchmark only — per-position acceptance probabilities; outputs are then NOT the target's and every result
    is labelled ``synthetic``). ``tokenizer``: for stop strings and text (None: token ids only).
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
        self.waiting: collections.deque[_Sequence] = collections.deque()
        self.running: list[_Sequence] = []
        self.seqs: dict[int, _Sequence] = {}
        self._finished_ids: list[int] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[RequestOutput], None]] = {}
        self.k_by_batch: dict[int, int] = {}
        self.draft_tp_by_batch: dict[int, int] = {}  # several placements loaded: which drafts per batch bucket
        self.switch_after = SWITCH_AFTER_CYCLES
        self._wanting_other = 0  # consecutive drafting cycles whose bucket wanted the other placement
        self.on_cycle: Callable[[CycleStats], None] | None = None
        # called on the stepping thread once a cycle's GPU work is queued, before the host waits for it: host work
        # there (the engine process sends the previous cycle's events) overlaps the GPU's
        self.on_launched: Callable[[], None] | None = None
        self.last_cycle: CycleStats | None = None

    @classmethod
    def load(cls, cfg: ServeConfig, tokenizer_dir: Path | None = None) -> "SpeculativeEngine":
        """Start the target group, load the drafter, and return the engine for the deployment ``cfg``.

        ``cfg.draft_tp`` / ``cfg.num_draft_tokens`` left None take the choice ``splitspec tune`` wrote to
        ``engines_dir/tuning.json`` (placement and k per batch-size bucket: where the buckets' placements
        differ, both are loaded and each cycle drafts with its bucket's), else draft_tp 1 and k 4. With
        ``draft_tp`` given, k follows tuning.json only where every bucket was tuned for that placement.
        ``tokenizer_dir``: folder of tokenizer files for stop strings and text (default ``engines_dir/target``).
        """
        engines_dir, draft_tp, num_draft_tokens = cfg.engines_dir, cfg.draft_tp, cfg.num_draft_tokens
        tuning = read_tuning(engines_dir) if draft_tp is None or num_draft_tokens is None else None  # not read when unused
        tuned = {int(b): int(d) for b, d in tuning["draft_tp_by_batch"].items()} if tuning else {}
        # with both, the smallest bucket's placement drafts first
        placements = (draft_tp,) if draft_tp is not None else tuple(sorted(set(tuned.values()), key=lambda d: (d != tuned[min(tuned)], d))) or (1,)
        tok = None
        tdir = Path(tokenizer_dir) if tokenizer_dir else engines_dir / "target"
        if (tdir / "tokenizer.json").exists():
            from splitspec.runtime.tokenizer import ChatTokenizer

            tok = ChatTokenizer.from_dir(tdir)
        group = Group(cfg, placements)
        try:
            eng = cls(group, tok)
            if num_draft_tokens is None and tuning and set(tuned.values()) <= set(placements):
                eng.k_by_batch = {int(b): int(k) for b, k in tuning["k_by_batch"].items()}
            if len(placements) > 1:
                eng.draft_tp_by_batch = tuned
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
        return _by_bucket(self.k_by_batch, len(self.running) + len(self.waiting) + 1)

    def draft_tp_for(self, batch: int) -> int:
        """The placement wanted for a cycle of ``batch`` drafting sequences: the tuned one of its bucket where
        several are loaded, else the one loaded."""
        return _by_bucket(self.draft_tp_by_batch, batch) if self.draft_tp_by_batch else self.group.draft_tp

    def _placement(self, drafting: int) -> int | None:
        """The placement this cycle drafts with: the one drafting so far until ``switch_after`` consecutive
        drafting cycles have wanted the other (:meth:`draft_tp_for`), so that a batch hovering at a bucket's
        edge does not pay a switch every cycle. None (no change) when nothing drafts."""
        if not drafting:
            return None
        now, want = self.group.draft_tp, self.draft_tp_for(drafting)
        self._wanting_other = self._wanting_other + 1 if want != now else 0
        if self._wanting_other < max(1, self.switch_after):
            return now
        self._wanting_other = 0
        return want

    def _check_k(self, k: int) -> None:
        if not 0 <= k <= self.max_draft_len:
            raise ConfigError(f"num_draft_tokens = {k}, expected 0..{self.max_draft_len} (engine max_draft_len)")

    def check_request(self, req: Request) -> int:
        """Validate a request against the engine's limits; return its k.

        Raises:
            ConfigError: empty or out-of-vocabulary prompt, bad max_tokens / sampling / k / stop_token_ids, stop
                strings without a tokenizer, or prompt + max_tokens + k + 1 beyond max_seq_len or the KV budget.
        """
        k = self.default_k() if req.num_draft_tokens is None else req.num_draft_tokens
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if not isinstance(req.prompt_ids, (list, tuple)) or not all(is_int(t) for t in req.prompt_ids):
            raise ConfigError("prompt_ids must be a list of integer token ids")
        if not is_int(k):
            raise ConfigError(f"num_draft_tokens = {k!r}, expected an integer")
        if not isinstance(req.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in req.stop):
            raise ConfigError(f"stop = {req.stop!r}, expected a list of non-empty strings")
        if len(req.stop) > 16 or any(len(x) > 256 for x in req.stop):
            raise ConfigError("stop: at most 16 strings of at most 256 characters")
        if req.stop_token_ids is not None and (not isinstance(req.stop_token_ids, (set, frozenset, list, tuple))
                                               or not all(is_int(t) for t in req.stop_token_ids)):
            raise ConfigError(f"stop_token_ids = {req.stop_token_ids!r}, expected a set of integer token ids (or None)")
        if not isinstance(req.sampling, SamplingParams):
            raise ConfigError("sampling must be a SamplingParams")
        if not req.prompt_ids:
            raise ConfigError("prompt is empty: at least one token is needed")
        bad = [(i, t) for i, t in enumerate(req.prompt_ids) if not 0 <= t < self.vocab_size]
        if bad:
            where = ", ".join(f"{t} at position {i}" for i, t in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise ConfigError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {where}")
        if not is_int(req.max_tokens) or req.max_tokens < 1:
            raise ConfigError(f"max_tokens = {req.max_tokens!r}, expected an integer ≥ 1")
        self._check_k(k)
        if k and self.group.rank0.drafter is None:
            raise ConfigError("num_draft_tokens > 0 but no drafter is loaded")
        req.sampling.check()
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
            seq = _Sequence(next(self._ids), req, k, stops, detok)
            seq.stats.synthetic = self.synthetic is not None
            self.seqs[seq.id] = seq
            if callback is not None:
                self._callbacks[seq.id] = callback
            self.waiting.append(seq)
        return seq.id

    def cancel(self, request_id: int) -> None:
        """Cancel a request (thread-safe); its slot and KV are freed at the start of the next cycle."""
        with self._lock:
            seq = self.seqs.get(request_id)
            if seq is not None:
                seq.cancelled = True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued(self) -> int:
        return len(self.waiting)

    @property
    def num_active(self) -> int:
        return len(self.running)

    # ---------------------------------------------------------------- the cycle

    def _finish(self, seq: _Sequence, reason: str, error: str | None = None) -> RequestOutput:
        seq.finish_reason = reason
        now = time.perf_counter()
        s = seq.stats
        s.e2e_ms = (now - seq.t_submit) * 1e3
        s.num_output_tokens = len(seq.output)
        s.acceptance_length = seq.emitted_in_cycles / s.num_cycles if s.num_cycles else 1.0
        if seq.blocks:
            self.alloc.release(seq.blocks)
            seq.blocks = []
        if seq in self.running:
            self.running.remove(seq)
            self._finished_ids.append(seq.id)
        self.seqs.pop(seq.id, None)
        tail = seq.detok.add([], final=True) if (seq.detok and not error and reason != "stop_string") else ""
        seq.text += tail
        return RequestOutput(seq.id, [], tail, True, reason, s, error)

    def _emit(self, seq: _Sequence, new: list[int], accepted: int | None) -> list[RequestOutput]:
        """Append tokens up to a stop or max_tokens; returns the events (delta and/or finish)."""
        take, reason = [], None
        for t in new:
            take.append(t)
            if t in seq.stops:
                reason = "stop"
                break
            if len(seq.output) + len(take) >= seq.req.max_tokens:
                reason = "length"
                break
        text = ""
        if seq.detok is not None:
            text = seq.detok.add(take)
            if seq.detok.stopped:
                take = take[: seq.detok.tokens_to_stop - len(seq.output)]
                reason = "stop_string"
        seq.output += take
        seq.text += text
        if not seq.stats.ttft_ms and take:
            seq.stats.ttft_ms = (time.perf_counter() - seq.t_submit) * 1e3
        if accepted is not None:
            seq.emitted_in_cycles += len(take)
            for i in range(min(accepted, len(take))):
                seq.stats.accepted_per_position[i] += 1
        events = [RequestOutput(seq.id, take, text)] if take or text else []
        if reason:
            events.append(self._finish(seq, "stop" if reason == "stop_string" else reason))
        return events

    def _admit(self) -> None:
        with self._lock:
            for seq in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(seq)
            while self.waiting and len(self.running) < self.max_batch_size and self.alloc.can_allocate(self.waiting[0].need_tokens()):
                seq = self.waiting.popleft()
                seq.blocks = self.alloc.allocate(seq.need_tokens())
                seq.stats.queue_ms = (time.perf_counter() - seq.t_submit) * 1e3
                self.running.append(seq)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one cycle over every active sequence; return (and send to callbacks) the events it produced.

        Raises:
            EngineError: a worker died (the caller should fail the requests and stop).
        """
        events: list[RequestOutput] = []
        for seq in [s for s in self.running if s.cancelled]:
            events.append(self._finish(seq, "cancelled"))
        with self._lock:
            cancelled_waiting = [s for s in self.waiting if s.cancelled]
        for seq in cancelled_waiting:
            events.append(self._finish(seq, "cancelled"))
        self._admit()
        work, budget = [], self.max_prefill_tokens
        for seq in self.running:
            if seq.decoding:
                n = len(seq.tokens)
                work.append(SeqWork(seq.id, seq.blocks, "decode", n - 1, [seq.tokens[-1]], k=seq.k,
                                    extend_start=seq.extend_start, extend_tokens=seq.tokens[seq.extend_start + 1:n],
                                    keep_aux=seq.keep_aux))
            elif budget > 0:
                p = len(seq.req.prompt_ids)
                chunk = min(p - seq.prefilled, budget)
                budget -= chunk
                work.append(SeqWork(seq.id, seq.blocks, "prefill", seq.prefilled,
                                    seq.req.prompt_ids[seq.prefilled:seq.prefilled + chunk], final=seq.prefilled + chunk == p))
        if work:
            drafting = sum(w.kind == "decode" and w.k > 0 for w in work)  # none: the drafting placement stays
            plan = CyclePlan(work, finished=self._finished_ids, draft_tp=self._placement(drafting))
            switched = plan.draft_tp not in (None, self.group.draft_tp)
            self._finished_ids = []
            out = self.group.run(plan, self.on_launched)
            events += self._decide(work, out, self.group.draft_tp if drafting else 0, switched)
        for e in events:
            cb = self._callbacks.pop(e.request_id, None) if e.finished else self._callbacks.get(e.request_id)
            if cb:
                cb(e)
        return events

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
                first = int(logits[0].argmax()) if sp.greedy else int(torch.multinomial(target_probs(logits.cpu(), sp)[0], 1, generator=seq.gen))
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
            seq.stats.draft_ms += out.draft_ms
            seq.stats.verify_ms += out.verify_ms
            if self.synthetic is not None and drafts:
                a, new = verify_synthetic(logits, drafts, self.synthetic, seq.gen)
            else:
                a, new = verify(logits, drafts, seq.req.sampling, seq.gen, best)
            n = len(seq.tokens)
            seq.tokens += new
            seq.extend_start, seq.keep_aux = n - 1, a + 1
            before = seq.emitted_in_cycles
            events += self._emit(seq, new, a)
            emitted.append(seq.emitted_in_cycles - before)
            for i in range(min(a, emitted[-1])):
                accepted_pos[i] += 1
        self.last_cycle = CycleStats(len(emitted), prefill_tokens, out.draft_ms, out.verify_ms, emitted, accepted_pos,
                                     self.alloc.used, self.alloc.num_blocks, len(self.waiting), draft_tp, switched)
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


#: Consecutive drafting cycles that must want the other placement before it drafts: on 2 × H200 a switch costs
#: 1.7 ms at batch 16 and the better placement there saves 0.6–1.0 ms per cycle (docs/performance.md).
SWITCH_AFTER_CYCLES = 3


def _by_bucket(table: dict[int, int], batch: int) -> int:
    """``table``'s value for the smallest bucket ≥ ``batch``, or the largest bucket's."""
    fitting = [b for b in sorted(table) if b >= batch]
    return table[fitting[0] if fitting else max(table)]


def read_tuning(engines_dir: Path) -> dict | None:
    """``engines_dir/tuning.json`` written by ``splitspec tune``, or None if there is none.

    Fields: ``k_by_batch`` {"batch": k} and either ``draft_tp_by_batch`` {"batch": draft_tp} (the same
    buckets) or ``draft_tp`` (one placement for every bucket); the result always has
    ``draft_tp_by_batch``. Raises ConfigError naming the file when a field is missing or of the wrong
    type, a k exceeds the engines' max_draft_len, or a draft_tp is neither 1 nor the target's tp_size
    (``target/engine.json``)."""
    path = Path(engines_dir) / "tuning.json"
    if not path.exists() and not path.is_symlink():  # a dangling link is refused by read_json, not taken for none
        return None
    from splitspec.files import read_json

    t = read_json(path)
    if not isinstance(t, dict) or "k_by_batch" not in t or ("draft_tp" in t) == ("draft_tp_by_batch" in t):
        raise ConfigError(f"{path}: expected fields 'k_by_batch' and one of 'draft_tp_by_batch' or 'draft_tp'")
    ok = lambda v, lo: isinstance(v, int) and not isinstance(v, bool) and v >= lo  # noqa: E731
    kb = t["k_by_batch"]
    canonical = lambda b: (isinstance(b, str) and b.isascii() and b.isdigit() and len(b) <= 9  # noqa: E731
                           and b == str(int(b)) and int(b) >= 1)
    if not isinstance(kb, dict) or not kb or not all(canonical(b) and ok(k, 0) for b, k in kb.items()):
        raise ConfigError(f"{path}: k_by_batch = {repr(kb)[:200]}, expected {{\"batch ≥ 1\" (decimal, no leading zeros): k ≥ 0, ...}}")
    if "draft_tp_by_batch" in t:
        db = t["draft_tp_by_batch"]
        if not isinstance(db, dict) or set(db) != set(kb) or not all(ok(d, 1) for d in db.values()):
            raise ConfigError(f"{path}: draft_tp_by_batch = {repr(db)[:200]}, expected a positive draft_tp for each bucket of k_by_batch {sorted(kb)}")
    elif not ok(t["draft_tp"], 1):
        raise ConfigError(f"{path}: draft_tp = {t['draft_tp']!r}, expected a positive integer")
    else:
        t["draft_tp_by_batch"] = dict.fromkeys(kb, t["draft_tp"])
    target = Path(engines_dir) / "target"
    if (target / "engine.json").exists():
        meta = read_engine_meta(target, "target")
        tp, max_k = int(meta["mapping"]["tp_size"]), int(meta["limits"]["max_draft_len"])
        bad = {b: d for b, d in t["draft_tp_by_batch"].items() if d not in (1, tp)}
        if bad:
            field = "draft_tp_by_batch" if "draft_tp" not in t else "draft_tp"
            raise ConfigError(f"{path}: {field} {bad if field == 'draft_tp_by_batch' else t['draft_tp']}: expected 1 or the target's tp_size {tp}")
        if max(kb.values()) > max_k:
            raise ConfigError(f"{path}: k_by_batch = {kb!r} exceeds the engines' max_draft_len {max_k}")
    return t


class EngineLoop:
    """Runs :meth:`SpeculativeEngine.step` in a background thread; :meth:`submit` and :meth:`cancel` are
    thread-safe. Callbacks run on the loop thread. If the engine fails (a worker died), every active and
    queued request gets an error event, :attr:`healthy` turns False, and later submits raise EngineError.

    ``after_step``: called on the loop thread after every cycle (after its callbacks), e.g. to pass the
    cycle's events on in one message.
    """

    def __init__(self, engine: SpeculativeEngine, after_step: Callable[[], None] | None = None):
        self.engine = engine
        self.after_step = after_step
        self.healthy, self.error = True, None
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="splitspec-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, req: Request, callback: Callable[[RequestOutput], None]) -> int:
        """Queue ``req``; ``callback`` receives its events. Raises ConfigError / EngineError at once."""
        if not self.healthy:
            raise EngineError(f"engine is not ready: {self.error}")
        with self._wake:
            rid = self.engine.submit(req, callback)
            self._wake.notify()
        return rid

    def cancel(self, request_id: int) -> None:
        self.engine.cancel(request_id)
        with self._wake:
            self._wake.notify()

    def _run(self) -> None:
        device = self.engine.group.devices[0]
        if device.startswith("cuda"):  # a new thread's current device is GPU 0, whatever the loading thread set
            torch.cuda.set_device(device)
        while True:
            with self._wake:
                while not self._stop and not self.engine.has_work():
                    self._wake.wait()
                if self._stop:
                    return
            try:
                self.engine.step()
                if self.after_step is not None:
                    self.after_step()
            except Exception as e:  # a dead worker or broken group: fail everything, stop serving
                self.healthy, self.error = False, f"{type(e).__name__}: {e}"
                self._fail_all(self.error)
                return

    def _fail_all(self, message: str) -> None:
        eng = self.engine
        with eng._lock:
            seqs = list(eng.running) + list(eng.waiting)
            eng.running, eng.waiting = [], collections.deque()
        for seq in seqs:
            cb = eng._callbacks.pop(seq.id, None)
            if cb:
                cb(RequestOutput(seq.id, [], "", True, "error", seq.stats, message))

    def stop(self) -> None:
        """Stop the loop thread (the engine stays open; call ``engine.close()``)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout=30)
