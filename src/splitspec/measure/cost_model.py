"""Cost model of a speculative-decoding cycle, fitted from measurements and carried to Kimi-K2 scale.

Cycle time (its errors against measured cycles: docs/performance.md, "How close is the cost model?"):

    t_cycle(B, k, L) = f0 + f1·B + f_token·T + t_draft(placement, B, k) + L · (m0 + m_expert·E(T) + m_token·T)
    t_draft = [k > 0]·(e0 + e1·B) + (k − 1)⁺·(s0 + s1·B)      (one extend forward, then k − 1 steps)

with T = B·(k+1) verified tokens and L MoE layers (the dense layer, embedding, lm_head, scheduling and the one
host copy are in the fixed and per-token terms).

E(T) = distinct routed experts activated by T tokens (at batch 1 an MoE verify of k+1 tokens reads up to
8(k+1) experts per layer — the model counts experts, not tokens). Tokens per second =
B · acceptance_length(k) / t_cycle. :func:`fit_cycle_model` fits the coefficients by least squares on
measured cycles and reports in-sample and leave-one-out errors; :class:`KimiScale` extrapolates to the
published model's 61 layers at TP8 from bytes read per layer, HBM bandwidth and all-reduce latency, or
(:meth:`KimiScale.from_depth_fit`) from :func:`fit_depth`'s lines: each (batch, k, placement) of one rank measured
at a few short depths of the same engine form (``bench/depth_fit.py``), carried to 61 layers along its depth.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

KIMI_EXPERTS, KIMI_TOPK = 384, 8
#: Bytes per routed-expert weight kept INT4 with a bf16 scale per group of 32 (Kimi-K2-Thinking / K2.5): ½ + 2/32.
INT4_G32_BYTES = 0.5 + 2 / 32
#: Bytes of one cached key in the target's MLA latent cache: kv_lora_rank 512 + qk_rope_head_dim 64 values, bf16.
MLA_LATENT_ROW_BYTES = (512 + 64) * 2
#: Kimi-K2's attention heads, and the query rows (head × token of one sequence) per program of the latent kernel
#: (``splitspec.models.paged_attention.LATENT_BLOCK_M``): each block of them reads the sequence's latent rows anew.
KIMI_HEADS, LATENT_BLOCK_M = 64, 16
#: The most cached keys per sequence :attr:`KimiScale.context_tokens` takes (far past any model's context; above it
#: the figures overflow to inf and best k to 0 tokens/s).
MAX_CONTEXT_TOKENS = 1e9


def distinct_experts(tokens: float, experts: int = KIMI_EXPERTS, top_k: int = KIMI_TOPK) -> float:
    """Expected distinct experts chosen by ``tokens`` tokens routing uniformly: E·(1 − (1 − k/E)^T).

    Random-weight routers route near-uniformly (measured on H200: 8, 15.8, 30.9, 45.5, 108.7 for
    T = 1, 2, 4, 6, 16 against 8, 15.8, 31.1, 45.9, 109.6 here); trained routers concentrate more.
    """
    return experts * (1 - (1 - top_k / experts) ** tokens)


def _features(B: float, k: float, moe_layers: float) -> list[float]:
    T = B * (k + 1)
    steps = max(k - 1, 0)  # the draft phase is one extend forward (k > 0) plus k − 1 single-token steps
    ext = float(k > 0)
    return [1.0, B, T, ext, ext * B, steps, steps * B, moe_layers, moe_layers * distinct_experts(T), moe_layers * T]


FEATURES = ("fixed", "per_sequence", "per_verified_token", "extend", "extend_per_sequence", "per_draft_step",
            "per_draft_step_per_sequence", "per_moe_layer", "per_moe_layer_per_distinct_expert", "per_moe_layer_per_verified_token")


@dataclass
class CycleFit:
    """Least-squares coefficients (ms per feature) and errors (relative, |pred − meas| / meas)."""

    coef: dict[str, float]
    max_error: float
    mean_error: float
    loo_max_error: float
    loo_mean_error: float
    points: int

    def predict(self, B: float, k: float, moe_layers: float) -> float:
        """Modelled cycle ms at batch B, k draft tokens, ``moe_layers`` MoE layers (plus the fixed dense layer)."""
        return float(np.dot([self.coef[f] for f in FEATURES], _features(B, k, moe_layers)))


def fit_cycle_model(rows: list[dict]) -> CycleFit:
    """Fit t_cycle (ms) over measured rows with keys batch, k, moe_layers, cycle_ms (one placement; one or more
    depths — the per-MoE-layer terms are only separable from fixed costs with two or more depths)."""
    X = np.array([_features(r["batch"], r["k"], r["moe_layers"]) for r in rows])
    y = np.array([r["cycle_ms"] for r in rows])
    # least squares on relative residuals (each row divided by its measurement): the error that is reported
    # and judged is relative, and cycles span 2–40 ms
    Xw, yw = X / y[:, None], np.ones_like(y)
    coef, *_ = np.linalg.lstsq(Xw, yw, rcond=None)
    err = np.abs(X @ coef - y) / y
    loo = []
    for i in range(len(rows)):
        keep = np.arange(len(rows)) != i
        c, *_ = np.linalg.lstsq(Xw[keep], yw[keep], rcond=None)
        loo.append(abs(X[i] @ c - y[i]) / y[i])
    return CycleFit(dict(zip(FEATURES, map(float, coef))), float(err.max()), float(err.mean()),
                    float(max(loo)), float(np.mean(loo)), len(rows))


def expected_acceptance_length(profile: list[float], k: int) -> float:
    """1 + Σ_{j=1..k} Π_{i<j} p_i: tokens per target forward with conditional acceptance p_i at draft i+1."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= profile[min(i, len(profile) - 1)]
        total += run
    return total


