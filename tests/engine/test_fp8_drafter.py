"""FP8 drafters (``splitspec build --drafter-dtype fp8``): quantised at build from the demo drafter, its linears are
FP8 within e4m3's rounding of the float weights and its forward equals the float drafter over the dequantised weights;
greedy speculation with it stays target-only greedy at k = 1…5, eagerly and in the static-shape form; an FP8 drafter
checkpoint (Llama or MLA attention) converts and builds with its tiles kept bit for bit (or dequantised for a float
drafter); the memory plan
counts the built bytes; bad FP8 drafters get one line naming the file and tensor, and nothing is written."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitspec import quant
from splitspec.build.engines import build_engines
from splitspec.build.memory_plan import Deployment, plan_memory
from splitspec.build.weight_bytes import Storage, WeightFormat, drafter_bytes
from splitspec.cli import main as cli_main
from splitspec.config import TargetConfig
from splitspec.convert.pair import convert_pair
from splitspec.drafter_config import DrafterConfig
from splitspec.errors import CheckpointError, ConfigError
from splitspec.files import read_json, write_json
from splitspec.models.batch import ForwardBatch, single_blocks
from splitspec.models.drafters import FP8_WEIGHTS, drafter_cache, drafter_linears, drafter_model, shard_drafter_weights
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.settings import ServeConfig
from splitspec.testing.mla_drafter_fixture import write_mla_drafter
from splitspec.testing.fp8_drafter import write_fp8_drafter

PROMPT = "import os\nimport sys\n\n\nclass Config:\n    def __init__(self"


def quiet(fn, *a, **kw):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return fn(*a, **kw)


def dequantised(t: torch.Tensor, s: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """Tile × its scale in float32, written here apart from splitspec.quant."""
    return t.float() * s.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]


@pytest.fixture(scope="module")
def engines(engines_for, tmp_path_factory):
    """(float32 TP1 demo engines, the same with the drafter built FP8 from the same converted checkpoint)."""
    float_eng = engines_for(1)
    fp8 = quiet(build_engines, float_eng.parent / "ckpt", tmp_path_factory.mktemp("fp8") / "engines", max_batch_size=2,
                max_seq_len=256, progress=False, drafter_dtype="fp8")
    return float_eng, fp8


def test_quantised_at_build_layout_forward_and_bytes(engines):
    float_eng, fp8 = engines
    meta = read_json(fp8 / "drafter" / "engine.json")
    cfg = DrafterConfig.from_dict(meta["config"])
    q = meta["quantization"]
    assert q["weights"] == FP8_WEIGHTS and q["weight_block_size"] == [128, 128] and q["activation_dtype"] == "float32"
    assert q["fp8_linears"] == q["quantised_at_build"] == list(drafter_linears(cfg)) == ["fc", "qkv_proj", "o_proj", "mlp.w13", "mlp.w2"]
    w, ref = load_file(str(fp8 / "drafter" / "rank0.safetensors")), load_file(str(float_eng / "drafter" / "rank0.safetensors"))
    deq = dict(ref)
    for n in drafter_linears(cfg):
        assert w[n].dtype == quant.FP8_DTYPE and w[n + ".scale_inv"].shape == (-(-w[n].shape[0] // 128), -(-w[n].shape[1] // 128))
        deq[n] = dequantised(w[n], w[n + ".scale_inv"])
        tile = dequantised(torch.ones_like(w[n], dtype=torch.float32), w[n + ".scale_inv"])
        assert ((deq[n] - ref[n]).abs() <= ref[n].abs() * 2 ** -4 + tile * 2 ** -9).all(), n  # e4m3 rounding
    for n in ("embed_tokens", "lm_head", "norm"):
        assert torch.equal(w[n], ref[n])
    # the FP8 drafter's forward is the float drafter's over the dequantised weights (and not the float drafter's)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(7, 3 * cfg.target_hidden_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (7,), generator=g).tolist()
    logits = {}
    for name, weights in (("fp8", w), ("dequantised", deq), ("float", ref)):
        m = drafter_model(cfg, weights)
        cache = drafter_cache(cfg, 256, m.dtype, "cpu")
        logits[name], _ = m.forward(ForwardBatch.build([(single_blocks(0, 256), 0, tokens)], "all"), m.fuse(aux), cache)
    torch.testing.assert_close(logits["fp8"], logits["dequantised"], rtol=1e-5, atol=1e-5)
    assert (logits["fp8"] - logits["float"]).abs().max() > 1e-4
    # the memory plan: TP1 bytes are the rank file's; a draft_tp 2 shard's are the engine's shard
    tmeta = read_json(fp8 / "target" / "engine.json")
    dep = Deployment(tp=1, max_batch_size=2, max_seq_len=256)
    plan = plan_memory(TargetConfig.from_dict(tmeta["config"]), WeightFormat("float32", 4), Storage(quant.QuantScheme()), cfg, dep,
                       on_gpu=False, drafter_block=(128, 128))
    assert plan.gpus[0].group("drafter") == sum(t.nbytes for t in w.values())
    assert sum(drafter_bytes(cfg, 4, 2, (128, 128)).values()) == sum(t.nbytes for t in shard_drafter_weights(w, cfg, 0, 2).values())
    assert plan.gpus[0].items["drafter layer (fc, attention, MLP)"][1] < 0.3 * drafter_bytes(cfg, 4)["drafter_layer"]


@pytest.mark.parametrize("padded, ks", [(False, (1, 3, 5)), (True, (2, 4))], ids=["eager", "static-shape"])
def test_greedy_speculation_with_fp8_drafter_is_target_only_greedy(engines, demo_models, padded, ks):
    ids = ChatTokenizer.from_dir(demo_models / "target").encode(PROMPT)
    with SpeculativeEngine.load(ServeConfig(engines[1], padded=padded)) as eng:
        want = eng.generate(ids, 12, num_draft_tokens=0, stop_token_ids=set()).token_ids
        for k in ks:
            assert eng.generate(ids, 12, num_draft_tokens=k, stop_token_ids=set()).token_ids == want, k


def test_fp8_drafter_checkpoint_keeps_its_tiles(demo_models, tmp_path):
    names = write_fp8_drafter(demo_models / "drafter", tmp_path / "d8")
    assert len(names) == 8  # q, k, v, o, gate, up, down, fc
    quiet(convert_pair, demo_models / "target", tmp_path / "d8", tmp_path / "ckpt", tp_size=1, progress=False)
    dq = read_json(tmp_path / "ckpt" / "drafter" / "config.json")["quantization"]
    assert dq["method"] == "fp8" and dq["weight_block_size"] == [128, 128] and len(dq["fp8_tensors"]) == 8
    src = {}
    for f in (tmp_path / "d8").glob("*.safetensors"):
        src |= load_file(str(f))
    a = next(n for n in src if n.endswith("self_attn.q_proj.weight")).removesuffix("q_proj.weight")
    assert quiet(cli_main, ["build", "--checkpoints", str(tmp_path / "ckpt"), "--out", str(tmp_path / "e8"), "--max-seq-len", "256",
                            "--drafter-dtype", "fp8"]) == 0
    kept = tmp_path / "e8"
    w = load_file(str(kept / "drafter" / "rank0.safetensors"))
    assert read_json(kept / "drafter" / "engine.json")["quantization"]["quantised_at_build"] == []
    qkv = torch.cat([src[a + f"{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(w["qkv_proj"].view(torch.uint8), qkv.view(torch.uint8))
    assert torch.equal(w["qkv_proj.scale_inv"], torch.cat([src[a + f"{x}_proj.weight_scale_inv"] for x in "qkv"]))
    flt = quiet(build_engines, tmp_path / "ckpt", tmp_path / "ef", max_seq_len=256, progress=False)
    wf = load_file(str(flt / "drafter" / "rank0.safetensors"))
    assert "qkv_proj.scale_inv" not in wf and torch.equal(wf["qkv_proj"], dequantised(w["qkv_proj"], w["qkv_proj.scale_inv"]))
    with pytest.raises(ConfigError, match="drafter_dtype 'int8'"):
        build_engines(tmp_path / "ckpt", tmp_path / "bad", drafter_dtype="int8", progress=False)


def test_mla_fp8_drafter_checkpoint(demo_models, tmp_path):
    """An MLA drafter (EAGLE-3.1 form: d2t, fc_norm, norm_output) stored FP8: its fused q_a + kv_a_with_mqa rows (64 +
    48) cut a tile, so build requantises that fusion and keeps every other checkpoint tile; w_uk / w_uv stay float;
    the forward is the float MLA drafter's over the dequantised weights."""
    write_mla_drafter(tmp_path / "mla", demo_models / "target", "mla31")
    write_fp8_drafter(tmp_path / "mla", tmp_path / "mla8")
    quiet(convert_pair, demo_models / "target", tmp_path / "mla8", tmp_path / "ckpt", tp_size=1, progress=False)
    eng = quiet(build_engines, tmp_path / "ckpt", tmp_path / "eng", max_seq_len=256, progress=False, drafter_dtype="fp8")
    meta = read_json(eng / "drafter" / "engine.json")
    cfg = DrafterConfig.from_dict(meta["config"])
    assert cfg.is_mla and meta["quantization"]["quantised_at_build"] == ["attn.fused_qkv_a"]
    w = load_file(str(eng / "drafter" / "rank0.safetensors"))
    deq = {n: t for n, t in w.items() if not n.endswith(".scale_inv") and n != quant.FP8_BLOCK_KEY}
    for n in drafter_linears(cfg):
        assert w[n].dtype == quant.FP8_DTYPE
        deq[n] = dequantised(w[n], w[n + ".scale_inv"])
    assert w["attn.w_uk"].dtype == w["attn.w_uv"].dtype == w["lm_head"].dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(6, 3 * cfg.target_hidden_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size, (6,), generator=g).tolist()
    out = []
    for weights in (w, deq):
        m = drafter_model(cfg, weights)
        out.append(m.forward(ForwardBatch.build([(single_blocks(0, 256), 0, tokens)], "all"), m.fuse(aux),
                             drafter_cache(cfg, 256, m.dtype, "cpu")))
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


