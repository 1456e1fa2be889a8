"""Paged attention of a padded batch straight from a K/V cache: the drafter's decode and extend attention without
gathering each sequence's key window first.

:func:`splitspec.models.layers.attend_padded` takes K/V as [B, S, hk, D] windows, so its caller gathers
``cache[table]`` (a copy of the whole window) and its matrix products copy the permuted window again into a
contiguous operand. :func:`attend_paged` reads the cache rows through the row table instead (paged attention, Kwon et
al. 2023, arXiv:2309.06180) and reads only the rows some query can see:

    out[b, i, h] = Σ_{j ≤ p(b, i)} softmax_j(scale · q[b, i, h] · k[table[b, j], h // g]) · v[table[b, j], h // g]

with p(b, i) the query's position and g = hq / hk query heads per K/V head (grouped-query attention; K/V never
expanded to hq heads). The softmax is computed online in float32 over blocks of keys (FlashAttention-2, Dao 2023,
arXiv:2307.08691), in base 2 with log2(e) folded into the scale.

Programs: one per (sequence b, K/V head, block of at most :data:`MAX_BLOCK_M` of its g·n query rows, share of the
keys). A program holds its query rows [BLOCK_M, D] (rows ordered token-major: row r is token r // g, head
kh·g + r % g), then walks keys 0 … min(max position of its rows + 1, S) − 1 of its share in blocks of BLOCK_N: the
block's cache rows from ``table``, K and V rows of its head from the cache (D contiguous values each), scores by one
tensor-core product, masked (key j visible to a query at position p iff j ≤ p), the running max, sum and output
rescaled. Rows past every query's position are never read, whatever they hold (stale drafts, the scratch row of
padding). With one share the program normalises and writes the output; with several (split-K, "flash-decoding":
few sequences × heads for the GPU's SMs and a long window, :func:`split_count`) each writes its unnormalised output,
max and sum in float32 and :func:`_combine` merges the shares.

Bytes per forward, W = B·S·hk·D·(dtype size) the window of K (or of V): the gather reads and writes each of them
(2W each), the matmuls' contiguous copies read and write them again (2W each) and the products read them (W each),
up to 10W in all; here K and V are read once, and only up to each sequence's last position (the window S is a power
of two ≥ 256 above it): 2W · (rows read / S), plus those rows' table entries (8 bytes each) and, when split, the
shares' float32 partials (B·hk·splits·rows·(BLOCK_D + 2)·4 bytes, written and read).

The Llama drafter uses it (:class:`splitspec.models.drafter.DrafterModel`). The MLA caches (the target's and an MLA
drafter's) use its latent form, :func:`attend_latent`: one cache "head" whose rows are the latent (512 values for
Kimi-K2) then the rope key (64), every query head reading it (g = heads), the value the row's latent part. The program
loads a block of rows once and uses it for the scores (latent and rope parts as two products into one accumulator)
and for the value product. Its rows per program and its key shares are fixed (:data:`LATENT_BLOCK_M`,
:data:`LATENT_SPLIT_KEYS`), so a query's arithmetic is the same whatever the batch, the tokens per sequence and the
window: the target's verify of k + 1 tokens gives each token the bits a one-token decode gives it. Against the
gathered window (``kv[table]``, then two batched products and a softmax) it reads the window's rows once instead of
writing and re-reading a copy of it, which at long windows outweighs the layer's weights (Kimi-K2 at TP8: a 4096-key
window of 16 sequences is 75 MB per layer, the layer's weights ~150 MB).

Tensors are CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (Triton's interpreter, which the tests use; it
takes bf16 tiles for raw integers in products, so there and for float32 inputs the products run in float32, the
probabilities rounded to V's dtype as on the GPU). The launch needs no host synchronisation and its shapes follow the
inputs' (CUDA-graph capturable).
"""

from __future__ import annotations

import os

import torch

from splitspec.models.fused_moe import available, jit, on_device, tl, triton

