"""FP8 kernel measurements of bench/fp8_bench.py at Kimi-K2 widths (hidden 7168; 384 routed experts of intermediate
2048 / TP, 8 per token, one shared expert; MLA q_lora 1536, kv_lora 512 + rope 64, 64 heads; dense intermediate
18432), block-scaled FP8 in 128 × 128 tiles as Kimi-K2-Instruct publishes it:

- :func:`moe`: the fused MoE decode kernels (``models.fused_moe``) on FP8 experts, every FP8 mode and block
  configuration of a sweep, against the same kernels on bf16 experts and against the FP8 bytes' bound;
- :func:`linears`: the FP8 linears (``models.fp8_linear``): dequantise-per-call (the former path), the engine's
  choice, ``torch._scaled_mm`` block-scaled W8A8, every Triton configuration of a sweep, bf16 ``F.linear``.

Weights are random bytes (e4m3 without its NaN codes) and random tile scales: costs are real, values meaningless.
Every timed call reads cold weights: each replay of a CUDA graph rotates over routings (MoE) or weight copies
(linears) whose bytes together exceed the 50 MB L2 several times. Errors are reported against the dequantised weights
computed in float32 (``max |y − ref| / max |ref|``). Times in ms."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from splitspec import quant
from splitspec.models import fp8_linear, fused_moe
from splitspec.models.fp8_tiles import MODE_DOT, MODE_DOT_BITS, MODE_F32, MODE_F32_BITS, MODE_W8A8

BLOCK = (128, 128)
KIMI = {"hidden": 7168, "experts": 384, "top_k": 8, "moe_i": 2048, "q_lora": 1536, "kv_a": 576, "heads": 64,
        "qk_head": 192, "v_head": 128, "dense_i": 18432}
F32_MODES, DOT_MODES = (MODE_F32, MODE_F32_BITS), (MODE_DOT, MODE_DOT_BITS)
#: (BLOCK_N, BLOCK_K, num_warps, num_stages[, split: gate/up's H, w8a8 down's slots]) swept per FP8 mode and MoE kernel
MOE_SWEEP = {"gate_up": {**{m: [(8, 1024, 4, 3), (16, 512, 4, 4), (8, 512, 4, 4), (16, 1024, 8, 3), (8, 512, 4, 4, 2)]
                            for m in F32_MODES},
                         **{m: [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3), (64, 256, 4, 3),
                                (32, 512, 8, 3), (16, 256, 4, 3, 2), (16, 512, 4, 3, 4), (32, 256, 4, 3, 4),
                                (64, 256, 4, 3, 4)]
                            for m in DOT_MODES},
                         MODE_W8A8: [(64, 128, 4, 4), (64, 128, 4, 6), (32, 128, 2, 6), (16, 128, 2, 4), (32, 128, 4, 4),
                                     (128, 128, 8, 3)]},
             "down": {**{m: [(16, 256, 8, 4), (16, 512, 8, 4), (8, 512, 4, 4), (32, 256, 8, 3)] for m in F32_MODES},
                      **{m: [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (64, 128, 4, 3), (32, 512, 8, 3)]
                         for m in DOT_MODES},
                      MODE_W8A8: [(64, 128, 4, 4), (64, 128, 4, 6), (32, 128, 2, 6), (64, 128, 4, 4, 2),
                                  (64, 128, 4, 6, 2), (32, 128, 4, 4, 2), (64, 128, 4, 4, 3), (32, 128, 2, 6, 3)]}}
#: Triton linear configurations (fp8_linear.LINEAR_CONFIGS entries) swept per token count
LINEAR_SWEEP = {1: [(0, 1, 16, 512, 0, 4, 3), (0, 1, 16, 512, 1, 4, 3), (1, 1, 16, 512, 0, 4, 3), (0, 1, 32, 256, 0, 4, 3),
                    (2, 16, 32, 256, 0, 4, 3), (3, 16, 32, 256, 0, 4, 3), (3, 16, 64, 256, 0, 4, 3)],
                4: [(2, 16, 32, 256, 0, 4, 3), (3, 16, 32, 256, 0, 4, 3), (2, 16, 64, 128, 0, 4, 3), (3, 16, 64, 256, 0, 4, 4),
                    (3, 16, 16, 512, 0, 4, 3), (0, 1, 16, 512, 0, 4, 3)],
                16: [(2, 16, 32, 256, 0, 4, 3), (3, 16, 32, 256, 0, 4, 3), (2, 16, 64, 128, 0, 4, 3), (3, 16, 64, 256, 0, 4, 4),
                     (3, 16, 128, 128, 0, 8, 3)],
                256: [(2, 64, 64, 128, 1, 4, 3), (3, 64, 64, 128, 1, 4, 3), (2, 64, 128, 128, 1, 8, 3), (3, 128, 128, 64, 1, 8, 3),
                      (2, 32, 64, 128, 0, 4, 3)]}


def random_fp8(shape: tuple[int, ...], g: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float8_e4m3fn of ``shape`` (every byte but the NaN codes 0x7F / 0xFF) and float32 tile scales
    ~ U(2⁻¹², 2⁻¹¹) (so that x · scale · 2⁸ stays in f16's range for the dot modes), stacked leading dims kept."""
    q = torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)
    for chunk in q.view(-1, shape[-1]).split(4096):  # in slices: the masks of a 17 GB stack would double it
        chunk[(chunk & 0x7F) == 0x7F] = 0
    s = torch.rand(quant.fp8_scale_shape(shape, BLOCK), device=device, generator=g) * 2 ** -12 + 2 ** -12
    return q.view(torch.float8_e4m3fn), s