def test_bad_fp8_drafters_are_one_line_errors(demo_models, tmp_path):
    d8 = tmp_path / "d8"
    write_fp8_drafter(demo_models / "drafter", d8)
    f = next(d8.glob("*.safetensors"))
    t = load_file(str(f))
    scale = next(n for n in t if n.endswith("o_proj.weight_scale_inv"))
    cfg = read_json(d8 / "config.json")
    cases = [("no scale", lambda: save_file({n: v for n, v in t.items() if n != scale}, str(f)), f"'{scale}' is missing"),
             ("no config", lambda: write_json({k: v for k, v in cfg.items() if k != "quantization_config"}, d8 / "config.json"),
              "no FP8 quantization_config"),
             ("int4", lambda: write_json(cfg | {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                                        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}},
                                         d8 / "config.json"), "float or FP8 block-scaled"),
             ("scale shape", lambda: save_file(t | {scale: t[scale][:1]}, str(f)), f"tensor '{scale}' has shape")]
    for what, spoil, says in cases:
        save_file(t, str(f))
        write_json(cfg, d8 / "config.json")
        spoil()
        with pytest.raises(CheckpointError, match=says) as e:
            convert_pair(demo_models / "target", d8, tmp_path / "out", tp_size=1, progress=False)
        assert "\n" not in str(e.value) and not (tmp_path / "out").exists(), what
