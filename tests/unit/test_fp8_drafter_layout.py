"""FP8 drafters' runtime layout without an engine: a draft_tp shard of an FP8 drafter dequantises to the shard of the
dequantised drafter, keeping tiles where the slice allows and falling back to float where it cuts them (Llama and MLA);
the bytes the memory plan counts for the published Kimi-K2 drafter's shape, worked out by hand; ``splitspec plan
--drafter-dtype fp8`` on the published Kimi configs."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from splitspec import quant
from splitspec.build.memory_plan import GIB
from splitspec.build.synthetic import kimi_k2_drafter
from splitspec.build.weight_bytes import drafter_bytes
from splitspec.cli import main
from splitspec.drafter_config import DrafterConfig
from splitspec.models.drafters import drafter_linears, quantize_drafter, shard_drafter_weights
from splitspec.models.shapes import drafter_shapes, random_weights

FIXTURES = Path(__file__).parents[1] / "fixtures" / "published"
BLOCK = (16, 16)


def dequantised(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every FP8 weight of ``w`` as float32, tile by tile (scale repeated over its tile, ragged edges cut); the rest as
    it is. Written here, apart from splitspec.quant."""
    out = {}
    for name, t in w.items():
        if name.endswith(".scale_inv") or name == quant.FP8_BLOCK_KEY:
            continue
        s = w.get(name + ".scale_inv")
        if s is None:
            out[name] = t
            continue
        b0, b1 = (int(v) for v in w[quant.FP8_BLOCK_KEY])
        full = s.repeat_interleave(b0, 0)[: t.shape[0]].repeat_interleave(b1, 1)[:, : t.shape[1]]
        out[name] = t.float() * full
    return out


def small_llama() -> DrafterConfig:
    # q/k/v rows 64 + 32 + 32 and o_proj columns split in two keep 16-wide tiles; intermediate 40 / 2 = 20 cuts them
    return dataclasses.replace(kimi_k2_drafter(4), hidden_size=48, intermediate_size=40, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=96, draft_vocab_size=64, target_hidden_size=48)


def small_mla() -> DrafterConfig:
    raw = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 48,
           "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
           "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12, "rms_norm_eps": 1e-5,
           "vocab_size": 96, "draft_vocab_size": 64, "rope_theta": 10000.0,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}
    return DrafterConfig.from_hf(raw, aux_convention="input")


@pytest.mark.parametrize("make", [small_llama, small_mla], ids=["llama", "mla"])
def test_fp8_shards_dequantise_to_the_shards_of_the_dequantised_drafter(make):
    cfg = make()
    w = quantize_drafter(random_weights(drafter_shapes(cfg), torch.float32, "cpu", seed=3), cfg, BLOCK)
    assert all(w[n].dtype == quant.FP8_DTYPE and n + ".scale_inv" in w for n in drafter_linears(cfg))
    assert w["lm_head"].dtype == w["embed_tokens"].dtype == torch.float32
    reference = dequantised(w)
    kept = set()
    for rank in range(2):
        shard = shard_drafter_weights(w, cfg, rank, 2)
        want = shard_drafter_weights(reference, cfg, rank, 2)
        got = dequantised(shard)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name].to(got[name].dtype)), name
        kept |= {n for n in drafter_linears(cfg) if shard[n].dtype == quant.FP8_DTYPE}
        for n in drafter_linears(cfg):  # a float fallback leaves no stale scales behind
            assert (n + ".scale_inv" in shard) == (shard[n].dtype == quant.FP8_DTYPE)
    if cfg.is_mla:  # v columns of o_proj: 4 heads × 12 = 48, halves of 24 cut 16-wide tiles; q_b rows 4 × 16 do not
        assert {"attn.q_b_proj", "fc"} <= kept and "attn.o_proj" not in kept
    else:
        assert kept == {"fc", "qkv_proj", "o_proj"}  # mlp: 20 rows / columns per shard cut the tiles


def test_kimi_fp8_drafter_bytes_by_hand():
    cfg = kimi_k2_drafter(61)
    H, I, TH = 7168, 18432, 7168
    linears = {"fc": (H, 3 * TH), "qkv_proj": (3 * 64 * 128, 2 * H), "o_proj": (H, 64 * 128), "mlp.w13": (2 * I, H), "mlp.w2": (H, I)}
    fp8 = sum(r * c + math.ceil(r / 128) * math.ceil(c / 128) * 4 for r, c in linears.values())
    norms = 3 * H * 2  # input_layernorm, hidden_norm, post_attention_layernorm (the final norm counts with the layer too)
    got, bf16 = drafter_bytes(cfg, 2, 1, (128, 128)), drafter_bytes(cfg, 2)
    assert got["drafter_layer"] == fp8 + norms + H * 2 + 16  # + final norm + fp8.weight_block_size
    assert bf16["drafter_layer"] == 2 * sum(r * c for r, c in linears.values()) + norms + H * 2
    assert 0.50 < got["drafter_layer"] / bf16["drafter_layer"] < 0.501
    assert got["drafter_lm_head"] == bf16["drafter_lm_head"] and got["drafter_embeddings"] == bf16["drafter_embeddings"]
    # sharded over 8 GPUs every slice keeps its tiles (18432 / 8 and 8192 / 8 are multiples of 128)
    tp8 = drafter_bytes(cfg, 2, 8, (128, 128))
    assert tp8["drafter_layer"] < got["drafter_layer"] / 3


def test_plan_with_fp8_drafter(capsys):
    args = ["plan", str(FIXTURES / "kimi-k2.5"), "--drafter", str(FIXTURES / "drafter-aq-medai-kimi-k25-eagle3"),
            "--tp", "8", "--gpu-memory-gib", "141", "--max-batch-size", "8", "--max-seq-len", "4096", "--max-draft-len", "3"]
    layer = []
    for extra in ([], ["--drafter-dtype", "fp8"]):
        assert main(args + extra) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.strip().startswith("drafter layer"))
        layer.append(float(line.split("GiB")[0].split()[-1]))
    assert "drafter TP1 on GPU 0 (FP8 linears, 128×128 tiles)" in out
    assert layer[1] == pytest.approx(layer[0] / 2, abs=0.02) and layer[0] > 1.5
    assert main(args + ["--drafter-dtype", "int8"]) == 2
    assert "--drafter-dtype" in capsys.readouterr().err
    assert GIB == 2 ** 30
