"""Prometheus metrics of the speculative engine, exported through Triton's Python-backend metrics API.

Two halves:

- :class:`MetricsCollector` (no Triton import) gathers what the engine reports — one
  :class:`~splitspec.runtime.types.CycleStats` per cycle and the statistics of every finished request —
  under a lock, in O(1) per event, so the engine's loop thread never waits on Triton.
- :class:`TritonMetricsExporter` owns the ``pb_utils.MetricFamily`` objects and publishes what the
  collector gathered (:meth:`TritonMetricsExporter.publish`), from a thread of the model's own.
  Each metric call is an IPC round trip to the Triton process (~20 µs measured on a 2-core CPU
  machine), which is why values are aggregated between exports rather than sent per token.

Triton 2.51's Python backend supports ``COUNTER``, ``GAUGE`` and ``HISTOGRAM`` families. The
acceptance length is exported twice: per request as a native histogram
(``splitspec_acceptance_length``), and per sequence and cycle — the exact distribution of tokens
one target forward emitted — as counters labelled by that count
(``splitspec_sequence_cycles_total{emitted="n"}``), because observing a histogram once per
sequence per cycle would cost one IPC each. Time metrics are in milliseconds (``_ms``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

#: Buckets (ms) of the per-cycle draft / verify time histograms.
CYCLE_MS_BUCKETS = [0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0]
#: Buckets (ms) of the per-request time-to-first-token and queueing histograms.
REQUEST_MS_BUCKETS = [1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0]
#: Buckets of the decode-batch-size histogram (sequences verified in one cycle).
BATCH_BUCKETS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]


def acceptance_buckets(max_draft_len: int) -> list[float]:
    """Histogram buckets for a request's acceptance length: 1 .. max_draft_len + 1, halves up to 4."""
    top = max_draft_len + 1
    fine = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0]
    return [b for b in fine if b <= top] + [float(n) for n in range(5, top + 1)]


@dataclass
class Pending:
    """What happened since the last export (see :meth:`MetricsCollector.drain`)."""

    cycles: int = 0
    verified_sequences: int = 0  # sum over cycles of sequences that decoded (verify rows groups)
    prefill_tokens: int = 0
    emitted_tokens: int = 0
    emitted_hist: dict[int, int] = field(default_factory=dict)  # tokens one forward emitted -> count
    accepted_by_position: list[int] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    verify_ms: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests
    acceptance_lengths: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    draft_cycles: dict[int, int] = field(default_factory=dict)  # draft_tp -> cycles it drafted
    placement_switches: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # refusal reason -> requests

    def empty(self) -> bool:
        return not (self.cycles or self.finished or self.refused)


class MetricsCollector:
    """Thread-safe accumulator of engine events between two exports.

    Lists of per-cycle times are capped at ``max_samples`` per export interval (the oldest kept),
    so a stalled exporter cannot make them grow without bound; counters are never dropped.
    """

    def __init__(self, max_samples: int = 4096):
        self._lock = threading.Lock()
        self._p = Pending()
        self.max_samples = max_samples
        self.cycles_seen = 0  # cycles since start (never drained)

    def on_cycle(self, cs) -> None:
        """Record one engine cycle (a :class:`splitspec.runtime.types.CycleStats`)."""
        with self._lock:
            p = self._p
            p.cycles += 1
            self.cycles_seen += 1
            p.verified_sequences += cs.decode_seqs
            p.prefill_tokens += cs.prefill_tokens
            p.emitted_tokens += sum(cs.emitted)
            for n in cs.emitted:
                p.emitted_hist[n] = p.emitted_hist.get(n, 0) + 1
            if len(p.accepted_by_position) < len(cs.accepted_by_position):
                p.accepted_by_position += [0] * (len(cs.accepted_by_position) - len(p.accepted_by_position))
            for i, a in enumerate(cs.accepted_by_position):
                p.accepted_by_position[i] += a
            if cs.draft_tp:
                p.draft_cycles[cs.draft_tp] = p.draft_cycles.get(cs.draft_tp, 0) + 1
            p.placement_switches += int(cs.switched)
            if len(p.verify_ms) < self.max_samples:
                if cs.decode_seqs:
                    p.draft_ms.append(cs.draft_ms)
                p.verify_ms.append(cs.verify_ms)
                p.batch_sizes.append(cs.decode_seqs)

    def on_finished(self, finish_reason: str, stats=None) -> None:
        """Record a finished request (``stats``: its :class:`splitspec.runtime.types.RequestStats`, if any)."""
        with self._lock:
            p = self._p
            p.finished[finish_reason] = p.finished.get(finish_reason, 0) + 1
            if stats is not None and finish_reason in ("length", "stop") and len(p.ttft_ms) < self.max_samples:
                if stats.num_cycles:
                    p.acceptance_lengths.append(float(stats.acceptance_length))
                if stats.ttft_ms:
                    p.ttft_ms.append(float(stats.ttft_ms))
                p.queue_ms.append(float(stats.queue_ms))

    def on_refused(self, reason: str) -> None:
        """Record a request refused as "server busy" (``reason``: one of :data:`REFUSAL_REASONS`)."""
        with self._lock:
            self._p.refused[reason] = self._p.refused.get(reason, 0) + 1

    def drain(self) -> Pending:
        """Return everything recorded since the last call and start afresh."""
        with self._lock:
            p, self._p = self._p, Pending()
        return p


