"""Fused MLA decode attention: absorbed query, attention over the latent window and value up-projection of one
(sequence, head) in one Triton program.

The padded (CUDA-graph) path of :meth:`splitspec.models.target.TargetModel.attention_half` does this in about
eight kernels per layer — the ``w_uk`` einsum, the window gather, two small matrix products and a softmax, the
``w_uv`` einsum and the copies between them — each a few µs and latency-bound at decode (bench/gpu_bench.py,
``layers`` profiles: ~20 µs of a TP2 layer's ~205 µs at one token). Here, for sequence b and query head h
(DeepSeek-V3 absorbed form, arXiv:2412.19437 appendix; the cache row is latent c_kv [C] then rope key k_pe [R]):

1. q_lat = q_nope · W_UK[h]                               [n, C]   (W_UK read once per program, in row chunks)
2. for each block of window rows s (cache rows ``table[b, s]``, position s):
   scores = (q_lat · c_kvᵀ + q_pe · k_peᵀ) · scale, masked where s > the query's position (causal), online
   softmax (Milakov & Gimelshein 2018), acc += p · c_kv; rows past the sequence's last query position (stale
   rejected drafts, the padded end of the window) are not read at all
3. o = (acc / l) · W_UV[h]ᵀ                                [n, V]

Rounding follows the unfused path: in bf16 on CUDA, q_lat, the scores, the probabilities and the attention output
are rounded to the activation dtype before their matrix products; sums are float32 (float32 activations, and
the interpreter, compute every product in float32). Each program re-reads its head's W_UK/W_UV
(2 · 128 KB at Kimi-K2 shapes) and its sequence's window, so with many sequences the unfused path (each weight
once) is better: :func:`use_fused` draws that line (:data:`MAX_SEQUENCES`).

The kernel runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (as :mod:`splitspec.fused_moe`).
"""

from __future__ import annotations

import os

import torch

from splitspec import fused_moe
from splitspec.fused_moe import jit, tl, triton

#: Whether the engine uses the kernel (``SPLITSPEC_FUSED_MLA=1``). Off by default until it is timed on a GPU
#: against the unfused path (bench/gpu_bench.py, ``layers`` section, rows with ``"fused_mla": true``).
ENABLED = os.environ.get("SPLITSPEC_FUSED_MLA", "0") == "1"

#: The kernel serves padded batches of at most this many sequences (each program re-reads its head's weights).
MAX_SEQUENCES = 4

#: ... and key windows of at most this many positions: each program walks its window serially, BLOCK_S rows a step,
#: with one program per (sequence, head) — at long contexts a split over the window (flash-decoding) would be needed.
MAX_WINDOW = 512

#: (BLOCK_S window rows per step, row chunk of W_UK / W_UV, num_warps, num_stages).
CONFIG = (16, 32, 8, 2)


def _dot_dim(d: int) -> bool:
    """Whether d can be a ``tl.dot`` dimension or block of the kernel: a power of two ≥ 16."""
    return d >= 16 and d & (d - 1) == 0


def _dims(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uv: torch.Tensor) -> dict[str, int]:
    return {"nope": q_nope.shape[-1], "rope": q_pe.shape[-1], "latent": w_uv.shape[-1], "value": w_uv.shape[1]}


def use_fused(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uv: torch.Tensor, table: torch.Tensor) -> bool:
    """Whether the kernel serves this padded batch (q_nope [T, H, DN], q_pe [T, H, R], w_uv [H, V, C], table [B, S]):
    CUDA tensors, ≤ :data:`MAX_SEQUENCES` sequences of ≤ 16 new tokens, a window S ≤ :data:`MAX_WINDOW`, DN, R, V,
    C powers of two ≥ 16 (``tl.dot`` shapes), Triton importable, :data:`ENABLED`."""
    B, S = table.shape
    return (ENABLED and q_nope.is_cuda and fused_moe.available() and B <= MAX_SEQUENCES and S <= MAX_WINDOW
            and q_nope.shape[0] <= 16 * B and all(map(_dot_dim, _dims(q_nope, q_pe, w_uv).values())))


@jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """a · b summed in float32: with F32_DOT (float32 inputs: IEEE products, not TF32; and the interpreter, whose
    bf16 ``tl.dot`` is wrong in Triton 3.9) through float32, else in the inputs' dtype."""
    if F32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@jit
