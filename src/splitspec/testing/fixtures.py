"""Tiny checkpoints in every published form, all from ONE set of float weights, for format tests.

:func:`make_fixtures` draws one float target (bf16-representable float32 values) and one float
EAGLE-3 drafter, then writes them in each form a user may bring (docs/formats.md, "Target checkpoints", "EAGLE-3 drafters"):

==================  ====================================================================================
``float/``          the float original: ``kimi_k2`` config, float32 tensors
``bf16/``           Kimi-K2 bf16 form (``e_score_correction_bias`` float32): exactly the original's values
``fp8/``            Kimi-K2-Instruct form: every linear except ``lm_head`` and the router float8_e4m3fn with
                    float32 ``weight_scale_inv`` per 128×128 tile; hidden 320 and kv_a rows 224 make the
                    last tiles ragged (64 columns, 96 rows)
``int4/``           Kimi-K2-Thinking form: compressed-tensors pack-quantized, routed experts only, group 32
``k25/``            Kimi-K2.5 form: ``kimi_k25`` with the INT4 text model under ``text_config`` and
                    ``language_model.``, plus ``vision_tower.*`` / ``mm_projector.*`` tensors
``drafter/``        EAGLE-3 as published by SpecForge: no embedding, reduced draft vocabulary with ``d2t`` and
                    ``t2d``, aux ids [0, 1, 3] declared as layer inputs (3 = after the last block)
``drafter_modelopt/``  own ``embed_tokens`` equal to the target's, full vocabulary, no ``d2t``/``t2d``,
                    aux ids [0, 1, 2] undeclared but with ModelOpt export keys (→ layer outputs)
``drafter_own_embed/``  own ``embed_tokens`` that differs from the target's, ``d2t`` without ``t2d``,
                    aux ids [0, 1, 2] undeclared and unmarked (the convention must be given)
``drafter_norm_fc/``  like ``drafter/`` plus ``norm_before_fc`` and ``input_norm.weight`` [3·320]
==================  ====================================================================================

``master.safetensors`` holds the float original's target tensors and ``drafter_master.safetensors`` the
drafter's (full ``lm_head`` over the whole vocabulary, ``draft_ids``, ``embed_tokens``), so tests can
compare what a converter produced with the weights every form came from.

MLA EAGLE-3 drafters for a target folder: :mod:`splitspec.testing.mla_drafter_fixture`.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Iterable, Iterator

import torch

from splitspec import quant
from splitspec.convert.safetensors import CheckpointReader, write_tensors
from splitspec.demo.checkpoints import target_config as demo_target_config
from splitspec.files import atomic_dir, read_json, write_json

BLOCK = (128, 128)
INT4_GROUP = 32
K2_THINKING_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
K25_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
              "re:vision_tower.*", "re:mm_projector.*"]
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(BLOCK)}
TARGET_FORMS = ("float", "bf16", "fp8", "int4", "k25")
DRAFTER_FORMS = ("drafter", "drafter_modelopt", "drafter_own_embed", "drafter_norm_fc")
MODELOPT_KEYS = {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False,
                 "next_layer_regular": True}


def int4_config(ignore: list[str], group: int = INT4_GROUP) -> dict:
    """A compressed-tensors ``quantization_config`` as Kimi-K2-Thinking / K2.5 publish it."""
    return {
        "config_groups": {"group_0": {
            "input_activations": None, "output_activations": None, "targets": ["Linear"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": group, "num_bits": 4,
                        "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True, "type": "int"}}},
        "format": "pack-quantized", "ignore": list(ignore), "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed",
    }


def target_config(**over) -> dict:
    """``config.json`` of the fixture target: the demo target's Kimi-K2 fields
    (:func:`splitspec.demo.checkpoints.target_config`, without ``pad_token_id``) at other toy sizes, chosen for ragged
    FP8 tiles, then ``over``.

    hidden 320 (tiles 128+128+64), kv_a rows 160+64 = 224 (128+96), kv_b columns 160 (128+32); every
    TP2 split falls on a tile boundary, routed-expert splits at TP4 do not (64 rows).
    """
    cfg = demo_target_config(bos_id=1, eos_id=2, pad_id=0)
    del cfg["pad_token_id"]
    cfg.update(vocab_size=512, hidden_size=320, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, q_lora_rank=256,
               kv_lora_rank=160, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64)
    cfg.update(over)
    return cfg


def drafter_config(target: dict, draft_vocab: int, aux_ids: list[int], **eagle) -> dict:
    """``config.json`` of a fixture EAGLE-3 drafter (SpecForge layout) for ``target``."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": target["hidden_size"], "intermediate_size": 640, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 80, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab, "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None,
        "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "target_hidden_size": target["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True, **eagle},
    }