#: (BLOCK_N keys per step, num_warps, num_stages) of :func:`_attend` on a GPU: a starting point, not yet swept
#: (bench/lab/draft_profile.py measures the draft phase around it).
CONFIG = (64, 4, 2)
#: Query rows per program at most (g·n rows of a (sequence, K/V head) above it take several programs).
MAX_BLOCK_M = 64
#: Keys per share at least, when the keys are split over programs.
MIN_SPLIT_KEYS = 256
#: (BLOCK_N keys per step, num_warps, num_stages) of :func:`attend_latent`: a starting point, not yet swept.
LATENT_CONFIG = (32, 4, 2)
#: Query rows per program of :func:`attend_latent`, whatever the batch (16: the smallest tensor-core tile).
LATENT_BLOCK_M = 16
#: Keys per share of :func:`attend_latent`, whatever the window (a multiple of every BLOCK_N used).
LATENT_SPLIT_KEYS = 256
#: Dtypes :func:`serves` takes the kernel for (float32 stays on the matmul path: tensor cores would round it to tf32).
DTYPES = (torch.bfloat16, torch.float16)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` with activations of ``dtype`` attends through :func:`attend_paged`."""
    return torch.device(device).type == "cuda" and dtype in DTYPES and available()


@jit
def _attend(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr, part_ptr, m_ptr, l_ptr,
            sq_b, sq_n, sq_h, sk_r, sk_h, sv_r, sv_h, so_b, so_n, so_h, n, S, HK, chunk, qk_scale,
            G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            SPLIT: tl.constexpr, F32: tl.constexpr, R: tl.constexpr):
    """R = 0: K and V rows of D values each. R > 0 (latent form, :func:`attend_latent`): a K row is D latent values
    then R rope values, q's rows likewise, and V is the K row's first D values (read once, used twice)."""
    bh, mb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kh = bh // HK, bh % HK
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)  # query row: token r // G, head kh·G + r % G
    rmask = r < G * n
    t, head = r // G, kh * G + r % G
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    pos = tl.load(pos_ptr + b * n + t, mask=rmask, other=0)
    q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_n + head[:, None] * sq_h + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if R > 0:
        e = D + tl.arange(0, R)
        qr = tl.load(q_ptr + b * sq_b + t[:, None] * sq_n + head[:, None] * sq_h + e[None, :], mask=rmask[:, None], other=0.0)
    if F32:
        q = q.to(tl.float32)
        if R > 0:
            qr = qr.to(tl.float32)
    lo = sp * chunk
    hi = tl.minimum(tl.minimum(tl.max(pos, axis=0) + 1, S), lo + chunk).to(tl.int32)  # no query sees keys ≥ hi
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jmask = j < hi
        rows = tl.load(table_ptr + b * S + j, mask=jmask, other=0)
        kvmask = jmask[:, None] if BLOCK_D == D else jmask[:, None] & dmask[None, :]  # one mask per row: 16-byte loads
        k = tl.load(k_ptr + rows[:, None] * sk_r + kh * sk_h + d[None, :], mask=kvmask, other=0.0)
        if R > 0:
            v = k
            kr = tl.load(k_ptr + rows[:, None] * sk_r + kh * sk_h + e[None, :], mask=jmask[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + rows[:, None] * sv_r + kh * sv_h + d[None, :], mask=kvmask, other=0.0)
        if F32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            if R > 0:
                s = tl.dot(qr, tl.trans(kr.to(tl.float32)), s, input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
            if R > 0:
                s = tl.dot(qr, tl.trans(kr), s)
        s = tl.where((j[None, :] <= pos[:, None]) & jmask[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: p = 0, not NaN
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if F32:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_ptr.dtype.element_ty), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if SPLIT:  # this share's unnormalised output, max and sum: [B·HK, splits, rows, BLOCK_D] and [B·HK, splits, rows]
        at = (bh * tl.num_programs(2) + sp) * (tl.num_programs(1) * BLOCK_M) + r
        tl.store(part_ptr + at[:, None] * BLOCK_D + d[None, :], acc)
        tl.store(m_ptr + at, m_i)
        tl.store(l_ptr + at, l_i)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * so_b + t[:, None] * so_n + head[:, None] * so_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


@jit
def _combine(part_ptr, m_ptr, l_ptr, out_ptr, so_b, so_n, so_h, n, HK, SPLITS, G: tl.constexpr, D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the shares of one (sequence, K/V head, block of query rows): Σ 2^(m_s − m) acc_s / Σ 2^(m_s − m) l_s."""
    bh, mb = tl.program_id(0), tl.program_id(1)
    b, kh = bh // HK, bh % HK
    rows = tl.num_programs(1) * BLOCK_M
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < G * n
    t, head = r // G, kh * G + r % G
    d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(m_ptr + (bh * SPLITS + s) * rows + r))
    m = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(SPLITS):
        at = (bh * SPLITS + s) * rows + r
        w = tl.exp2(tl.load(m_ptr + at) - m)
        l_sum += w * tl.load(l_ptr + at)
        acc += w[:, None] * tl.load(part_ptr + at[:, None] * BLOCK_D + d[None, :])
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(out_ptr + b * so_b + t[:, None] * so_n + head[:, None] * so_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (d < D)[None, :])


def split_count(splits: int, programs: int, S: int, block_n: int, device: torch.device) -> int:
    """Key shares per (sequence, head, query block): ``splits`` when positive, else enough for about one program per
    SM (none on the CPU), each share at least :data:`MIN_SPLIT_KEYS` keys; at most one per key block."""
    if splits <= 0:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        splits = min(-(-S // MIN_SPLIT_KEYS), max(1, sms // max(programs, 1)))
    return max(1, min(splits, -(-S // block_n)))


@torch.library.custom_op("splitspec::paged_attention", mutates_args=())
def _paged_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
              scale: float, splits: int, block_n: int, rope: int) -> torch.Tensor:
    with on_device(q):
        B, n, hq, D = q.shape
        D -= rope
        S, hk = table.shape[1], k_cache.shape[1]
        G = hq // hk
        k_cache, v_cache = (c if c.stride(-1) == 1 else c.contiguous() for c in (k_cache, v_cache))
        q = q if q.stride(-1) == 1 else q.contiguous()
        table, positions = table.contiguous(), positions.contiguous()
        out = torch.empty(B, n, hq, D, dtype=q.dtype, device=q.device)
        block_d = max(16, triton.next_power_of_2(D))
        if rope:  # every query row's arithmetic independent of n, B and S: fixed rows per program, fixed key shares
            block_m, chunk = LATENT_BLOCK_M, LATENT_SPLIT_KEYS
            mblocks, splits = triton.cdiv(G * n, block_m), triton.cdiv(S, chunk)
            _, warps, stages = LATENT_CONFIG
        else:
            block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(G * n)))
            mblocks = triton.cdiv(G * n, block_m)
            splits = split_count(splits, B * hk * mblocks, S, block_n, q.device)
            chunk = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
            splits = triton.cdiv(S, chunk)  # no share left empty by the rounding
            _, warps, stages = CONFIG
        f32 = q.dtype == torch.float32 or not q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
        if splits > 1:
            part = torch.empty(B * hk, splits, mblocks * block_m, block_d, dtype=torch.float32, device=q.device)
            m, l_sum = (torch.empty(B * hk, splits, mblocks * block_m, dtype=torch.float32, device=q.device) for _ in range(2))
        else:
            part = m = l_sum = out  # unused pointers
        _attend[(B * hk, mblocks, splits)](q, k_cache, v_cache, table, positions, out, part, m, l_sum,
                                           q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
                                           v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
                                           out.stride(2), n, S, hk, chunk, scale * 1.4426950408889634, G=G, D=D,
                                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=splits > 1, F32=f32,
                                           R=rope, num_warps=warps, num_stages=stages)
        if splits > 1:
            _combine[(B * hk, mblocks)](part, m, l_sum, out, out.stride(0), out.stride(1), out.stride(2), n, hk, splits,
                                        G=G, D=D, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4)
        return out


@_paged_op.register_fake
def _(q, k_cache, v_cache, table, positions, scale, splits, block_n, rope):
    return q.new_empty(*q.shape[:-1], q.shape[-1] - rope)


def attend_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                 positions: torch.Tensor, scale: float, splits: int = 0, block_n: int | None = None) -> torch.Tensor:
    """Causal attention of B sequences' n new queries each over their cached keys, read through the row table.

    q: [B, n, hq, D] (bf16, fp16 or float32) at positions [B, n] int64; k_cache, v_cache: [rows, hk, D] in q's dtype
    (hq a multiple of hk); table: [B, S] int64, the cache row of each position 0..S−1 of each sequence. Key j is
    visible to a query at position p iff j ≤ p (every position < S); cache rows past a sequence's last query are not
    read. ``scale``: the scores' factor (D^−½). ``splits``: key shares per (sequence, head) (0: :func:`split_count`
    picks); ``block_n``: keys per step (default :data:`CONFIG`'s). Returns [B, n, hq, D] in q's dtype: the formula of
    the module docstring, softmax in float32, which :func:`splitspec.models.layers.attend_padded` computes from the
    gathered windows (it rounds the scores to q's dtype first). Raises ValueError for mismatched shapes or dtypes.
    """
    B, n, hq, D = q.shape
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[2] != D or hq % k_cache.shape[1]:
        raise ValueError(f"attend_paged: K/V caches {list(k_cache.shape)} and {list(v_cache.shape)}, expected equal "
                         f"[rows, hk, {D}] with hk dividing {hq} query heads")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"attend_paged: q is {q.dtype}, K/V caches {k_cache.dtype} and {v_cache.dtype}, expected one dtype")
    if table.dim() != 2 or table.shape[0] != B or table.shape[1] == 0 or tuple(positions.shape) != (B, n):
        raise ValueError(f"attend_paged: table {list(table.shape)} and positions {list(positions.shape)}, "
                         f"expected [{B}, S ≥ 1] and [{B}, {n}] for q {list(q.shape)}")
    return _paged_op(q, k_cache, v_cache, table, positions, float(scale), int(splits), int(block_n or CONFIG[0]), 0)


def latent_fits(latent: int, rope: int) -> bool:
    """Whether :func:`attend_latent` takes latent rows of ``latent`` values and rope keys of ``rope``: powers of two,
    both ≥ 16 (each part is a tensor-core product over its values, which needs at least 16 of them)."""
    return all(v >= 16 and not v & (v - 1) for v in (latent, rope))


def latent_serves(device: torch.device, dtype: torch.dtype, cfg) -> bool:
    """Whether an MLA model on ``device`` with activations of ``dtype`` and config ``cfg`` (kv_lora_rank,
    qk_rope_head_dim) attends through :func:`attend_latent`: where :func:`serves` and :func:`latent_fits` say so."""
    return serves(device, dtype) and latent_fits(cfg.kv_lora_rank, cfg.qk_rope_head_dim)


def attend_latent(q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, scale: float,
                  latent: int, block_n: int | None = None) -> torch.Tensor:
    """Absorbed multi-head latent attention (DeepSeek-V2/V3 MLA decode form) of B sequences' n new queries each over
    their latent cache rows, read through the row table:

        out[b, i, h] = Σ_{j ≤ p(b, i)} softmax_j(scale · q[b, i, h] · c[table[b, j]]) · c[table[b, j], :latent]

    q: [B, n, heads, latent + rope] (the absorbed q_nope · W_UK, then the rotated q_pe) in bf16, fp16 or float32;
    cache: [rows, latent + rope] in q's dtype (the normalised latent, then the rotated rope key, per row); table [B, S]
    int64, positions [B, n] int64 as for :func:`attend_paged`. Returns [B, n, heads, latent] in q's dtype, softmax in
    float32; what :func:`splitspec.models.layers.attend_padded` computes from the gathered window with one K/V head
    (K = the whole row, V its first ``latent`` values), without the gather: each cache row is read once per program,
    for the scores and the value product both. ``latent`` and the rope width: powers of two ≥ 16 (:func:`latent_fits`;
    Kimi-K2: 512 and 64).

    A query row's arithmetic does not depend on the batch: :data:`LATENT_BLOCK_M` rows per program and key shares of
    :data:`LATENT_SPLIT_KEYS` whatever B, n and S, so a token verified among k others gets the bits it gets decoded
    alone (the target's lossless speculation). The caller keeps every table entry a row of ``cache`` and every
    position in 0 … S − 1 (not checked here: that would wait for the device; the engine's row tables and positions
    are built so). Raises ValueError for mismatched shapes, dtypes or block size."""
    if q.dim() != 4 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"attend_latent: q {list(q.shape)} {q.dtype}, expected [B, n, heads, latent + rope] in "
                         "bf16, fp16 or float32")
    B, n, hq, width = q.shape
    if not latent_fits(latent, width - latent):
        raise ValueError(f"attend_latent: q rows of {width} = latent {latent} + rope {width - latent}, expected "
                         "both powers of two ≥ 16")
    if cache.dim() != 2 or cache.shape[1] != width or cache.dtype != q.dtype:
        raise ValueError(f"attend_latent: cache {list(cache.shape)} {cache.dtype}, expected [rows, {width}] {q.dtype}")
    if (table.dim() != 2 or table.shape[0] != B or table.shape[1] == 0 or tuple(positions.shape) != (B, n)
            or table.dtype not in (torch.int64, torch.int32) or positions.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"attend_latent: table {list(table.shape)} {table.dtype} and positions {list(positions.shape)} "
                         f"{positions.dtype}, expected [{B}, S ≥ 1] and [{B}, {n}] integers for q {list(q.shape)}")
    block_n = int(block_n or LATENT_CONFIG[0])
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"attend_latent: block_n {block_n}, expected a power of two ≥ 16")
    rows = cache[:, None, :]
    return _paged_op(q, rows, rows, table, positions, float(scale), 0, block_n, width - latent)
