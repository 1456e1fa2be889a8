"""The W4A16 MoE kernels (splitspec.models.int4_moe's decode variants, splitspec.models.grouped_moe's grouped ones)
against the experts computed in float64 from weights dequantised by hand here, and against the float fused kernels
on quant.dequantize_int4's weights; on CPU through Triton's interpreter, on CUDA where there is one. The PTX and
bitcast unpacking of the tensor-core variants cannot run in the interpreter (it runs them in float32): their
arithmetic is checked here in torch, bit for bit, and on the GPU by bench/lab/int4_moe_bench.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("Triton's interpreter is off: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported", pytrace=False)

from splitspec import quant
from splitspec.models import fused_moe, grouped_moe, int4_moe, int4_routed, int4_tiles
from splitspec.models.int4_moe import Kernel

# H and I multiples of the group (as the format requires) but not of every row block or K step; pairs of another
# rank (-1 and E).
T, H, I, E, TOP_K, G = 3, 96, 64, 5, 3, 32
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = {  # each: several row blocks, a partial K step (H = 96 in steps of 64 or 32), rows past H or I masked
    "fma": Kernel("fma", (32, 64, 1, 1, 1), (64, 32, 2, 1, 1)),
    "mma": Kernel("mma", (32, 64, 2, 1, 1), (64, 64, 4, 1, 1)),
    # gate_up's K split in two (partial sums, then _silu_mul), down's three slots in three programs (atomic adds)
    "mma_asm-split": Kernel("mma_asm", (16, 64, 1, 1, 2), (32, 64, 2, 1, 3)),
    # gate_up's K step of 128 (one, partial: H = 96) in two slices of 64 (a batched dot)
    "mma-slices": Kernel("mma", (16, 128, 2, 1, 1, 2), (16, 64, 1, 1, 1)),
    # down's slots side by side in one dot (form 1): 4 slot row blocks (3 used), rows past H masked
    "mma_asm-columns": Kernel("mma_asm", (32, 64, 2, 1, 1), (64, 64, 4, 1, 0, 1)),
    "grouped": Kernel("grouped", (16, 32, 64, 2, 1), (16, 64, 64, 4, 1)),
}


def by_hand(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [..., N, K]: column 8w + j of row n = (((packed[n, w] >> 4j) & 15) − 8) · scale[n, (8w + j) // G],
    one Python integer at a time (no library unpacking)."""
    p, s = packed.reshape(-1, packed.shape[-1]).tolist(), scale.double().reshape(-1, scale.shape[-1])
    out = torch.zeros(len(p), packed.shape[-1] * 8, dtype=torch.float64)
    for n, row in enumerate(p):
        for w, word in enumerate(row):
            word &= 0xFFFFFFFF
            for j in range(8):
                out[n, 8 * w + j] = (((word >> (4 * j)) & 15) - 8) * s[n, (8 * w + j) // G]
    return out.reshape(*packed.shape[:-1], -1)


def problem(seed: int = 0):
    """A fresh problem: x [T, H] bf16, ids, routing weights, and INT4 experts with bf16 scales (as published)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    local = torch.tensor([[0, 4, 2], [-1, 1, 4], [3, 5, 0]])
    weights = torch.rand(T, TOP_K, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    q13 = [quant.quantize_int4(w13[e], G) for e in range(E)]
    q2 = [quant.quantize_int4(w2[e], G) for e in range(E)]
    stack = lambda qs, i: torch.stack([q[i] for q in qs])  # noqa: E731
    return x, local, weights, stack(q13, 0), stack(q13, 1).bfloat16(), stack(q2, 0), stack(q2, 1).bfloat16()


def reference(x, local, weights, w13, w2) -> torch.Tensor:
    x = x.double()
    y = torch.zeros_like(x)
    for t in range(T):
        for j in range(TOP_K):
            e = int(local[t, j])
            if 0 <= e < E:
                gate, up = (w13[e] @ x[t]).chunk(2)
                y[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return y


def run(kernel: Kernel, *args) -> torch.Tensor:
    args = [t.to(DEVICE) for t in args]
    if kernel.variant in grouped_moe.GROUPED_VARIANTS:
        return grouped_moe.int4_grouped_experts(*args, group=G, kernel=kernel).cpu()
    return int4_moe.int4_experts(*args, group=G, kernel=kernel).cpu()


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_match_hand_dequantised_float64(name):
    """Exact weights, bf16 x: what is left is the float32 sums and the bf16 output's rounding (on the GPU the tensor
    cores also round the weights and activations to bf16: bench/lab/int4_moe_bench.py checks those)."""
    x, local, weights, p13, s13, p2, s2 = problem(seed=sorted(KERNELS).index(name))
    ref = reference(x, local, weights, by_hand(p13, s13), by_hand(p2, s2))
    out = run(KERNELS[name], x, local, weights, p13, s13, p2, s2)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    err = (out.double() - ref).abs()
    if DEVICE == "cpu":  # one bf16 ulp per element (the interpreter truncates)
        tol = 2 ** -7 * ref.abs() + 1e-4 * ref.abs().max()
        assert (err <= tol).all(), (err / tol).max()
    else:  # tensor cores round the activations between the projections to bf16: bf16-operand error, not one ulp
        rel = (err.norm() / ref.norm()).item()
        assert rel < 1e-2 and err.max() < 2e-2 * ref.abs().max(), (rel, (err.max() / ref.abs().max()).item())
    assert out[1].abs().sum() > 0 and (ref[1] != 0).any()  # the token with another rank's pair still has its own


def test_fma_equals_the_float_kernels_on_dequantised_weights():
    x, local, weights, p13, s13, p2, s2 = problem(seed=7)
    x = x.float()
    w13 = torch.stack([quant.dequantize_int4(p13[e], s13[e], H, G, torch.float32) for e in range(E)])
    w2 = torch.stack([quant.dequantize_int4(p2[e], s2[e], I, G, torch.float32) for e in range(E)])
    want = fused_moe.fused_experts(*[t.to(DEVICE) for t in (x, local, weights, w13, w2)]).cpu()
    got = run(KERNELS["fma"], x, local, weights, p13, s13, p2, s2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 both: only the order of the sums differs


@pytest.mark.parametrize("j", range(4))
def test_unpacking_constants_bit_for_bit(j):
    """The GPU unpacking, in torch on every 16-bit pattern: nibble j of an int16 OR 0x4300 is the bf16 128 + nibble,
    and 136 less is nibble − 8 (``mma``, dequant MODE 1); in ``mma_asm``'s PTX a 32-bit register holding two int16
    (one packed word) is shifted by 4j, masked with 0x000F000F and OR-ed with 0x43004300 (lop3's table 0xEA is
    (a & b) | c), giving both halves' nibble j as a bf16 pair, minus 136 by fma.bf16x2 with 1.0 = 0x3F80 and
    −136 = 0xC308. The int16 halves of word w are 2w (columns 8w..8w+3) and 2w + 1 (8w+4..8w+7), so the int16 tiles'
    nibble j at int16 index v stands for column 4v + j, where the kernels read x."""
    v = torch.arange(-2**15, 2**15, dtype=torch.int32)
    want = ((v >> (4 * j)) & 0xF) - 8
    magic = (((v >> (4 * j)) & 0xF) | 0x4300).to(torch.int16).view(torch.bfloat16)
    assert torch.equal(magic.float() - 136, want.float())
    words = (v[0::2] & 0xFFFF) | (v[1::2] << 16)  # two int16 per 32-bit register, the first in the low half
    lut = 0xEA
    assert lut == (0xF0 & 0xCC) | 0xAA
    pairs = (((words >> (4 * j)) & 0x000F000F) | 0x43004300).view(torch.bfloat16)
    assert torch.equal(pairs.float() * torch.tensor(0x3F80, dtype=torch.int16).view(torch.bfloat16).float()
                       + torch.tensor(0xC308 - 0x10000, dtype=torch.int16).view(torch.bfloat16).float(), want.float())
    assert f"shr.b32 t, $1, {4 * j};" in int4_tiles._asm(j) if j else "mov.b32 t, $1;" in int4_tiles._asm(j)
    assert all(c in int4_tiles._asm(j) for c in ("0x000F000F", "0x43004300", "0xEA", "0x3F803F80", "0xC308C308"))
    packed = torch.randint(-2**31, 2**31 - 1, (3, 4), dtype=torch.int32)
    cols = quant.unpack_int4(packed, 32)
    nib = ((packed.view(torch.int16).int() >> (4 * j)) & 0xF) - 8
    assert torch.equal(nib, cols[:, j::4])


DOWN_FORMS = {"loop": (32, 64, 2, 1, 1), "split": (32, 64, 2, 1, 3), "columns": (64, 64, 4, 1, 0, 1)}


def down_args(seed: int):
    """(act, ids, wts, p2, s2) on DEVICE for down_call, act from the problem's gate_up."""
    x, local, weights, p13, s13, p2, s2 = (t.to(DEVICE) for t in problem(seed=seed))
    ids, wts = local.int().contiguous(), weights.float().contiguous()
    act = int4_moe.gate_up_call(x, ids, p13, s13, G, "mma_asm", (16, 64, 1, 1, 1))
    return act, ids, wts, p2, s2