#: The measured quantities :func:`fit_depth` fits, ms per cycle: the whole cycle (wall, median), its draft and verify phases.
DEPTH_QUANTITIES = ("cycle_ms", "draft_ms", "verify_ms")


def fit_depth(rows: list[dict]) -> list[dict]:
    """Each (batch, k, draft_tp) row's cost against depth, from one engine form measured at two or more depths.

    ``rows``: keys ``layers`` (the target's depth, ≥ 2: the first layer dense, the rest MoE, as in Kimi-K2), ``batch``,
    ``k``, ``draft_tp`` (None at k = 0) and :data:`DEPTH_QUANTITIES` (ms). For every (batch, k, draft_tp) measured at two
    or more distinct depths, each quantity q as q(layers) = fixed_ms + per_moe_layer_ms · (layers − 1), where fixed_ms
    holds what a cycle pays once whatever the depth — the dense first layer (always one: not separable from the rest),
    embedding, lm_head, the drafter, the host. The verify by least squares; the draft phase flat (per_moe_layer_ms 0,
    fixed_ms its mean over the depths): the drafter's work does not depend on the target's depth, and a slope fitted
    to two depths' noise carried to 61 layers gave negative drafts; the cycle as its part besides the draft by least
    squares plus that flat draft. Returns one dict per such row, sorted by (draft_tp, batch, k): batch, k, draft_tp,
    depths (sorted) and per quantity {"fixed_ms", "per_moe_layer_ms", "max_residual": the largest |fit − measured| /
    measured over its rows (0 through two depths for the lines fitted by least squares)}. Rows at one depth only are
    left out.
    Raises ValueError naming a row with a key missing, a depth below 2 or a cost that is not a positive number."""
    groups: dict[tuple, list[dict]] = {}
    for i, r in enumerate(rows):
        try:
            key, L = (int(r["batch"]), int(r["k"]), r["draft_tp"]), int(r["layers"])
            ok = L >= 2 and all(float(r[q]) >= 0 for q in DEPTH_QUANTITIES) and float(r["cycle_ms"]) > 0
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"depth fit: row {i} ({r!r:.120}): expected layers, batch, k, draft_tp and "
                             f"{', '.join(DEPTH_QUANTITIES)} ({type(e).__name__}: {e})") from None
        if not ok:
            raise ValueError(f"depth fit: row {i} (layers {r['layers']}, batch {r['batch']}, k {r['k']}): expected ≥ 2 layers "
                             f"and non-negative costs, a positive cycle_ms")
        groups.setdefault(key, []).append(r)
    out = []
    for (B, k, dtp), rs in sorted(groups.items(), key=lambda kv: (kv[0][2] or 0, kv[0][0], kv[0][1])):
        depths = sorted({int(r["layers"]) for r in rs})
        if len(depths) < 2:
            continue
        X = np.array([[1.0, int(r["layers"]) - 1.0] for r in rs])
        draft = np.array([float(r["draft_ms"]) for r in rs])
        fit = {"batch": B, "k": k, "draft_tp": dtp, "depths": depths}
        for q in DEPTH_QUANTITIES:
            y = np.array([float(r[q]) for r in rs])
            if q == "draft_ms":  # the drafter's work does not depend on the target's depth: its mean, flat
                c0, c1 = float(draft.mean()), 0.0
            else:  # along depth; the cycle without its draft, which is added back flat
                flat = draft if q == "cycle_ms" else np.zeros_like(y)
                (c0, c1), *_ = np.linalg.lstsq(X, y - flat, rcond=None)
                c0 += flat.mean()
            resid = np.abs(X @ np.array([c0, c1]) - y) / np.maximum(y, 1e-9)
            fit[q] = {"fixed_ms": float(c0), "per_moe_layer_ms": float(c1),
                      "max_residual": float(resid.max()) if len(depths) > 2 or q == "draft_ms" else 0.0}
        out.append(fit)
    return out


