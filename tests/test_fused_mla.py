"""The fused MLA decode attention (splitspec.fused_mla) against the unfused path (w_uk einsum, attend_padded,
w_uv einsum) and against a float64 loop; on CPU through Triton's interpreter, on CUDA where there is one."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec import fused_mla  # noqa: E402
from splitspec.layers import attend_padded  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, DN, C, R, V = 4, 32, 64, 16, 32  # heads, nope, latent, rope, value dims (powers of two, as the kernel needs)
ROWS, S = 120, 40  # cache rows; window (not a multiple of BLOCK_S)
SMALL = (16, 16, 4, 1)  # BLOCK_S 16 (3 window blocks, the last ragged), chunks of 16 rows of W_UK / W_UV


def problem(B: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = B * n
    q_nope = torch.randn(T, H, DN + R, generator=g)[..., :DN]  # a view with a wider row stride, as in the engine
    q_pe = torch.randn(T, H, R, generator=g)
    w_uk = torch.randn(H, DN, C, generator=g) / DN ** 0.5
    w_uv = torch.randn(H, V, C, generator=g) / C ** 0.5
    kv = torch.randn(ROWS, C + R, generator=g)
    table = torch.randperm(ROWS, generator=g)[: B * S].view(B, S)  # scattered cache rows, disjoint sequences
    last = torch.randint(n - 1, S, (B,), generator=g)  # each sequence's last new position ≤ S − 1
    positions = last[:, None] - n + 1 + torch.arange(n)[None, :]
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return (cast(q_nope), cast(q_pe), cast(w_uk), cast(w_uv), cast(kv), table.to(DEVICE), positions.to(DEVICE))


def unfused(q_nope, q_pe, w_uk, w_uv, kv, table, positions, scale):
    """The engine's padded path (TargetModel.attention_half before its o_proj)."""
    B, n = positions.shape
    q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)
    q_cat = torch.cat((q_lat, q_pe), -1)
    k = kv[table][:, :, None, :]
    out = attend_padded(q_cat.view(B, n, H, -1), k, k[..., :C], positions, scale).reshape(B * n, H, -1)
    return torch.einsum("thc,hvc->thv", out, w_uv)


def loop_reference(q_nope, q_pe, w_uk, w_uv, kv, table, positions, scale):
    """Per query and head in float64: softmax over the window positions ≤ the query's of the absorbed scores."""
    B, n = positions.shape
    q_nope, q_pe, w_uk, w_uv, kv = (t.double().cpu() for t in (q_nope, q_pe, w_uk, w_uv, kv))
    out = torch.zeros(B * n, H, V, dtype=torch.float64)
    for b in range(B):
        keys = kv[table[b].cpu()]
        for i in range(n):
            t, p = b * n + i, int(positions[b, i])
            for h in range(H):
                s = (keys[: p + 1, :C] @ (q_nope[t, h] @ w_uk[h]) + keys[: p + 1, C:] @ q_pe[t, h]) * scale
                out[t, h] = w_uv[h] @ (s.softmax(0) @ keys[: p + 1, :C])
    return out