def test_split_kernels_leave_their_workspaces_zeroed_for_the_next_call(monkeypatch):
    """gate_up's K split (two programs a tile) and down's slot split (three) twice on different problems: both right,
    every workspace and count zero after each call (the last program of a tile reads the sums while zeroing them);
    and gate_up without its workspace (a capture before any eager call: partial sums, then _silu_mul) gives the same
    activations."""
    kernel = Kernel("mma_asm", (16, 64, 1, 1, 2), (32, 64, 2, 1, 3))
    for seed in (21, 22):
        x, local, weights, p13, s13, p2, s2 = problem(seed=seed)
        want = reference(x, local, weights, by_hand(p13, s13), by_hand(p2, s2))
        got = run(kernel, x, local, weights, p13, s13, p2, s2)
        assert ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 2e-2 * want.abs().max()).all()
        assert len(int4_tiles._WORKSPACE) >= 2
        assert all(not ws.any() and not counts.any() for ws, counts in int4_tiles._WORKSPACE.values())
    x, ids, p13, s13 = (t.to(DEVICE) for t in (x, local.int(), p13, s13))
    fixed = int4_moe.gate_up_call(x, ids, p13, s13, G, "mma_asm", kernel.gate_up)
    monkeypatch.setattr(int4_moe, "workspace", lambda *a: None)
    partial = int4_moe.gate_up_call(x, ids, p13, s13, G, "mma_asm", kernel.gate_up)
    mine = ((ids >= 0) & (ids < E)).flatten()
    if DEVICE == "cpu":  # the interpreter adds the two programs' sums in the same order either way
        assert torch.equal(fixed[mine], partial[mine])
    else:  # atomics add in any order: float32 sums may round apart
        torch.testing.assert_close(fixed[mine].float(), partial[mine].float(), rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("form", list(DOWN_FORMS) + ["split, captured"])
def test_down_adds_after_rounding_as_torch_does(form, monkeypatch):
    """down_call(add=a) has the bits of down_call(...) + a (bf16 + bf16 in torch: float sum, rounded once; Triton's
    interpreter rounds toward zero instead), in each form, and in the split's fallback (a capture before the
    workspace exists: torch's add after the kernel)."""
    from splitspec.models import int4_down

    if form == "split, captured":
        monkeypatch.setattr(int4_down, "workspace", lambda *a: None)
    act, ids, wts, p2, s2 = down_args(seed=23)
    config = DOWN_FORMS[form.split(",")[0]]
    plain = int4_down.down_call(act, ids, wts, p2, s2, torch.bfloat16, G, "mma_asm", config)
    add = (torch.randn(T, H, generator=torch.Generator().manual_seed(3)) * plain.float().abs().max().cpu()).bfloat16()
    got = int4_down.down_call(act, ids, wts, p2, s2, torch.bfloat16, G, "mma_asm", config, add=add.to(DEVICE))
    total = plain.cpu().float() + add.float()
    if DEVICE == "cpu" and form != "split, captured":  # float32 → bf16 by dropping the low 16 bits
        want = (total.view(torch.int32) & -65536).view(torch.float32).bfloat16()
    else:
        want = plain.cpu() + add
    assert got.dtype == torch.bfloat16 and torch.equal(got.cpu(), want)


def test_down_names_a_bad_add_and_a_stopped_split_leaves_its_workspace_zeroed(monkeypatch):
    """``add`` of another shape, dtype or layout is refused in one line; a split launch that raises part-way zeroes
    its workspace in place (sums or counts left in it would spoil every later call and every captured graph adding
    there; freeing it would hand captured graphs' memory to other tensors), and the next call is right."""
    from splitspec.models import int4_down

    act, ids, wts, p2, s2 = down_args(seed=24)
    good = torch.zeros(T, H, dtype=torch.bfloat16, device=DEVICE)
    for bad in (good[0], good.float(), torch.zeros(T, 2 * H, dtype=torch.bfloat16, device=DEVICE)[:, ::2]):
        with pytest.raises(ValueError, match=r"^INT4 down: add .*, expected a contiguous torch.bfloat16 \[3, 96\]"):
            int4_down.down_call(act, ids, wts, p2, s2, torch.bfloat16, G, "mma_asm", DOWN_FORMS["split"], add=bad)
    want = int4_down.down_call(act, ids, wts, p2, s2, torch.bfloat16, G, "mma_asm", DOWN_FORMS["loop"])
    int4_down.down_call(act, ids, wts, p2, s2, torch.bfloat16, G, "mma_asm", DOWN_FORMS["split"])  # its workspace
    key = next(k for k in int4_tiles._WORKSPACE if k[0].type == DEVICE and k[1:] == (T * H, T * 3))  # 3 row blocks
    int4_tiles._WORKSPACE[key][1][0] = 1  # a count left behind
    launch = int4_down._down_mma
    monkeypatch.setattr(int4_down, "_down_mma", {(T, 3, 3): None})  # indexing it by a grid raises: a failed launch
    pair = int4_tiles._WORKSPACE[key]
    with pytest.raises(Exception):
        int4_down.down_call(act, ids, wts, p2, s2, torch.bfloat16, G, "mma_asm", DOWN_FORMS["split"])
    assert int4_tiles._WORKSPACE[key] is pair and not pair[0].any() and not pair[1].any()
    monkeypatch.setattr(int4_down, "_down_mma", launch)
    got = int4_down.down_call(act, ids, wts, p2, s2, torch.bfloat16, G, "mma_asm", DOWN_FORMS["split"])
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3 * want.float().abs().max().item())