def fit_layer_costs(rows: list[dict], hbm_GBps: float) -> tuple[float, float, float]:
    """Fit one MoE layer's measured time as overhead + weight bytes / (hbm_GBps · efficiency), least squares on
    relative residuals. rows: ``bench/gpu_bench.py`` layer rows (keys ms, weight_bytes) of one TP shard shape.
    Returns (overhead ms, efficiency, max relative error of the fit)."""
    X = np.array([[1.0, r["weight_bytes"] / (hbm_GBps * 1e6)] for r in rows])
    y = np.array([r["ms"] for r in rows])
    c, *_ = np.linalg.lstsq(X / y[:, None], np.ones_like(y), rcond=None)
    return float(c[0]), float(1 / c[1]), float((np.abs(X @ c - y) / y).max())


@dataclass
class KimiScale:
    """Kimi-K2 (61 layers: 1 dense + 60 MoE) at tensor parallelism ``tp``, batch ``B``, from first principles:

    per layer and rank, bytes read = attention (replicated MLA down-projections + this rank's heads) +
    E(T) experts' slices (``routed_expert_weight_bytes`` per weight: 2 in bf16, :data:`INT4_G32_BYTES` for the
    INT4 experts of K2-Thinking / K2.5) + shared expert slice (bf16) + router + the latent cache rows the verify's
    attention reads, B · ``context_tokens`` · :data:`MLA_LATENT_ROW_BYTES` · ⌈(64 / tp) · (k + 1) / 16⌉ (the cache is
    whole on every rank and each rank's heads read all of it, so this term does not shrink with ``tp``; the latent
    kernel, ``splitspec.models.paged_attention.attend_latent``, gives each program 16 of a sequence's head × token
    query rows and each program reads the rows again: on one H100 a TP8 rank's dense layer at 16 sequences grew by
    28 µs from 256 to 4096 keys at k 0 (one block) and by 56 µs at k 3 (two), against 25 and 50 µs for these bytes at
    70 % of the copy bandwidth, docs/lab/2026-12-06-h100-latent-window-sweep; at batch 1 the growth, 15 µs, is the
    kernel's serial walk, not bytes, and this term undercounts it; the drafter's own KV cache is not counted); time =
    bytes / (hbm_GBps · efficiency) +
    layer_overhead_us + 2 all-reduces of T·7168 bf16 (α + bytes/β). The drafter's step costs
    draft_step_tp1_ms at TP1, or draft_step_shard_ms + 3 collectives (2 all-reduces, 1 all-gather) sharded. A cycle
    is fixed_cycle_ms (the host's part) + k draft steps + the verify, or with ``draft_ahead`` (a TP1 drafter with k > 0,
    :mod:`splitspec.engine.draft_ahead`) max(host's part, k draft steps) + the verify: the GPU drafts while the host
    accepts and plans (on one H100 the time outside the two phases fell from 0.05–0.39 ms to ~0 with it:
    docs/lab/2026-12-05-h100-draft-ahead-sampled).

    With ``depth_fit`` (:meth:`from_depth_fit`) one rank's compute comes from measured lines instead (:meth:`fitted_ms`),
    the collectives from α and β as above: verify = fitted verify + (2·layers + 1) all-reduces of T rows; cycle =
    fitted cycle (host, draft and verify together) + the verify's collectives + 3 per draft step when sharded. The
    fitted lines hold the attention reads of the short windows they were measured at (``bench/full_depth_rank.py``:
    16-token prompts) and the context they were measured at is not recorded with them, so this mode takes no
    ``context_tokens`` (ValueError for a non-zero one).

    All inputs are explicit so each figure in docs/performance.md can be traced to a measurement.
    """

    tp: int = 8
    hbm_GBps: float = 4200.0            # measured device copy, H200 (read + write)
    efficiency: float = 0.7             # fraction of hbm_GBps a layer's weight reads achieve (a production-grade engine, assumed;
    layer_overhead_us: float = 10.0     # per-layer time beyond the bytes; fit_layer_costs gives this engine's measured pair)
    head_efficiency: float = 0.87       # lm_head GEMV: measured 1.15× its bound on H200
    allreduce_alpha_us: float = 13.0    # measured NCCL all-reduce in a CUDA graph, 2 H200 over NVLink, small messages
    allreduce_GBps: float = 150.0       # effective bus bandwidth for the size term
    lm_head_vocab: int = 163840
    draft_step_tp1_ms: float = 0.70     # measured: Kimi-width EAGLE-3 step, TP1, in a graph, batch 1 (bench/gpu_bench.py)
    draft_step_shard_ms: float = 0.17   # same, TP8 shard before communication, in a graph (docs/architecture.md)
    fixed_cycle_ms: float = 0.3         # scheduler + one host copy per cycle
    draft_ahead: bool = False           # ServeConfig.draft_ahead: the TP1 drafter's phase overlaps the host's part
    routed_expert_weight_bytes: float = 2.0  # bf16; INT4_G32_BYTES for INT4 experts with group-32 bf16 scales
    depth_fit: tuple = ()               # fit_depth's rows (from_depth_fit); empty: the per-layer bytes model above
    # mean cached keys per sequence a verify attends over (its latent rows read per layer, see above); 0: weights only,
    # the model as calibrated at short windows (bench/gpu_bench.py's layer rows: ~100 keys), every figure unchanged
    context_tokens: float = 0.0

    H: int = 7168

    def __post_init__(self):
        c = self.context_tokens
        if isinstance(c, bool) or not isinstance(c, numbers.Real) or not 0 <= c <= MAX_CONTEXT_TOKENS:  # nan fails too
            try:
                shown = f"{float(c):.3g}" if isinstance(c, numbers.Real) and not isinstance(c, bool) else repr(c)[:40]
            except OverflowError:  # an integer past a float (whose repr may pass Python's 4300-digit limit)
                shown = "a number past 1e+308"
            raise ValueError(f"KimiScale.context_tokens: {shown}, expected a number of keys ≥ 0 and ≤ "
                             f"{MAX_CONTEXT_TOKENS:g} (mean cached keys per sequence)")
        self.context_tokens = c = float(c)  # numpy scalars and integers as a plain float
        if c and self.depth_fit:
            raise ValueError(f"KimiScale.context_tokens {c:g}: the depth_fit model holds the context it was measured at; "
                             "only 0 is taken")

    @classmethod
    def from_depth_fit(cls, fit: list[dict], **fields) -> "KimiScale":
        """The model whose rank compute is ``fit`` (:func:`fit_depth` of one rank of this engine form at short depths,
        e.g. ``bench/depth_fit.py``'s ``fit``); ``fields`` set the rest (``tp``, ``allreduce_alpha_us``, ...). Raises
        ValueError for an empty fit (nothing measured at two depths)."""
        if not fit:
            raise ValueError("KimiScale.from_depth_fit: no row fitted (each needs two or more depths)")
        return cls(depth_fit=tuple(fit), **fields)

    def fitted_ms(self, quantity: str, B: int, k: int, placement: str | None, layers: int = 61) -> float:
        """One rank's ``quantity`` (:data:`DEPTH_QUANTITIES`) ms at ``layers`` from :attr:`depth_fit`: the row of (B, k)
        and ``placement`` ("tp1": the split drafter's, another: the sharded one's, None: either, averaged; k = 0 rows
        serve both); a k without a row linear in k between (past the ends: along) the batch's two nearest fitted ks, a
        batch without rows linear in B between its fitted neighbours. Raises ValueError outside the fitted batches,
        and for a k of a batch with fewer than two fitted ks."""
        pts = {}
        for r in self.depth_fit:
            if r["k"] == 0 or placement is None or (r["draft_tp"] == 1) == (placement == "tp1"):
                line = r[quantity]
                pts.setdefault((r["batch"], r["k"]), []).append(line["fixed_ms"] + line["per_moe_layer_ms"] * (layers - 1))
        batches = sorted({b for b, _ in pts})
        if B not in batches:
            lo, hi = max((b for b in batches if b < B), default=None), min((b for b in batches if b > B), default=None)
            if lo is None or hi is None:
                raise ValueError(f"depth fit: batch {B} outside the fitted batches {batches}")
            w = (B - lo) / (hi - lo)
            return (1 - w) * self.fitted_ms(quantity, lo, k, placement, layers) + w * self.fitted_ms(quantity, hi, k, placement, layers)
        at = {kk: float(np.mean(v)) for (b, kk), v in pts.items() if b == B}
        if k in at:
            return at[k]
        ks = sorted(at)
        if len(ks) < 2:
            raise ValueError(f"depth fit: batch {B}, k {k}: fitted k {ks} only (two or more needed to carry it to other k)")
        below, above = [x for x in ks if x < k], [x for x in ks if x > k]
        a, b = (below[-1], above[0]) if below and above else (ks[-2], ks[-1]) if below else (ks[0], ks[1])
        return at[a] + (k - a) * (at[b] - at[a]) / (b - a)

    def allreduce_us(self, tokens: int) -> float:
        return self.allreduce_alpha_us + tokens * self.H * 2 / (self.allreduce_GBps * 1e3)

    def layer_bytes(self, tokens: int, moe: bool, sequences: int) -> float:
        """Bytes one rank reads in one layer of a verify of ``tokens`` tokens (all sequences together) from
        ``sequences`` sequences: the weights (dense MLP, or the MoE layer's experts for those tokens) and the
        sequences' latent cache rows at :attr:`context_tokens` keys each, once per block of query rows (class
        docstring; ``tokens`` / ``sequences`` tokens per sequence)."""
        H, tp = self.H, self.tp
        blocks = math.ceil(KIMI_HEADS / tp * tokens / sequences / LATENT_BLOCK_M)
        attn = (H * (1536 + 576) * 2 + (1536 * 64 * 192 + 64 * 128 * 512 * 2 + 64 * 128 * H) * 2 / tp
                + sequences * self.context_tokens * MLA_LATENT_ROW_BYTES * blocks)
        if not moe:
            return attn + 3 * H * 18432 * 2 / tp
        expert = 3 * H * 2048 / tp  # weights of one expert's slice on this rank
        return attn + distinct_experts(tokens) * expert * self.routed_expert_weight_bytes + expert * 2 + KIMI_EXPERTS * H * 4

    def verify_ms(self, B: int, k: int, layers: int = 61) -> float:
        T = B * (k + 1)
        if self.depth_fit:
            return self.fitted_ms("verify_ms", B, k, None, layers) + (2 * layers + 1) * self.allreduce_us(T) / 1e3
        bw = self.hbm_GBps * self.efficiency * 1e6  # bytes per ms
        per_layer = [self.layer_bytes(T, moe=i > 0, sequences=B) / bw + (self.layer_overhead_us + 2 * self.allreduce_us(T)) / 1e3
                     for i in range(layers)]
        head = (self.lm_head_vocab * self.H * 2 / self.tp) / (self.hbm_GBps * self.head_efficiency * 1e6) + self.allreduce_us(T) / 1e3
        return sum(per_layer) + head

    def bandwidth_bound_ms(self, B: int, k: int, layers: int = 61) -> float:
        """Bytes read per verify / HBM bandwidth: the floor no engine beats at this batch."""
        T = B * (k + 1)
        total = sum(self.layer_bytes(T, moe=i > 0, sequences=B) for i in range(layers)) + self.lm_head_vocab * self.H * 2 / self.tp
        return total / (self.hbm_GBps * 1e6)

    def draft_step_ms(self, B: int, placement: str) -> float:
        if placement == "tp1":
            return self.draft_step_tp1_ms * (1 + 0.045 * (B - 1))  # measured: 0.70 / 0.82 / 1.18 ms at B = 1 / 4 / 16
        return self.draft_step_shard_ms * (1 + 0.045 * (B - 1)) + 3 * self.allreduce_us(B) / 1e3

    def cycle_ms(self, B: int, k: int, placement: str, layers: int = 61) -> float:
        if self.depth_fit:
            draft_comm = 3 * k * self.allreduce_us(B) / 1e3 if placement != "tp1" else 0.0
            return (self.fitted_ms("cycle_ms", B, k, placement, layers) + draft_comm
                    + (2 * layers + 1) * self.allreduce_us(B * (k + 1)) / 1e3)
        draft = k * self.draft_step_ms(B, placement)
        if self.draft_ahead and placement == "tp1" and k:  # the host's part runs while the GPU drafts
            return max(self.fixed_cycle_ms, draft) + self.verify_ms(B, k, layers)
        return self.fixed_cycle_ms + draft + self.verify_ms(B, k, layers)

    def tokens_per_s(self, B: int, k: int, placement: str, profile: list[float], layers: int = 61) -> float:
        return B * expected_acceptance_length(profile, k) / self.cycle_ms(B, k, placement, layers) * 1e3

    def calibrate_allreduce_to_decode(self, tokens_per_s: float, layers: int = 61) -> "KimiScale":
        """Return a copy whose all-reduce latency α makes batch-1 decode (k = 0) run at ``tokens_per_s``
        (e.g. a measured deployment without speculation); the unknown interconnect is folded into α."""
        import dataclasses

        target_ms = 1e3 / tokens_per_s
        lo, hi = 0.0, 5000.0
        for _ in range(60):
            mid = (lo + hi) / 2
            m = dataclasses.replace(self, allreduce_alpha_us=mid)
            lo, hi = (mid, hi) if m.cycle_ms(1, 0, "tp1", layers) < target_ms else (lo, mid)
        return dataclasses.replace(self, allreduce_alpha_us=(lo + hi) / 2)