@pytest.mark.parametrize("B,n", [(1, 1), (2, 3), (3, 6)])
def test_float32_matches_float64_loop_and_unfused_path(B, n):
    args = problem(B, n, torch.float32, seed=B * 10 + n)
    got = fused_mla.decode_attention(*args, scale=0.3, config=SMALL)
    assert got.shape == (B * n, H, V) and got.dtype == torch.float32
    ref = loop_reference(*args, scale=0.3)
    assert (got.double().cpu() - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    assert (got - unfused(*args, scale=0.3)).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_keys_past_a_query_are_never_read():
    """Rows of the window past every query's position (stale rejected drafts) change nothing, even as NaN."""
    q_nope, q_pe, w_uk, w_uv, kv, table, positions = problem(2, 3, torch.float32, seed=7)
    before = fused_mla.decode_attention(q_nope, q_pe, w_uk, w_uv, kv, table, positions, 0.3, config=SMALL)
    kv = kv.clone()
    for b in range(2):
        kv[table[b, int(positions[b].max()) + 1:]] = float("nan")
    after = fused_mla.decode_attention(q_nope, q_pe, w_uk, w_uv, kv, table, positions, 0.3, config=SMALL)
    assert torch.equal(before, after)


def test_bfloat16_rounds_where_the_unfused_path_rounds():
    """bf16 operands, float32 sums: within bf16 rounding of the unfused bf16 path and of the float64 loop."""
    args = problem(2, 4, torch.bfloat16, seed=3)
    got = fused_mla.decode_attention(*args, scale=0.3, config=SMALL).float()
    ref = loop_reference(*args, scale=0.3).float()
    assert (got.cpu() - ref).abs().max().item() < 0.03 * ref.abs().max().item()
    assert (got - unfused(*args, scale=0.3).float()).abs().max().item() < 0.03 * ref.abs().max().item()


def test_bad_shapes_get_a_clear_error():
    q_nope, q_pe, w_uk, w_uv, kv, table, positions = problem(2, 3, torch.float32)
    with pytest.raises(ValueError, match="w_uk has shape"):
        fused_mla.decode_attention(q_nope, q_pe, w_uk[:, :8], w_uv, kv, table, positions, 0.3)
    with pytest.raises(ValueError, match="powers of two"):
        fused_mla.decode_attention(q_nope, q_pe[..., :12], w_uk, w_uv, kv[:, :C + 12], table, positions, 0.3)
    with pytest.raises(ValueError, match="multiple"):
        fused_mla.decode_attention(q_nope[:5], q_pe[:5], w_uk, w_uv, kv, table, positions.flatten()[:5], 0.3)
    with pytest.raises(ValueError, match="one dtype"):
        fused_mla.decode_attention(q_nope, q_pe, w_uk.double(), w_uv, kv, table, positions, 0.3)
    with pytest.raises(ValueError, match="table must be"):
        fused_mla.decode_attention(q_nope, q_pe, w_uk, w_uv, kv, table[0], positions, 0.3)
    with pytest.raises(ValueError, match="BLOCK_S and CHUNK"):
        fused_mla.decode_attention(q_nope, q_pe, w_uk, w_uv, kv, table, positions, 0.3, config=(8, 16, 4, 1))


def test_use_fused_rule(monkeypatch):
    """On when enabled, for CUDA tensors of few sequences, short windows and power-of-two dims ≥ 16 (CUDA faked)."""
    class Faked(torch.Tensor):
        is_cuda = True

    def q(T, d=DN):
        return torch.empty(T, H, d).as_subclass(Faked)

    def table(B, S=64):
        return torch.zeros(B, S, dtype=torch.int64)

    q_pe, w_uv, most = torch.empty(4, H, R), torch.empty(H, V, C), fused_mla.MAX_SEQUENCES
    monkeypatch.setattr(fused_mla, "ENABLED", True)
    assert fused_mla.use_fused(q(4), q_pe, w_uv, table(1))
    assert fused_mla.use_fused(q(16 * most), q_pe, w_uv, table(most, fused_mla.MAX_WINDOW))
    assert not fused_mla.use_fused(q(16 * most + 16), q_pe, w_uv, table(most + 1))  # too many sequences
    assert not fused_mla.use_fused(q(4), q_pe, w_uv, table(1, fused_mla.MAX_WINDOW * 2))  # too long a window
    assert not fused_mla.use_fused(q(17), q_pe, w_uv, table(1))  # more than 16 new tokens per sequence
    assert not fused_mla.use_fused(q(4, 24), q_pe, w_uv, table(1))  # not a power of two
    assert not fused_mla.use_fused(q(4), torch.empty(4, H, 8), w_uv, table(1))  # below tl.dot's 16
    assert not fused_mla.use_fused(torch.empty(4, H, DN), q_pe, w_uv, table(1))  # CPU tensors: the unfused path
    monkeypatch.setattr(fused_mla, "ENABLED", False)
    assert not fused_mla.use_fused(q(4), q_pe, w_uv, table(1))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the CPU demo engine through Triton's interpreter")
def test_padded_target_forward_with_the_kernel(engines_for):
    """The demo target (TP1) over a padded verify batch — 3 sequences of 3 new tokens, one padding sequence —
    through the kernel (forced on for CPU tensors) gives the unfused path's logits."""
    from unittest.mock import patch

    from splitspec.engine import Group
    from splitspec.models.batch import ForwardBatch, padded, single_blocks

    group = Group(engines_for(1))
    r = group.rank0
    g = torch.Generator().manual_seed(0)
    blocks = [single_blocks(s, 64) for s in range(3)]
    prompts = [torch.randint(0, 4000, (n,), generator=g).tolist() for n in (9, 17, 5)]
    calls = []
    kernel = fused_mla.decode_attention
    spy = lambda *a, **kw: calls.append(1) or kernel(*a, **kw)  # noqa: E731
    try:
        with torch.inference_mode():
            r.target.forward(ForwardBatch.build([(b, 0, p[:-3]) for b, p in zip(blocks, prompts)], "all"), r.tcache)
            pb = padded([(b, len(p) - 3, p[-3:]) for b, p in zip(blocks, prompts)], window=32,
                        scratch_row=r.tcache.kv.shape[1] - 1, pad_to=4)
            unfused_logits, _ = r.target.forward(pb, r.tcache)
            with patch.object(fused_mla, "use_fused", lambda q_nope, q_pe, w_uv, table: table.shape[0] <= 4), \
                    patch.object(fused_mla, "decode_attention", spy):
                fused_logits, _ = r.target.forward(pb, r.tcache)
        layers = r.target.cfg.num_hidden_layers
    finally:
        group.close()
    assert len(calls) == layers
    assert (fused_logits[:9] - unfused_logits[:9]).abs().max().item() < 1e-4
    assert torch.equal(fused_logits[:9].argmax(-1), unfused_logits[:9].argmax(-1))
