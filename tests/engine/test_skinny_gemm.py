"""The skinny-GEMM kernel (splitspec.models.skinny_gemm) against float64 products in torch: plain, with SwiGLU's
silu · up, with the RMSNorm prologue with and without the residual add, both ways of multiplying, ragged N and K
(several row blocks, a partial last row block and K step), every token count; each token's product the same alone
and among others; on CPU through Triton's interpreter (the bits a GPU gives: tests/gpu/test_gpu_skinny_gemm.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec.models import skinny_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, K, EPS = 40, 100, 1e-6  # 40 rows in blocks of 16: a partial third block; K = 100 in steps of 32: a partial fourth
CONFIGS = {"fma": (16, 32, 1, 1, 0), "fma-narrow": (8, 64, 1, 1, 0), "dot": (16, 32, 1, 1, 1)}


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(DEVICE)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 output (relative 2⁻⁸) of float32 sums: within 2 % of the reference's scale."""
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    err = (got.double().cpu() - want.cpu()).abs().max().item()
    assert err <= 0.02 * want.abs().max().item(), err


def same_add(got: torch.Tensor, want: torch.Tensor) -> None:
    """The kernel's bf16 add equals torch's on a GPU; the interpreter rounds float32 → bf16 towards zero: one ulp."""
    if DEVICE == "cuda":
        assert torch.equal(got, want)
    else:
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2.0 ** -7).all()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 8])
def test_plain_and_act(T, config):
    w = rand(N, K, seed=1, scale=K ** -0.5)
    x = rand(T, K, seed=2)
    close(skinny_gemm.launch(x, w, config=config)[0], x.double() @ w.double().T)
    gu = rand(T, 2 * K, seed=3)
    gate, up = gu.double().chunk(2, -1)
    close(skinny_gemm.launch(gu, w, act=True, config=config)[0], (torch.nn.functional.silu(gate) * up) @ w.double().T)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("eps", [EPS, 0.5])
def test_norm_prologue(residual, config, eps):
    """Residual and norm weight strided (rows of wider tensors, every second element); eps 0.5 against mean squares
    of ~0.2 (scale 0.3), so that a dropped eps shows."""
    T = 5
    w, g = rand(N, K, seed=4, scale=K ** -0.5), (rand(2 * K, seed=5) + 1)[::2]
    scale = 3.0 if eps == EPS else 0.3
    x, r = rand(T, K, seed=6, scale=scale), rand(T, 2 * K, seed=7, scale=scale)[:, :K] if residual else None
    y, h = skinny_gemm.launch(x, w, r, g, eps, config=config)
    s = x.double() + (r.double() if residual else 0)
    want = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * g.double()
    close(y, want @ w.double().T)
    if residual:  # the new residual, written once in all, as the engine's bf16 add
        same_add(h, x + r)
    else:
        assert h is None


def test_custom_ops_and_bad_input(monkeypatch):
    """The ops the engine calls (and norm_linear without residual returns x itself), and one-line errors."""
    monkeypatch.setattr(skinny_gemm, "CONFIGS", {})  # the default configuration for this small shape
    w, g = rand(N, K, seed=8, scale=K ** -0.5), rand(K, seed=9) + 1
    x, r = rand(2, K, seed=10), rand(2, K, seed=11)
    y, h = skinny_gemm.norm_linear(x, r, g, w, EPS)
    same_add(h, x + r)
    assert y.shape == (2, N)
    y0, h0 = skinny_gemm.norm_linear(x, None, g, w, EPS)
    assert h0 is x and y0.shape == (2, N)
    close(skinny_gemm.linear(x, w), x.double() @ w.double().T)
    bad = [(dict(x=rand(2, K + 1, seed=12)), r"x \(2, 101\) against weight \(40, 100\)"),
           (dict(x=rand(9, K, seed=13)), "9 tokens, expected 1 … 8"),
           (dict(x=rand(K, seed=13)), r"x \(100,\), weight \(40, 100\): expected \[T, K\] and \[N, K\]"),
           (dict(residual=r[:1]), r"residual \(1, 100\), expected \(2, 100\)"),
           (dict(residual=r, norm_weight=g[:90]), r"norm_weight \(90,\), expected \(100,\)"),
           (dict(config=(8, 32, 1, 1, 1)), "both ≥ 16 for dot"), (dict(config=(16, 8, 1, 1, 1)), "both ≥ 16 for dot"),
           (dict(config=(12, 32, 1, 1, 0)), "powers of two"), (dict(config=(16, 32, 1, 1, 2)), "form 0 or 1"),
           (dict(config=(16, 32, 1, 1)), r"config \(16, 32, 1, 1\): expected")]
    for kw, message in bad:
        args = dict(x=x, w=w) | kw
        with pytest.raises(ValueError, match=message):
            skinny_gemm.launch(args.pop("x"), args.pop("w"), **args)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_token_alone_and_among_others(config):
    """Token i's product (with each prologue) from the T tokens together equals its product alone: nothing of one
    token reaches another's sums, whatever T (the order of the sums: on a GPU)."""
    w, g = rand(N, K, seed=14, scale=K ** -0.5), rand(K, seed=15) + 1
    x, r, gu = rand(8, K, seed=16), rand(8, K, seed=17), rand(8, 2 * K, seed=18)
    calls = {"plain": lambda a, b, c: skinny_gemm.launch(a, w, config=config),
             "add+norm": lambda a, b, c: skinny_gemm.launch(a, w, b, g, EPS, config=config),
             "act": lambda a, b, c: skinny_gemm.launch(c, w, act=True, config=config)}
    for name, call in calls.items():
        alone = torch.cat([call(x[i:i + 1], r[i:i + 1], gu[i:i + 1])[0] for i in range(8)])
        for T in range(2, 9):
            assert torch.equal(call(x[:T], r[:T], gu[:T])[0], alone[:T]), (name, T)