#: (name, kind, description) of the families; kinds are pb_utils.MetricFamily attribute names.
FAMILIES = {
    "acceptance_length": ("splitspec_acceptance_length", "HISTOGRAM",
                          "Acceptance length of finished requests: tokens emitted per target verify forward"),
    "sequence_cycles": ("splitspec_sequence_cycles_total", "COUNTER",
                        "Decoding sequence-cycles by the number of tokens the target forward emitted "
                        "(label emitted): the exact per-cycle acceptance-length distribution"),
    "accepted": ("splitspec_accepted_draft_tokens_total", "COUNTER",
                 "Draft tokens accepted and emitted, by draft position (1 = first draft token)"),
    "verified": ("splitspec_verified_sequences_total", "COUNTER",
                 "Sequences verified, summed over cycles (acceptance rate at position i = "
                 "accepted_draft_tokens_total{position=i} / verified_sequences_total when all requests use the same k)"),
    "cycles": ("splitspec_cycles_total", "COUNTER", "Engine cycles (one batched draft phase + one batched verify forward)"),
    "draft_cycles": ("splitspec_draft_cycles_total", "COUNTER",
                     "Cycles that drafted, by the draft placement that drafted them (label draft_tp: 1 = split, N = sharded)"),
    "switches": ("splitspec_placement_switches_total", "COUNTER",
                 "Changes of draft placement (tuning.json per batch bucket; each moves the drafting sequences' drafter K/V)"),
    "output_tokens": ("splitspec_output_tokens_total", "COUNTER", "Tokens emitted by verify forwards"),
    "prefill_tokens": ("splitspec_prefill_tokens_total", "COUNTER", "Prompt tokens prefilled"),
    "requests": ("splitspec_requests_total", "COUNTER",
                 "Finished requests by finish_reason (length, stop, cancelled, timeout, shutdown, error)"),
    "refused": ("splitspec_refused_requests_total", "COUNTER",
                "Requests refused as server busy (HTTP 503 / UNAVAILABLE), by reason: queue_full (max_batch_size "
                "decoding and max_queue_len waiting when it arrived), queue_timeout (waited longer than max_queue_s)"),
    "draft_ms": ("splitspec_draft_ms", "HISTOGRAM", "Draft phase time per cycle (ms; on the GPU clock with draft-ahead)"),
    "verify_ms": ("splitspec_verify_ms", "HISTOGRAM", "Verify forward time per cycle, prefill chunks included (ms; on the GPU clock with draft-ahead)"),
    "batch": ("splitspec_cycle_decode_sequences", "HISTOGRAM", "Sequences decoding together in one cycle"),
    "ttft_ms": ("splitspec_request_ttft_ms", "HISTOGRAM", "Engine time from submit to first token (ms)"),
    "queue_ms": ("splitspec_request_queue_ms", "HISTOGRAM", "Engine time from submit to admission into the batch (ms)"),
    "active": ("splitspec_active_sequences", "GAUGE", "Sequences admitted to the running batch (prefilling or decoding)"),
    "queued": ("splitspec_queued_requests", "GAUGE", "Requests waiting for a batch slot or KV space"),
    "kv_used": ("splitspec_kv_used_blocks", "GAUGE", "KV-cache blocks in use"),
    "kv_total": ("splitspec_kv_total_blocks", "GAUGE", "KV-cache blocks in the budget"),
    "kv_usage": ("splitspec_kv_usage_ratio", "GAUGE", "Fraction of the KV-cache budget in use (0..1)"),
    "healthy": ("splitspec_engine_healthy", "GAUGE", "1 while the engine serves, 0 after a worker process died"),
}

FINISH_REASONS = ("length", "stop", "cancelled", "timeout", "shutdown", "error")
REFUSAL_REASONS = ("queue_full", "queue_timeout")