def test_layer_decode_branch_adds_the_shared_output_after_the_join():
    """int4_layer.routed_plus (the INT4 layer's decode branch on a GPU: gate_up, the join, down adding the shared
    expert's output) against float64: routed experts dequantised by hand plus ``add``; the join between the two."""
    from splitspec.models import int4_layer

    x, local, weights, p13, s13, p2, s2 = problem(seed=25)
    add = (torch.randn(T, H, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16()
    order = []
    spy = int4_moe.gate_up_call
    want = reference(x, local, weights, by_hand(p13, s13), by_hand(p2, s2)) + add.double()
    for kernel in (KERNELS["mma_asm-split"], KERNELS["mma_asm-columns"], KERNELS["fma"]):
        order.clear()
        args = [t.to(DEVICE) for t in (x, local.int(), weights, p13, s13, p2, s2, add)]
        int4_moe.gate_up_call = lambda *a, **kw: order.append("gate_up") or spy(*a, **kw)
        try:
            out = int4_layer.routed_plus(*args[:3], tuple(args[3:7]), G, kernel, args[7], lambda: order.append("join"))
        finally:
            int4_moe.gate_up_call = spy
        assert order == ["gate_up", "join"] and out.dtype == torch.bfloat16
        err = (out.cpu().double() - want).abs()
        assert (err <= 2 ** -6 * want.abs() + 1e-2 * want.abs().max()).all(), (kernel, err.max().item())


def test_shared_swiglu_kernel_rounds_silu_times_up_once():
    """int4_layer._swiglu (the shared expert's silu · up on a GPU) against float64 over rows of gate then up columns,
    blocks crossing rows: within one bf16 rounding (the interpreter truncates; a GPU rounds to nearest)."""
    from splitspec.models import int4_layer

    gu = torch.randn(5, 2 * 700, generator=torch.Generator().manual_seed(6)).bfloat16()
    out = torch.empty(5, 700, dtype=torch.bfloat16, device=DEVICE)
    int4_layer._swiglu[(-(-5 * 700 // 1024),)](gu.to(DEVICE), out, 5 * 700, 700, BLOCK=1024)
    g, u = gu.double()[:, :700], gu.double()[:, 700:]
    want = F.silu(g) * u
    assert ((out.cpu().double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()


def test_expert_blocks_cover_this_ranks_pairs_once():
    local = torch.tensor([[0, 4, 2], [-1, 1, 4], [3, 5, 0], [4, 4, 4]])
    order, expert, first, count = grouped_moe.expert_blocks(local, E, 2)
    assert expert.shape[0] == -(-12 // 2) + E
    seen = []
    for b in range(expert.shape[0]):
        if expert[b] >= 0:
            assert 1 <= count[b] <= 2
            pairs = order[first[b]:first[b] + count[b]].tolist()
            assert all(local.flatten()[p] == expert[b] for p in pairs)
            seen += pairs
    assert sorted(seen) == [p for p, e in enumerate(local.flatten().tolist()) if 0 <= e < E]


def test_table_lookup_by_shard_and_dtype_fallback(monkeypatch):
    a = Kernel("mma_asm", (32, 256, 2, 3, 0), (32, 256, 2, 3, 0))
    b = Kernel("mma", (16, 256, 1, 3, 0), (16, 256, 1, 3, 0))
    n1, n2 = Kernel("mma_asm", (16, 64, 1, 3, 0), (16, 64, 1, 3, 0)), Kernel("mma", (16, 64, 1, 3, 2), (16, 64, 1, 3, 0))
    c = Kernel("grouped_asm", (16, 32, 256, 2, 3), (16, 32, 256, 2, 3))
    monkeypatch.setattr(int4_routed, "DECODE", {("one", "wide"): a, ("many", "wide"): b, ("one", "narrow"): n1,
                                                ("many", "narrow"): n2})
    monkeypatch.setattr(int4_routed, "TABLE", ((None, c),))
    assert [int4_routed.kernel_for(t, torch.bfloat16, 2048) for t in (1, 2, 16, 17, 4096)] == [a, b, b, c, c]
    assert [int4_routed.kernel_for(t, torch.bfloat16, 256) for t in (1, 2, 16, 17)] == [n1, n2, n2, c]
    assert int4_routed.kernel_for(1, torch.float32, 2048) == int4_moe.DEFAULT  # the tensor cores take bf16 only
    assert int4_routed.kernel_for(17, torch.float32, 256) == int4_routed.DEQUANT


def test_decode_table_keeps_one_numerics_per_shard():
    """Each shard's one- and many-token kernels are tensor-core variants (bf16 operands, float32 sums) like the
    grouped ones past MAX_TOKENS, and valid configs; so a one-token decode and a verify agree up to sum order."""
    assert set(int4_routed.DECODE) == {(n, w) for n in ("one", "many") for w in ("wide", "narrow")}
    for kernel in int4_routed.DECODE.values():
        assert kernel.variant in ("mma", "mma_asm"), kernel
        int4_moe.check_kernel(kernel, G)
    assert all(k.variant in grouped_moe.GROUPED_VARIANTS for _, k in int4_routed.TABLE)


def test_one_token_alone_equals_it_inside_a_verify(monkeypatch):
    """A token through one-token kernels alone and through many-token kernels with two more tokens (the configs
    differ in blocks, K slices, splits and down's form): the same result up to float32 sum order."""
    one = Kernel("mma_asm", (16, 128, 2, 1, 1, 2), (64, 64, 4, 1, 0, 1))
    many = Kernel("mma_asm", (32, 64, 2, 1, 1), (32, 64, 2, 1, 3))
    monkeypatch.setattr(int4_routed, "DECODE", {("one", "wide"): one, ("many", "wide"): many})
    assert int4_routed.kernel_for(1, torch.bfloat16, 2048) == one and int4_routed.kernel_for(T, torch.bfloat16, 2048) == many
    x, local, weights, p13, s13, p2, s2 = problem(seed=11)
    alone = run(one, x[:1], local[:1], weights[:1], p13, s13, p2, s2)
    batch = run(many, x, local, weights, p13, s13, p2, s2)
    a, b = alone[0].float(), batch[0].float()
    if DEVICE == "cpu":  # the interpreter keeps the activations in float32: one bf16 output ulp
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-4 * batch.float().abs().max())
    else:  # a different float32 sum may round an activation to the neighbouring bf16 value
        assert ((a - b).norm() / b.norm()).item() < 4e-3


def test_bad_shapes_and_configs_name_the_field():
    _, _, _, p13, s13, p2, s2 = problem()
    assert int4_moe.check_int4_experts(p13, s13, p2, s2, H, G) == (E, I)
    with pytest.raises(ValueError, match=r"w2_scale has shape \[5, 96, 1\], expected \[5, 96, 2\]"):
        int4_moe.check_int4_experts(p13, s13, p2, s2[..., :1], H, G)
    with pytest.raises(ValueError, match="group size 12 must be a multiple of 8"):
        int4_moe.check_int4_experts(p13, s13, p2, s2, H, 12)
    with pytest.raises(ValueError, match="packed weights must be int32"):
        int4_moe.check_int4_experts(p13.float(), s13, p2, s2, H, G)
    x, local, weights = problem()[:3]
    args = (x, local, weights, p13, s13, p2, s2)
    for kernel, match in ((Kernel("fma", (16, 48, 1, 1, 1), (16, 64, 1, 1, 1)), "gate_up BLOCK_K 48 must be a multiple"),
                          (Kernel("mma", (16, 64, 1, 1), (16, 64, 1, 1, 1)), r"gate_up config \(16, 64, 1, 1\) must be"),
                          (Kernel("mma", (16, 64, 1, 1, 1), (8, 64, 1, 1, 1)), "need BLOCK_N ≥ 16"),
                          (Kernel("wmma", (16, 64, 1, 1, 1), (16, 64, 1, 1, 1)), "variant 'wmma' is not one of")):
        with pytest.raises(ValueError, match=match):
            int4_moe.int4_experts(*args, group=G, kernel=kernel)
    with pytest.raises(ValueError, match=r"down config \(8, 64, 64, 1, 1\) must be \(BLOCK_M ≥ 16"):
        grouped_moe.int4_grouped_experts(*args, group=G, kernel=Kernel("grouped", (16, 16, 64, 1, 1), (8, 64, 64, 1, 1)))


def test_layer_with_the_shared_expert_beside_matches_float64():
    """splitspec.models.int4_layer.moe_layer (router kernels, INT4 experts, bf16 shared expert on a side stream on
    CUDA) against the layer computed in float64 here: routing by noaux_tc (one group), experts dequantised by hand."""
    from splitspec.models import int4_layer

    x, _, _, p13, s13, p2, s2 = problem(seed=5)
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(E + 2, H, generator=g) / H ** 0.5).bfloat16()  # two experts on another rank (start 2)
    bias = torch.randn(E + 2, generator=g) * 0.1
    sw13 = (torch.randn(2 * 48, H, generator=g) / H ** 0.5).bfloat16()
    sw2 = (torch.randn(H, 48, generator=g) / 48 ** 0.5).bfloat16()
    start, scaling = 2, 2.5
    args = [t.to(DEVICE) for t in (x, gate, bias)]
    out = int4_layer.moe_layer(*args, TOP_K, scaling, True, start, tuple(t.to(DEVICE) for t in (p13, s13, p2, s2)),
                               (sw13.to(DEVICE), sw2.to(DEVICE)), G).cpu()
    scores = (x.double() @ gate.double().T).sigmoid()
    ids = (scores + bias.double()).topk(TOP_K, dim=-1).indices
    w = scores.gather(1, ids)
    w = w / w.sum(-1, keepdim=True) * scaling
    want = reference(x, ids - start, w, by_hand(p13, s13), by_hand(p2, s2))
    gate_up = x.double() @ sw13.double().T
    want += (F.silu(gate_up[:, :48]) * gate_up[:, 48:]) @ sw2.double().T
    assert ((ids - start < 0) | (ids - start >= E)).any() and (ids - start >= 0).any()  # both kinds of pair present
    err = (out.double() - want).abs().max() / want.abs().max()
    assert out.dtype == torch.bfloat16 and out.shape == (T, H) and err < 2e-2, err.item()


def test_dequantised_path_with_no_token_returns_an_empty_result():
    x, local, weights, p13, s13, p2, s2 = problem(seed=6)
    lw = dict(zip(int4_routed.NAMES, (p13, s13, p2, s2)))
    out = int4_routed.dequantised_experts(x[:0], local[:0], weights[:0], lw, G)
    assert out.shape == (0, H) and out.dtype == x.dtype