def best_k(model: KimiScale, B: int, placement: str, profile: list[float], ks=range(0, 7)) -> tuple[int, float]:
    """The k with the highest modelled tokens/s, and that rate."""
    rates = {k: model.tokens_per_s(B, k, placement, profile) for k in ks}
    k = max(rates, key=rates.get)
    return k, rates[k]


def allreduce_crossover_us(model: KimiScale, B: int, profile: list[float], ks=range(0, 7),
                           hi_us: float = 5000.0) -> float | None:
    """All-reduce latency α (µs) at which the drafter on one GPU starts to beat the sharded drafter: the α where
    the best k's tokens/s of the two placements meet (bisection, to 0.01 µs). α enters both: every verify pays
    2 all-reduces per layer whatever the placement, and the sharded drafter 3 collectives per step.

    Returns None when one placement wins over the whole range [0, ``hi_us``] (no crossover).
    """
    import dataclasses

    def gap(alpha: float) -> float:  # > 0: the drafter on one GPU is faster
        m = dataclasses.replace(model, allreduce_alpha_us=alpha)
        return best_k(m, B, "tp1", profile, ks)[1] - best_k(m, B, "tp8", profile, ks)[1]

    lo, hi = 0.0, hi_us
    if (gap(lo) > 0) == (gap(hi) > 0):
        return None
    while hi - lo > 0.01:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gap(mid) > 0 else (mid, hi)
    return (lo + hi) / 2