def _mla_decode(qn_ptr, qp_ptr, wuk_ptr, wuv_ptr, kv_ptr, table_ptr, pos_ptr, out_ptr, n, S, scale,
                s_qn_t, s_qn_h, s_qp_t, s_qp_h, s_kv, s_out_t, s_out_h,
                DN: tl.constexpr, DR: tl.constexpr, C: tl.constexpr, DV: tl.constexpr, NP: tl.constexpr,
                BLOCK_S: tl.constexpr, CHUNK: tl.constexpr, F32_DOT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, NP)
    live = i < n
    tok = (b * n + i).to(tl.int64)
    c = tl.arange(0, C)
    ch = tl.arange(0, CHUNK)
    dtype = out_ptr.dtype.element_ty
    # 1. q_lat [NP, C] = q_nope [NP, DN] · W_UK[h] [DN, C], DN in row chunks
    q_lat = tl.zeros([NP, C], dtype=tl.float32)
    for n0 in tl.static_range(0, DN, CHUNK):
        qn = tl.load(qn_ptr + tok[:, None] * s_qn_t + h * s_qn_h + (n0 + ch)[None, :], mask=live[:, None], other=0.0)
        w = tl.load(wuk_ptr + h * DN * C + (n0 + ch)[:, None] * C + c[None, :])
        q_lat += _dot(qn, w, F32_DOT)
    q_lat = q_lat.to(dtype)
    r = tl.arange(0, DR)
    qp = tl.load(qp_ptr + tok[:, None] * s_qp_t + h * s_qp_h + r[None, :], mask=live[:, None], other=0.0)
    pos = tl.load(pos_ptr + b * n + i, mask=live, other=0)
    # 2. online softmax over the window
    m = tl.full([NP], float("-inf"), dtype=tl.float32)
    l = tl.zeros([NP], dtype=tl.float32)
    acc = tl.zeros([NP, C], dtype=tl.float32)
    last = tl.minimum(tl.max(pos, axis=0) + 1, S)  # window rows past every query's position are not read
    for s0 in range(0, last, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        inside = s < last
        rows = tl.load(table_ptr + b * S + s, mask=inside, other=0).to(tl.int64)
        k_lat = tl.load(kv_ptr + rows[:, None] * s_kv + c[None, :], mask=inside[:, None], other=0.0)
        k_pe = tl.load(kv_ptr + rows[:, None] * s_kv + C + r[None, :], mask=inside[:, None], other=0.0)
        sc = _dot(q_lat, tl.trans(k_lat), F32_DOT) + _dot(qp, tl.trans(k_pe), F32_DOT)
        visible = (s[None, :] <= pos[:, None]) & inside[None, :]
        sc = tl.where(visible, sc.to(dtype).to(tl.float32) * scale, float("-inf"))  # scores in q's dtype, as unfused
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(dtype), k_lat, F32_DOT)
        m = m_new
    att = (acc / l[:, None]).to(dtype)
    # 3. o [NP, DV] = att [NP, C] · W_UV[h]ᵀ, DV in row chunks
    for v0 in tl.static_range(0, DV, CHUNK):
        w = tl.load(wuv_ptr + h * DV * C + (v0 + ch)[:, None] * C + c[None, :])
        o = _dot(att, tl.trans(w), F32_DOT)
        tl.store(out_ptr + tok[:, None] * s_out_t + h * s_out_h + (v0 + ch)[None, :], o.to(dtype), mask=live[:, None])


