"""Synthetic INT4 engines and the rank-only mode the full-depth benchmark runs (bench/full_depth_rank.py): the
synthetic INT4 experts are the layout ``build --dtype int4`` writes and compute what their dequantised weights say;
rank 0 of a TP8 engine runs alone on the fake process group, no workers, both draft placements."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from splitspec import quant
from splitspec.build.synthetic import KIMI_DRAFTER_PROFILE, write_synthetic_engines
from splitspec.config import Mapping, TargetConfig
from splitspec.engine.engine_files import load_rank_weights, read_engine_meta
from splitspec.errors import ConfigError
from splitspec.models.shapes import NIBBLE_RMS, target_shapes
from splitspec.testing.engine_logits import engine_logits


def _rank_weights(engines, rank: int) -> dict[str, torch.Tensor]:
    meta = read_engine_meta(engines / "target", "target")
    cfg, mapping = TargetConfig.from_dict(meta["config"]), Mapping.from_dict(meta["mapping"])
    return load_rank_weights(engines / "target", rank, "cpu", meta, target_shapes(cfg, mapping))


def test_synthetic_int4_experts_are_the_built_layout_and_compute_their_dequantised_weights(tmp_path):
    """A tiny TP2 synthetic INT4 engine: engine.json as a built INT4 engine's; per rank packed int32 experts with bf16
    group scales (words checked against hand-unpacked nibbles); written out as rank files, its logits equal those of
    the same weights dequantised into a float engine (the float MoE path, no INT4 code) — the helper of
    tests/engine/test_int4_engine.py."""
    eng = write_synthetic_engines(tmp_path / "int4", num_layers=3, tp_size=2, dtype="int4", tiny=True, max_seq_len=64)
    meta = read_engine_meta(eng / "target", "target")
    q = meta["quantization"]
    assert meta["dtype"] == "int4" and q["weights"] == "int4_routed_experts" and q["group_size"] == 32
    assert q["activation_dtype"] == "float32" and "synthetic" in meta["weights"]
    assert read_engine_meta(eng / "drafter", "drafter")["dtype"] == "float32"
    with pytest.raises(ConfigError, match="int8"):
        write_synthetic_engines(tmp_path / "bad", num_layers=2, tp_size=1, dtype="int8")
    flat = tmp_path / "flat"
    (flat / "target").mkdir(parents=True)
    shutil.copy(eng / "target" / "engine.json", flat / "target" / "engine.json")  # engine_logits reads config and mapping
    for rank in range(2):
        w = _rank_weights(eng, rank)
        p13, s13, p2, s2 = (w[f"layers.1.mlp.experts.{n}"] for n in ("w13", "w13.scale", "w2", "w2.scale"))
        assert p13.dtype == p2.dtype == torch.int32 and s13.dtype == s2.dtype == torch.bfloat16
        assert p13.shape == (16, 256, 256 // 8) and s13.shape == (16, 256, 256 // 32)  # 2·I/2 rows, H/8 words, H/32 groups
        assert p2.shape == (16, 256, 128 // 8) and s2.shape == (16, 256, 128 // 32) and int(w[quant.INT4_KEY][0]) == 32
        assert not torch.equal(p13[0], p13[1]) and w["layers.1.mlp.shared.w13"].dtype == torch.float32
        base = 256 ** -0.5 / NIBBLE_RMS
        assert 0.5 * base * 0.99 <= s13.float().min() and s13.float().max() <= 1.5 * base * 1.01
        nibbles = torch.stack([(p13 >> (4 * j)) & 0xF for j in range(8)]).flatten()
        assert (torch.bincount(nibbles, minlength=16).float() / nibbles.numel() - 1 / 16).abs().max() < 0.01
        dq = quant.dequantize_int4(p13, s13, 256, 32, torch.float64)
        for e, n, c in ((0, 0, 0), (3, 17, 45), (15, 255, 255)):  # column c: nibble c % 8 of word c // 8, group c // 32
            word = int(p13[e, n, c // 8]) & 0xFFFFFFFF
            assert dq[e, n, c].item() == (((word >> (4 * (c % 8))) & 0xF) - 8) * float(s13[e, n, c // 32])
        assert abs(dq.pow(2).mean().sqrt().item() * 256 ** 0.5 - 1) < 0.1  # weight RMS ≈ fan_in^-1/2, as float linears
        save_file(w, str(eng / "target" / f"rank{rank}.safetensors"))
        for name in [n for n in w if n.endswith((".experts.w13", ".experts.w2"))]:
            w[name] = quant.dequantize_int4(w[name], w.pop(name + ".scale"), w[name].shape[-1] * 8, 32, torch.float32)
        del w[quant.INT4_KEY]
        save_file(w, str(flat / "target" / f"rank{rank}.safetensors"))
    prompt = torch.randint(0, 4096, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = engine_logits(eng, prompt)[0], engine_logits(flat, prompt)[0]
    assert torch.isfinite(a).all() and a.shape == (12, 4096) and a.std() > 0
    assert (a - b).abs().max().item() <= 1e-5


def test_rank_only_runs_rank_zero_of_a_tp8_engine_alone(tmp_path):
    """fake_peers: rank 0 of a tiny TP8 INT4 engine in this process, the fake process group, no worker; greedy cycles
    with k = 0 and k = 2 under both placements (the scheduler switching between them), finite full-vocabulary
    logits, the group gone after close; more than one device id is refused."""
    from splitspec.engine.group import Group
    from splitspec.engine.plan import CyclePlan, SeqWork
    from splitspec.measure.tune import steady_round
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.settings import ServeConfig

    eng_dir = write_synthetic_engines(tmp_path / "tp8", num_layers=2, tp_size=8, dtype="int4", tiny=True, max_batch_size=2,
                                      max_seq_len=128)
    cfg = ServeConfig(eng_dir, padded=True, num_draft_tokens=0, kv_tokens=2 * 128, synthetic_acceptance=KIMI_DRAFTER_PROFILE)
    with pytest.raises(ConfigError, match="fake_peers"):
        Group(cfg.replace(target_device_ids=(0, 1)), (1, 8), fake_peers=True)
    assert not dist.is_initialized()
    group = Group(cfg, (1, 8), fake_peers=True)
    try:
        assert dist.get_backend() == "fake" and dist.get_world_size() == 8 and group.procs == [] and group.world == 8
        assert group.rank0.target.w["layers.1.mlp.experts.w13"].dtype == torch.int32
        assert group.rank0.target.w["embed_tokens"].shape == (4096 // 8, 256)
        out = group.run(CyclePlan(work=[SeqWork(sid=99, kind="prefill", start=0, tokens=list(range(1, 9)), blocks=[0],
                                                final=True)]))
        assert out.logits.shape == (1, 4096) and torch.isfinite(out.logits).all()
        with SpeculativeEngine(group) as eng:
            eng.switch_after = 1
            for dtp in (1, 8):
                eng.draft_tp_for = lambda batch, d=dtp: d
                for k in (0, 2):
                    got = steady_round(eng, [[5] * 8, [7] * 8], k, 2, 1)
                    assert len(got) == 2 and all(s.decode_seqs == 2 and s.draft_tp == (dtp if k else 0) for _, s in got), (dtp, k)
                    assert all(len(s.emitted) == 2 and 1 <= min(s.emitted) and max(s.emitted) <= k + 1 for _, s in got)
    finally:
        group.close()
    assert not dist.is_initialized()