def wall_ms(calls) -> float:
    """Mean ms per call of ``calls`` run in turn (CPU dry runs; the GPU uses gpu_kernels.timed_graph)."""
    t0 = time.perf_counter()
    for c in calls:
        c()
    return (time.perf_counter() - t0) * 1e3 / len(calls)


def graph_ms(calls) -> float:
    """Median ms per call of one CUDA graph replaying every call of ``calls`` in turn (cold weights: see module)."""
    from lab.gpu_kernels import timed_graph

    return timed_graph(lambda: [c() for c in calls], reps=1, replays=10) / len(calls)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def attempt(fn):
    """fn()'s value, or {"error": one line} when it raises (a configuration that does not compile or run)."""
    try:
        return fn()
    except Exception as e:  # recorded in the results; the sweep goes on
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"}


# ---------------------------------------------------------------- MoE

def _experts(tp: int, dims: dict, g, device):
    H, E, I = dims["hidden"], dims["experts"], dims["moe_i"] // tp
    fp8 = [random_fp8((E, 2 * I, H), g, device), random_fp8((E, H, I), g, device),
           random_fp8((2 * I, H), g, device), random_fp8((H, I), g, device)]
    bf16 = [torch.randn(*q.shape, dtype=torch.bfloat16, device=device, generator=g).mul_(q.shape[-1] ** -0.5) for q, _ in fp8]
    return fp8, bf16


def _routings(T: int, n: int, dims: dict, g, device):
    E, k = dims["experts"], dims["top_k"]
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, device=device, generator=g)[:k] for _ in range(T)])
        out.append((torch.randn(T, dims["hidden"], dtype=torch.bfloat16, device=device, generator=g), ids,
                    torch.rand(T, k, device=device, generator=g)))
    return out


def _moe_call(fp8, x, ids, wts, shared: bool, **cfg):
    (q13, s13), (q2, s2), (qs13, ss13), (qs2, ss2) = fp8
    sh, sc = ((qs13, qs2), (s13, s2, ss13, ss2)) if shared else ((), (s13, s2, None, None))
    return lambda: fused_moe.fused_experts(x, ids, wts, q13, q2, *sh, scales=sc, fp8_block=BLOCK, **cfg)