@torch.library.custom_op("splitspec::mla_decode", mutates_args=())
def _mla_op(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, kv: torch.Tensor,
            table: torch.Tensor, positions: torch.Tensor, scale: float, config: list[int]) -> torch.Tensor:
    T, H, DN = q_nope.shape
    B, S = table.shape
    C, DR, DV = w_uk.shape[-1], q_pe.shape[-1], w_uv.shape[1]
    out = torch.empty(T, H, DV, dtype=q_nope.dtype, device=q_nope.device)
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    w_uk, w_uv, kv, table, positions = (t.contiguous() for t in (w_uk, w_uv, kv, table, positions))
    BLOCK_S, CHUNK, warps, stages = config
    _mla_decode[(B, H)](
        q_nope, q_pe, w_uk, w_uv, kv, table, positions, out, T // B, S, scale, q_nope.stride(0), q_nope.stride(1),
        q_pe.stride(0), q_pe.stride(1), kv.stride(0), out.stride(0), out.stride(1), DN=DN, DR=DR, C=C, DV=DV,
        NP=max(16, triton.next_power_of_2(T // B)), BLOCK_S=BLOCK_S, CHUNK=min(CHUNK, DN, DV),
        F32_DOT=q_nope.dtype == torch.float32 or not q_nope.is_cuda, num_warps=warps, num_stages=stages)
    return out


@_mla_op.register_fake
def _(q_nope, q_pe, w_uk, w_uv, kv, table, positions, scale, config):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])


def decode_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                     kv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, scale: float,
                     config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Absorbed MLA attention of a padded batch in one kernel (see the module docstring).

    q_nope [T, H, DN] and q_pe [T, H, R] (rope applied): the queries of B sequences with n = T / B new tokens
    each, sequence-major; w_uk [H, DN, C], w_uv [H, V, C] (this rank's heads); kv [rows, C + R] the layer's
    latent cache (the new tokens' rows already written); table [B, S] int64 cache rows of positions 0..S−1 per
    sequence; positions [B, n] (or [T]) each query's position. DN, C, V, R, and the chunk of ``config``, powers of
    two. Returns o [T, H, V] in q's dtype — what ``attend_padded`` followed by the ``w_uv`` einsum gives, up to
    float32 summation order. ``config``: (BLOCK_S, CHUNK, num_warps, num_stages), default :data:`CONFIG`.

    Raises:
        ValueError: shapes or dtypes that do not fit together, dims that are not powers of two ≥ 16, T not a multiple
        of B or more than 16 new tokens per sequence, a config with BLOCK_S < 16 or a CHUNK not a power of two ≥ 16.
        (Table rows must be < kv rows: not checked, which would cost a device synchronisation.)
    """
    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_mla.decode_attention: table must be [B, S] integer (got {table.dtype}, {table.dim()}-D)")
    T, H, DN = q_nope.shape
    B, S = table.shape
    want = {"q_pe": (T, H, None), "w_uk": (H, DN, None), "w_uv": (H, None, w_uk.shape[-1]), "kv": (None, None)}
    for name, t in (("q_pe", q_pe), ("w_uk", w_uk), ("w_uv", w_uv), ("kv", kv)):
        if t.dim() != len(want[name]) or any(w is not None and d != w for d, w in zip(t.shape, want[name])):
            raise ValueError(f"fused_mla.decode_attention: {name} has shape {tuple(t.shape)}, expected "
                             f"{tuple('*' if w is None else w for w in want[name])} (q_nope {tuple(q_nope.shape)})")
    dims = _dims(q_nope, q_pe, w_uv)
    bad = {k: d for k, d in dims.items() if not _dot_dim(d)}
    if bad or kv.shape[-1] != dims["latent"] + dims["rope"] or T % B or T > 16 * B or positions.numel() != T:
        raise ValueError(f"fused_mla.decode_attention: dims {dims} must be powers of two ≥ 16 (not: {bad}), kv rows "
                         f"latent + rope = {dims['latent'] + dims['rope']} wide (got {kv.shape[-1]}), T = {T} a multiple "
                         f"of B = {B} sequences with ≤ 16 each, positions T = {T} values (got {positions.numel()})")
    dtypes = {t.dtype for t in (q_nope, q_pe, w_uk, w_uv, kv)}
    if len(dtypes) > 1:
        raise ValueError(f"fused_mla.decode_attention: q_nope, q_pe, w_uk, w_uv, kv must share one dtype (got "
                         f"{sorted(map(str, dtypes))})")
    if not all(map(_dot_dim, (config or CONFIG)[:2])):
        raise ValueError(f"fused_mla.decode_attention: config {config}: BLOCK_S and CHUNK must be powers of two ≥ 16")
    return _mla_op(q_nope, q_pe, w_uk, w_uv, kv, table, positions.reshape(-1), float(scale), list(config or CONFIG))