class TritonMetricsExporter:
    """The Prometheus families of one ``spec_decode`` instance, created through ``pb_utils``.

    Args:
        pb_utils: the ``triton_python_backend_utils`` module (passed in: this module stays importable
            without Triton).
        model: value of the ``model`` label on every metric.
        max_draft_len: the engine's largest k (sizes the per-position counters and buckets).
    """

    def __init__(self, pb_utils, model: str, max_draft_len: int):
        self.labels = {"model": model}
        self.max_draft_len = max_draft_len
        MF = pb_utils.MetricFamily
        # the families must outlive their metrics: keep references to both
        self.families = {key: MF(name=name, description=desc, kind=getattr(MF, kind))
                         for key, (name, kind, desc) in FAMILIES.items()}
        f, lab = self.families, self.labels

        def hist(key, buckets):
            return f[key].Metric(labels=lab, buckets=buckets)

        self.acceptance = hist("acceptance_length", acceptance_buckets(max_draft_len))
        self.draft_ms = hist("draft_ms", CYCLE_MS_BUCKETS)
        self.verify_ms = hist("verify_ms", CYCLE_MS_BUCKETS)
        self.batch = hist("batch", BATCH_BUCKETS)
        self.ttft_ms = hist("ttft_ms", REQUEST_MS_BUCKETS)
        self.queue_ms = hist("queue_ms", REQUEST_MS_BUCKETS)
        self.sequence_cycles = {n: f["sequence_cycles"].Metric(labels={**lab, "emitted": str(n)})
                                for n in range(1, max_draft_len + 2)}
        self.accepted = {i: f["accepted"].Metric(labels={**lab, "position": str(i + 1)}) for i in range(max_draft_len)}
        self.requests = {r: f["requests"].Metric(labels={**lab, "finish_reason": r}) for r in FINISH_REASONS}
        self.refused = {r: f["refused"].Metric(labels={**lab, "reason": r}) for r in REFUSAL_REASONS}
        self.draft_cycles: dict[int, object] = {}  # by draft_tp, made when first seen
        self.scalars = {key: f[key].Metric(labels=lab) for key in
                        ("verified", "cycles", "switches", "output_tokens", "prefill_tokens",
                         "active", "queued", "kv_used", "kv_total", "kv_usage", "healthy")}
        self.scalars["healthy"].set(1.0)

    def publish(self, p: Pending, gauges: dict[str, float]) -> None:
        """Send one interval's events and the current gauge values (keys: active, queued, kv_used,
        kv_total, kv_usage, healthy) to Triton."""
        s = self.scalars
        if p.cycles:
            s["cycles"].increment(float(p.cycles))
            s["verified"].increment(float(p.verified_sequences))
            if p.emitted_tokens:
                s["output_tokens"].increment(float(p.emitted_tokens))
            if p.prefill_tokens:
                s["prefill_tokens"].increment(float(p.prefill_tokens))
            for n, count in p.emitted_hist.items():
                m = self.sequence_cycles.get(n)
                if m is not None and count:
                    m.increment(float(count))
            for i, a in enumerate(p.accepted_by_position[: self.max_draft_len]):
                if a:
                    self.accepted[i].increment(float(a))
            for dtp, count in p.draft_cycles.items():
                if dtp not in self.draft_cycles:
                    self.draft_cycles[dtp] = self.families["draft_cycles"].Metric(labels={**self.labels, "draft_tp": str(dtp)})
                self.draft_cycles[dtp].increment(float(count))
            if p.placement_switches:
                s["switches"].increment(float(p.placement_switches))
            for v in p.draft_ms:
                self.draft_ms.observe(v)
            for v in p.verify_ms:
                self.verify_ms.observe(v)
            for v in p.batch_sizes:
                if v:
                    self.batch.observe(float(v))
        for reason, count in p.finished.items():
            m = self.requests.get(reason) or self.requests["error"]
            m.increment(float(count))
        for reason, count in p.refused.items():
            self.refused[reason].increment(float(count))
        for v in p.acceptance_lengths:
            self.acceptance.observe(v)
        for v in p.ttft_ms:
            self.ttft_ms.observe(v)
        for v in p.queue_ms:
            self.queue_ms.observe(v)
        for key, value in gauges.items():
            if key in s:
                s[key].set(float(value))

    def close(self) -> None:
        """Drop the metrics, then their families (Triton requires this order)."""
        for name in ("acceptance", "draft_ms", "verify_ms", "batch", "ttft_ms", "queue_ms"):
            setattr(self, name, None)
        self.sequence_cycles = self.accepted = self.requests = self.refused = self.scalars = self.draft_cycles = {}
        self.families = {}


def parse_prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """Parse Prometheus text exposition into ``{(name, frozenset(labels.items())): value}``
    (comments skipped). Enough for tests and the benchmark script; not a full parser."""
    out: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            head, value = line.rsplit(" ", 1)
            v = float(value)
        except ValueError:
            continue
        labels: dict[str, str] = {}
        name = head
        if "{" in head and head.endswith("}"):
            name, body = head[:-1].split("{", 1)
            for part in _split_labels(body):
                k, _, val = part.partition("=")
                labels[k.strip()] = val.strip().strip('"')
        out[(name, frozenset(labels.items()))] = v
    return out


def _split_labels(body: str) -> list[str]:
    parts, cur, quoted = [], [], False
    for ch in body:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p for p in parts if p.strip()]


def metric_value(parsed: dict, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0.0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in parsed.items() if n == name and want <= set(ls))