# ------------------------------------------------------------------ the one set of float weights

def target_linears(cfg: dict) -> list[tuple[str, tuple[int, int], bool]]:
    """(module, [out, in], routed expert?) of every Linear of the target except ``lm_head``."""
    H, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    out = []
    for n in range(cfg["num_hidden_layers"]):
        a = f"model.layers.{n}.self_attn."
        out += [(a + "q_a_proj", (cfg["q_lora_rank"], H), False), (a + "q_b_proj", (heads * qk, cfg["q_lora_rank"]), False),
                (a + "kv_a_proj_with_mqa", (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H), False),
                (a + "kv_b_proj", (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]), False),
                (a + "o_proj", (H, heads * cfg["v_head_dim"]), False)]
        m = f"model.layers.{n}.mlp."
        mlps = []
        if n < cfg["first_k_dense_replace"]:
            mlps.append((m, cfg["intermediate_size"], False))
        else:
            mlps += [(f"{m}experts.{e}.", cfg["moe_intermediate_size"], True) for e in range(cfg["n_routed_experts"])]
            mlps.append((m + "shared_experts.", cfg["moe_intermediate_size"] * cfg["n_shared_experts"], False))
        for p, inter, routed in mlps:
            out += [(p + "gate_proj", (inter, H), routed), (p + "up_proj", (inter, H), routed), (p + "down_proj", (H, inter), routed)]
    return out


def bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 and back to float32: float values every published (bf16) form holds exactly."""
    return x.to(torch.bfloat16).float()


def target_master(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """The float original: float32 tensors whose values are bf16-representable, in checkpoint order.

    Unit-gain projections (std 1/√fan_in; output projections /√(2·layers)), norms 1 + 0.05·noise,
    embedding std 1, lm_head std 0.08, router std 0.1, correction bias std 0.1 (as the demo models).
    """
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    out_scale = 1 / math.sqrt(2 * cfg["num_hidden_layers"])
    linears = {m: shape for m, shape, _ in target_linears(cfg)}
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": bf16_exact(rnd(V, H))}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        t[p + "input_layernorm.weight"] = bf16_exact(1 + 0.05 * rnd(H))
        t[p + "post_attention_layernorm.weight"] = bf16_exact(1 + 0.05 * rnd(H))
        t[p + "self_attn.q_a_layernorm.weight"] = bf16_exact(1 + 0.05 * rnd(cfg["q_lora_rank"]))
        t[p + "self_attn.kv_a_layernorm.weight"] = bf16_exact(1 + 0.05 * rnd(cfg["kv_lora_rank"]))
        if n >= cfg["first_k_dense_replace"]:
            E = cfg["n_routed_experts"]
            t[p + "mlp.gate.weight"] = bf16_exact(0.1 * rnd(E, H))
            t[p + "mlp.gate.e_score_correction_bias"] = 0.1 * rnd(E)
        for m, shape in linears.items():
            if m.startswith(p):
                scale = out_scale if m.endswith(("o_proj", "down_proj")) else 1.0
                t[m + ".weight"] = bf16_exact(rnd(*shape) * scale / math.sqrt(shape[1]))
    t["model.norm.weight"] = bf16_exact(1 + 0.05 * rnd(H))
    t["lm_head.weight"] = bf16_exact(0.08 * rnd(V, H))
    return t


def drafter_master(dcfg: dict, seed: int = 1, draft_vocab: int = 128) -> dict[str, torch.Tensor]:
    """The drafter's float weights: layer, fc, norms, ``lm_head_full`` [vocab, H] (a reduced vocabulary takes
    the rows of its draft ids), ``draft_ids`` [draft_vocab] (sorted target ids), ``own_embed`` (a drafter
    embedding unlike the target's) and ``input_norm`` [3·H]."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    H, I, TH, V = dcfg["hidden_size"], dcfg["intermediate_size"], dcfg["target_hidden_size"], dcfg["vocab_size"]
    nq, nkv, hd = dcfg["num_attention_heads"], dcfg["num_key_value_heads"], dcfg["head_dim"]
    lin = lambda o, i, s=1.0: bf16_exact(rnd(o, i) * s / math.sqrt(i))  # noqa: E731
    norm = lambda n: bf16_exact(1 + 0.05 * rnd(n))  # noqa: E731
    ids = torch.cat((torch.tensor([2]), 3 + torch.randperm(V - 3, generator=g)[: draft_vocab - 1])).sort().values
    return {
        "midlayer.input_layernorm.weight": norm(H), "midlayer.hidden_norm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": lin(nq * hd, 2 * H), "midlayer.self_attn.k_proj.weight": lin(nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": lin(nkv * hd, 2 * H), "midlayer.self_attn.o_proj.weight": lin(H, nq * hd, 0.7),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.mlp.gate_proj.weight": lin(I, H), "midlayer.mlp.up_proj.weight": lin(I, H), "midlayer.mlp.down_proj.weight": lin(H, I, 0.7),
        "fc.weight": lin(H, 3 * TH), "norm.weight": norm(H), "lm_head_full": bf16_exact(0.08 * rnd(V, H)),
        "draft_ids": ids, "own_embed": bf16_exact(rnd(V, H)), "input_norm": norm(3 * TH),
    }


# ------------------------------------------------------------------ forms

def _chunks(items: list[tuple[str, torch.Tensor]], parts: int) -> list[list[tuple[str, torch.Tensor]]]:
    per = -(-len(items) // parts)
    return [items[i:i + per] for i in range(0, len(items), per)]


def write_checkpoint(folder: Path, items: Iterable[tuple[str, torch.Tensor]], config: dict, shards: int = 2) -> None:
    """Write ``config.json`` and the tensors as ``shards`` safetensors files with ``model.safetensors.index.json``
    (one file ``model.safetensors`` and no index when ``shards`` is 1)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    items = [(n, t.contiguous()) for n, t in items]
    write_json(config, folder / "config.json")
    if shards == 1:
        write_tensors(items, folder / "model.safetensors")
        return
    groups = _chunks(items, shards)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        total += write_tensors(group, folder / fname)
        weight_map.update({n: fname for n, _ in group})
    write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, folder / "model.safetensors.index.json")


def target_form_tensors(master: dict[str, torch.Tensor], cfg: dict, form: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The master's tensors as stored in ``form`` ("float", "bf16", "fp8", "int4"), canonical names."""
    linears = {m: routed for m, _, routed in target_linears(cfg)}
    for name, t in master.items():
        module = name.removesuffix(".weight")
        if name.endswith("e_score_correction_bias"):
            yield name, t.float()
        elif form == "float":
            yield name, t.float()
        elif form == "fp8" and module in linears:
            q, s = quant.quantize_fp8(t, BLOCK)
            yield name, q
            yield module + ".weight_scale_inv", s
        elif form == "int4" and linears.get(module):
            packed, scale, shape = quant.quantize_int4(t, INT4_GROUP)
            yield module + ".weight_packed", packed
            yield module + ".weight_scale", scale
            yield module + ".weight_shape", shape
        else:
            yield name, t.to(torch.bfloat16)


def _k25_config(cfg: dict) -> dict:
    text = copy.deepcopy(cfg)
    text["model_type"] = "deepseek_v3"
    text["quantization_config"] = int4_config(K25_IGNORE)
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
            "vision_config": {"vt_hidden_size": 64, "vt_num_hidden_layers": 1, "text_hidden_size": cfg["hidden_size"]},
            "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "torch_dtype": "bfloat16"}


def _vision_tensors(cfg: dict, g: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    return [("vision_tower.encoder.blocks.0.attn.wqkv.weight", torch.randn(192, 64, generator=g).bfloat16()),
            ("vision_tower.patch_embed.proj.weight", torch.randn(64, 3, 14, 14, generator=g).bfloat16()),
            ("mm_projector.proj.0.weight", torch.randn(cfg["hidden_size"], 64, generator=g).bfloat16())]


def write_target_form(folder: Path, master: dict[str, torch.Tensor], cfg: dict, form: str) -> None:
    """Write the target ``master`` in ``form`` (one of :data:`TARGET_FORMS`) into ``folder``."""
    if form == "float":
        write_checkpoint(folder, target_form_tensors(master, cfg, "float"), dict(cfg, torch_dtype="float32"))
    elif form == "bf16":
        write_checkpoint(folder, target_form_tensors(master, cfg, "bf16"), cfg)
    elif form == "fp8":
        write_checkpoint(folder, target_form_tensors(master, cfg, "fp8"), dict(cfg, quantization_config=FP8_CONFIG))
    elif form == "int4":
        write_checkpoint(folder, target_form_tensors(master, cfg, "int4"), dict(cfg, quantization_config=int4_config(K2_THINKING_IGNORE)))
    elif form == "k25":
        items = [("language_model." + n, t) for n, t in target_form_tensors(master, cfg, "int4")]
        items += _vision_tensors(cfg, torch.Generator().manual_seed(7))
        write_checkpoint(folder, items, _k25_config(cfg), shards=3)
    else:
        raise ValueError(f"unknown target form {form!r}")


def write_int4_copy(src: Path, out: Path) -> Path:
    """``out``: the Hugging Face target ``src`` (e.g. the demo's) in the K2-Thinking INT4 form, with its tokenizer files."""
    from splitspec.convert.pair import tokenizer_files

    r = CheckpointReader(Path(src))
    master = {n: r.get(n).float() for n in r.names() if not n.endswith("rotary_emb.inv_freq")}
    r.close()
    write_target_form(out, master, read_json(Path(src) / "config.json"), "int4")
    for f in tokenizer_files(src):
        (Path(out) / f).write_bytes((Path(src) / f).read_bytes())
    return Path(out)


def write_drafter_form(folder: Path, dm: dict[str, torch.Tensor], target_cfg: dict, target: dict[str, torch.Tensor], form: str) -> None:
    """Write the drafter master ``dm`` as variant ``form`` (one of :data:`DRAFTER_FORMS`) into ``folder``."""
    layer = {k: v.to(torch.bfloat16) for k, v in dm.items() if k.startswith("midlayer.") or k in ("fc.weight", "norm.weight")}
    ids, V = dm["draft_ids"], target_cfg["vocab_size"]
    reduced = {"lm_head.weight": dm["lm_head_full"][ids].to(torch.bfloat16),
               "d2t": (ids - torch.arange(len(ids))).to(torch.int64)}
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    dv = len(ids)
    if form == "drafter":
        cfg = drafter_config(target_cfg, dv, [0, 1, 3], aux_layer_id_convention="input")
        tensors = layer | reduced | {"t2d": t2d}
    elif form == "drafter_modelopt":
        cfg = drafter_config(target_cfg, V, [0, 1, 2], **MODELOPT_KEYS)
        tensors = layer | {"lm_head.weight": dm["lm_head_full"].to(torch.bfloat16),
                           "embed_tokens.weight": target["model.embed_tokens.weight"].to(torch.bfloat16)}
    elif form == "drafter_own_embed":
        cfg = drafter_config(target_cfg, dv, [0, 1, 2])
        tensors = layer | reduced | {"embed_tokens.weight": dm["own_embed"].to(torch.bfloat16)}
    elif form == "drafter_norm_fc":
        cfg = drafter_config(target_cfg, dv, [0, 1, 3], aux_layer_id_convention="input", norm_before_fc=True)
        tensors = layer | reduced | {"t2d": t2d, "input_norm.weight": dm["input_norm"].to(torch.bfloat16)}
    else:
        raise ValueError(f"unknown drafter form {form!r}")
    write_checkpoint(folder, sorted(tensors.items()), cfg, shards=1)


def make_fixtures(out: Path, seed: int = 0, forms: Iterable[str] = TARGET_FORMS + DRAFTER_FORMS) -> Path:
    """Write the fixture set (see the module docstring) into ``out`` atomically; returns ``out``."""
    cfg = target_config()
    master = target_master(cfg, seed)
    dbase = drafter_config(cfg, 128, [0, 1, 3])
    dm = drafter_master(dbase, seed + 1)
    with atomic_dir(Path(out)) as tmp:
        write_tensors(master.items(), tmp / "master.safetensors")
        write_tensors(((k, v) for k, v in dm.items()), tmp / "drafter_master.safetensors")
        write_json(cfg, tmp / "target_config.json")
        for form in forms:
            if form in TARGET_FORMS:
                write_target_form(tmp / form, master, cfg, form)
            else:
                write_drafter_form(tmp / form, dm, cfg, master, form)
    return Path(out)


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(make_fixtures(Path(sys.argv[1] if len(sys.argv) > 1 else "fixtures")))