def _moe_reference(fp8, x, ids, wts, shared: bool) -> torch.Tensor:
    """Token 0's output [1, H] from the same experts dequantised to float32 (its own only) through the float kernels,
    x in float32 (the kernels' rows are independent: token 0 of a batch is token 0 alone)."""
    x, ids, wts = x[:1], ids[:1], wts[:1]
    used, local = ids.unique(return_inverse=True)
    deq = [quant.dequantize_fp8(q[used], s[used], BLOCK) for q, s in fp8[:2]]
    sh = [quant.dequantize_fp8(q, s, BLOCK) for q, s in fp8[2:]] if shared else []
    return fused_moe.fused_experts(x.float(), local, wts, *deq, *sh)


def moe(bw_GBps: float, tps: list[int], tokens=(1, 4, 16), rotate: int = 8, dims: dict = KIMI, sweep: dict = MOE_SWEEP,
        device="cuda", timer=graph_ms, deadline: float | None = None) -> dict:
    """FP8 routed experts (T = 1 with the FP8 shared expert in the kernels, as the engine runs a decode step; more
    tokens without), per TP shape: first each kernel's configurations of ``sweep`` (the other kernel at its current
    FP8 default) at 1 and 4 tokens; the fastest per kernel, token class and TP shape become the ``chosen`` configs
    (``paste``: the ``FP8_CONFIGS`` line for fused_moe.py). Then per TP shape and token count: bf16 experts, FP8 at
    the shipped defaults, FP8 at the chosen configs; bound = distinct experts' (+ shared) FP8 bytes / bandwidth."""
    bw = bw_GBps * 1e6  # bytes per ms
    g = torch.Generator(device=device).manual_seed(0)
    out = {"sweep": [], "rows": [], "tps": tps}
    weights = {tp: _experts(tp, dims, g, device) for tp in tps}
    problems = {T: _routings(T, rotate, dims, g, device) for T in sorted({1, 4, *tokens})}
    # round-robin over (kernel, mode): a sweep cut short by the deadline has still tried every mode in both kernels
    lists = [[(kernel, (*cfg[:4], mode, *cfg[4:])) for cfg in cfgs] for kernel, modes in sweep.items() for mode, cfgs in modes.items()]
    for kernel, full in (lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)):
        if deadline and time.time() > deadline:
            out.setdefault("skipped", []).append((kernel, full))
            continue
        row = {"kernel": kernel, "config": full}
        for T, tp in ((T, tp) for T in (1, 4) for tp in tps):
            kw = {"gate_up_config" if kernel == "gate_up" else "down_config": full}
            calls = [_moe_call(weights[tp][0], x, i, w, T == 1, **kw) for x, i, w in problems[T]]
            row[f"ms_tp{tp}_T{T}"] = attempt(lambda: timer(calls))
        out["sweep"].append(row)
        print("moe sweep", row, flush=True)

    def fastest(kernel: str, T: int, tp: int, w8a8: bool):
        rows = [r for r in out["sweep"] if r["kernel"] == kernel and isinstance(r[f"ms_tp{tp}_T{T}"], float)
                and (r["config"][4] == MODE_W8A8) == w8a8]
        return min(rows, key=lambda r: r[f"ms_tp{tp}_T{T}"]) if rows else None

    def key(T: int, tp: int) -> tuple[str, str]:
        return fused_moe.fp8_class(T, dims["moe_i"] // tp)

    # per shard: one activation form (w8a8 or w8a16) for every token count, so that a token's numerics do not
    # depend on how many tokens share its step; the form with the lower summed best times, then per token class
    # the fastest gate_up and down of that form (each timed beside the other's default)
    defaults = {key(T, tp): fused_moe.FP8_CONFIGS[key(T, tp)] for T in (1, 4) for tp in tps}
    chosen = {}
    for tp in tps:
        def score(w8a8):
            best = [fastest(k, T, tp, w8a8) for k in sweep for T in (1, 4)]
            return sum(r[f"ms_tp{tp}_T{T}"] for r, T in zip(best, (1, 4) * len(sweep))) if all(best) else float("inf")

        form = score(True) < score(False)
        for T in (1, 4):
            best = [fastest(k, T, tp, form) for k in ("gate_up", "down")]
            chosen[key(T, tp)] = tuple(tuple(r["config"]) if r else defaults[key(T, tp)][i] for i, r in enumerate(best))
    out["chosen"], out["defaults"] = ({"/".join(k): v for k, v in d.items()} for d in (chosen, defaults))
    out["paste"] = ["FP8_CONFIGS = {" + ", ".join(f"{k}: {v}" for k, v in sorted(chosen.items())) + "}"]
    for tp in tps:
        fp8, bf16 = weights[tp]
        per_expert = sum(t[0].nbytes + s[0].nbytes for t, s in fp8[:2])
        shared_bytes = sum(t.nbytes + s.nbytes for t, s in fp8[2:])
        for T in tokens:
            shared = T == 1
            calls = problems[T]
            nbytes = sum(i.unique().numel() * per_expert + shared * shared_bytes for _, i, _ in calls) / len(calls)
            bcalls = [lambda x=x, i=i, w=w: fused_moe.fused_experts(x, i, w, *bf16[:2], *(bf16[2:] if shared else ()))
                      for x, i, w in calls]
            best = dict(zip(("gate_up_config", "down_config"), chosen[key(T, tp)]))
            row = {"tp": tp, "tokens": T, "fp8_bytes": nbytes, "bound_ms": nbytes / bw,
                   "bf16_ms": attempt(lambda: timer(bcalls)),
                   "fp8_default_ms": attempt(lambda: timer([_moe_call(fp8, x, i, w, shared) for x, i, w in calls])),
                   "fp8_chosen_ms": attempt(lambda: timer([_moe_call(fp8, x, i, w, shared, **best) for x, i, w in calls])),
                   "chosen": best}
            x, i, w = calls[0]
            row["chosen_err_vs_dequant"] = attempt(lambda: rel_err(_moe_call(fp8, x, i, w, shared, **best)()[:1],
                                                                   _moe_reference(fp8, x, i, w, shared)))
            if all(isinstance(row[k], float) for k in ("bf16_ms", "fp8_chosen_ms")):
                row |= {"bf16_over_fp8": row["bf16_ms"] / row["fp8_chosen_ms"], "fp8_GBps": nbytes / row["fp8_chosen_ms"] / 1e6,
                        "fp8_over_bound": row["fp8_chosen_ms"] / row["bound_ms"]}
            out["rows"].append(row)
            print("moe row", row, flush=True)
    del weights
    return out


# ---------------------------------------------------------------- linears

def linear_shapes(tps: list[int], dims: dict = KIMI) -> list[tuple[str, int, int, int]]:
    """(name, TP, N, K) of the Kimi-K2 attention and dense-MLP linears, one rank's slice (the replicated
    down-projections once)."""
    H, h = dims["hidden"], dims["heads"]
    out = [("q_a", 1, dims["q_lora"], H), ("kv_a", 1, dims["kv_a"], H), ("fused_qkv_a", 1, dims["q_lora"] + dims["kv_a"], H)]
    for tp in tps:
        out += [("q_b", tp, h * dims["qk_head"] // tp, dims["q_lora"]), ("o", tp, H, h * dims["v_head"] // tp),
                ("mlp_w13", tp, 2 * dims["dense_i"] // tp, H), ("mlp_w2", tp, H, dims["dense_i"] // tp)]
    return out


def linears(bw_GBps: float, tps: list[int], tokens=(1, 4, 16, 256), dims: dict = KIMI, sweep: dict = LINEAR_SWEEP,
            device="cuda", timer=graph_ms, cold_bytes: int = 256 << 20, deadline: float | None = None,
            names: tuple[str, ...] | None = None) -> dict:
    """Per linear shape and token count: bf16 ``F.linear``, dequantise-per-call (``quant.linear``), the engine's
    ``fp8_linear.linear``, ``torch._scaled_mm`` W8A8 where the shape fits, and each Triton configuration of ``sweep``;
    bounds = bytes (weights + scales + activations in and out) / bandwidth. ``chosen``: per token count the Triton
    configuration with the lowest summed time / bound over the shapes (``paste``: the LINEAR_CONFIGS line).
    ``names``: only these shapes of :func:`linear_shapes`."""
    bw = bw_GBps * 1e6
    g = torch.Generator(device=device).manual_seed(1)
    scaled = fp8_linear.scaled_mm_supported(device)
    out = {"rows": [], "scaled_mm_supported": scaled}
    for name, tp, N, K in linear_shapes(tps, dims):
        if names and name not in names:
            continue
        if deadline and time.time() > deadline:
            out.setdefault("skipped", []).append(name + f"_tp{tp}")
            continue
        one = random_fp8((N, K), g, device)
        copies = max(1, min(256, -(-cold_bytes // (N * K))))
        fp8 = [one] + [random_fp8((N, K), g, device) for _ in range(copies - 1)]
        bf16 = [torch.randn(N, K, dtype=torch.bfloat16, device=device, generator=g) * K ** -0.5 for _ in range(copies)]
        ref_w = quant.dequantize_fp8(*one, BLOCK)
        sbytes = one[1].nbytes
        for T in tokens:
            x = torch.randn(T, K, dtype=torch.bfloat16, device=device, generator=g)
            ref = x.float() @ ref_w.T
            io = 2 * T * (N + K)
            row = {"shape": name, "tp": tp, "N": N, "K": K, "tokens": T, "copies": copies,
                   "fp8_bound_ms": (N * K + sbytes + io) / bw, "bf16_bound_ms": (2 * N * K + io) / bw,
                   "engine_path": fp8_linear.plan(T, N, K, BLOCK, scaled)[0] if device != "cpu" else "dequant"}

            def timed(fn, x=x, fp8=fp8, ref=ref):
                calls = [lambda w=w: fn(x, w) for w in fp8]
                return attempt(lambda: timer(calls)), attempt(lambda: rel_err(fn(x, fp8[0]), ref))

            row["bf16_ms"] = attempt(lambda: timer([lambda w=w, x=x: F.linear(x, w) for w in bf16]))
            methods = {"dequant": lambda x, w: quant.linear(x, w[0], w[1], BLOCK),
                       "engine": lambda x, w: fp8_linear.linear(x, w[0], w[1], BLOCK, scaled)}
            if scaled and fp8_linear.scaled_mm_fits(N, K, BLOCK):
                methods["scaled_mm"] = lambda x, w: fp8_linear.scaled_mm_linear(x, w[0], w[1])
            for cfg in sweep.get(T, sweep[max(sweep)]):
                methods[f"triton{cfg}"] = lambda x, w, cfg=cfg: fp8_linear.triton_linear(x, w[0], w[1], BLOCK, cfg)
            row["ms"], row["err"] = {}, {}
            for m, fn in methods.items():
                row["ms"][m], row["err"][m] = timed(fn)
            tri = {m: v for m, v in row["ms"].items() if m.startswith("triton") and isinstance(v, float)}
            if tri:
                row["best_triton"] = min(tri, key=tri.get)
            out["rows"].append(row)
            print("linear row", {k: v for k, v in row.items() if k != "err"}, flush=True)
    chosen = {}
    for T in tokens:
        rows = [r for r in out["rows"] if r["tokens"] == T]
        score = {}
        for m in {m for r in rows for m in r["ms"] if m.startswith("triton")}:
            if all(isinstance(r["ms"].get(m), float) for r in rows):
                score[m] = sum(r["ms"][m] / r["fp8_bound_ms"] for r in rows)
        if score:
            chosen[T] = min(score, key=score.get)
    out["chosen"] = chosen
    key = {1: 1, 4: 4, 16: 16}
    out["paste"] = "LINEAR_CONFIGS = {" + ", ".join(f"{key.get(T, '1 << 20')}: {m[len('triton'):]}" for T, m in chosen.items()) + "}"
    return out