def test_classes(monkeypatch):
    assert skinny_gemm.shape_class(7168, 1024) == ("mid", "short")
    assert skinny_gemm.shape_class(2112, 7168) == ("narrow", "mid")
    assert skinny_gemm.shape_class(36864, 18432) == ("wide", "long")
    assert skinny_gemm.config_for(4608, 7168) == skinny_gemm.CONFIGS.get(("mid", "mid"), skinny_gemm.DEFAULT_CONFIG)
    assert not skinny_gemm.applies(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.bfloat16))  # CPU: never in the engine
    monkeypatch.setitem(skinny_gemm.CONFIGS, ("narrow", "short"), None)  # a class left to cuBLAS
    w = torch.zeros(40, 100, dtype=torch.bfloat16)
    assert skinny_gemm.config_for(40, 100) is None and not skinny_gemm.folds(w)
    with pytest.raises(ValueError, match=r"no configuration for weight \(40, 100\)"):
        skinny_gemm.launch(torch.zeros(1, 100, dtype=torch.bfloat16), w)
    monkeypatch.setitem(skinny_gemm.CONFIGS, ("narrow", "short"), (16, 32, 1, 1, skinny_gemm.DOT))
    assert skinny_gemm.config_for(40, 100) == (16, 32, 1, 1, 1) and not skinny_gemm.folds(w)


@pytest.mark.parametrize("form", ["fma", "dot"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_target_layers_with_the_kernel(monkeypatch, tokens, form):
    """A small bf16 target's dense and MoE layers (padded form) with skinny_gemm on — forced on for CPU tensors —
    against the same layers off: the same residual streams and partial sums up to bf16 rounding, and the kernel took
    the products it should, alike for one token and three: in multiply-add configurations norm + add in fused_qkv_a
    and a dense w13, the q_a norm in q_b_proj, silu · up in every w2; in dot configurations the plain products; the
    shared expert outside the fused expert kernels either way."""
    import dataclasses

    from splitspec.build.synthetic import kimi_k2_target
    from splitspec.config import Mapping
    from splitspec.models.batch import padded
    from splitspec.models.layers import TPComm
    from splitspec.models.shapes import random_weights, target_shapes
    from splitspec.models.target import TargetKVCache, TargetModel

    cfg = dataclasses.replace(kimi_k2_target(2), vocab_size=64, hidden_size=96, intermediate_size=80, moe_intermediate_size=24,
                              num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              rope=dataclasses.replace(kimi_k2_target(2).rope, dim=8))
    w = random_weights(target_shapes(cfg, Mapping(1)), torch.bfloat16, DEVICE, seed=0)
    model = TargetModel(cfg, Mapping(1), 0, w, TPComm(), skinny_gemm=True)
    cache = TargetKVCache(cfg, 64, torch.bfloat16, DEVICE)
    batch = padded([(list(range(16)), 5, [1] * tokens)], 16, DEVICE, scratch_row=40)
    cos, sin = model.rotary.cos_sin(batch.positions)
    h, pending = rand(tokens, 96, seed=20), rand(tokens, 96, seed=21)
    calls = []
    launch = skinny_gemm.launch
    monkeypatch.setattr(skinny_gemm, "CONFIGS", {})  # one form for the small shapes' classes
    if form == "dot":
        monkeypatch.setattr(skinny_gemm, "DEFAULT_CONFIG", CONFIGS["dot"])
    monkeypatch.setattr(skinny_gemm, "launch", lambda x, w, r=None, g=None, eps=0.0, act=False: calls.append(
        (tuple(w.shape), r is not None, g is not None, act)) or launch(x, w, r, g, eps, act))

    def layers(on: bool):
        model.skinny_gemm = on
        with monkeypatch.context() as m:
            m.setattr(skinny_gemm, "applies", lambda x, w: x.shape[0] <= skinny_gemm.MAX_TOKENS and w.dtype == torch.bfloat16)
            return [model.block(layer, h, pending, batch, cache, cos, sin) for layer in (0, 1)]

    off, on = layers(False), layers(True)
    for (h_off, out_off), (h_on, out_on) in zip(off, on):  # h after a layer holds its attention's (rounded) output
        close(h_on, h_off.double())
        close(out_on, out_off.double())
    fold = form == "fma"  # norms, adds and silu · up inside the products
    shape = {name: w[f"layers.{layer}.{name}"].shape for layer, names in ((0, ("attn.fused_qkv_a", "attn.q_b_proj",
             "attn.o_proj", "mlp.w13", "mlp.w2")), (1, ("mlp.shared.w13", "mlp.shared.w2"))) for name in names}
    attn = [(shape["attn.fused_qkv_a"], fold, fold, False), (shape["attn.q_b_proj"], False, fold, False),
            (shape["attn.o_proj"], False, False, False)]
    dense = [(shape["mlp.w13"], fold, fold, False), (shape["mlp.w2"], False, False, fold)]
    shared = [(shape["mlp.shared.w13"], False, False, False), (shape["mlp.shared.w2"], False, False, fold)]
    assert calls == attn + dense + attn + shared
