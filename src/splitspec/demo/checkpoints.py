"""Tiny demo checkpoints in the published formats: a Kimi-K2 target and its EAGLE-3 drafter.

:func:`write_random_pair` writes the pair with random but deterministic weights (``splitspec
demo-models --random``, and the numerics tests); :func:`write_target_checkpoint` and
:func:`write_drafter_checkpoint` write the trained pair's weights in the same layout
(:mod:`splitspec.demo.pair`). A pair folder holds

- ``target/``: a Hugging Face Kimi-K2 checkpoint (``model_type: kimi_k2``, architecture
  ``DeepseekV3ForCausalLM``): MLA attention, one dense layer then MoE layers with a
  ``noaux_tc`` sigmoid router, bf16 tensors (``e_score_correction_bias`` float32) in two
  safetensors shards with ``model.safetensors.index.json``, plus the tokenizer files;
- ``drafter/``: an EAGLE-3 drafter (``LlamaForCausalLMEagle3``) in the published layout: one
  ``midlayer``, ``fc`` over three aux hidden states, a reduced draft vocabulary with ``d2t``
  (offset form) and ``t2d``, no embedding;
- ``README.md`` describing the folder.

The shapes are small enough for a CPU; every name, dtype and config field follows the real
checkpoints, so converters and engines run the same code paths on them.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from splitspec.demo.corpus import stdlib_corpus
from splitspec.demo.report import log
from splitspec.demo.tokenizer_train import count_token_frequencies, select_draft_vocab, train_tokenizer
from splitspec.files import atomic_dir, default_permissions, write_json
from splitspec.runtime.tokenizer import BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN, ChatTokenizer

VOCAB_SIZE = 4096
DRAFT_VOCAB_SIZE = 1024
TARGET_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")

# Initialisation scales. Projections have unit gain (std 1/sqrt(fan_in)) so every sublayer
# contributes to the residual stream as much as the embedding does: with a std of 0.02 the
# tiny model collapses to embed -> norm -> lm_head and an attention or RoPE bug would barely
# move the logits. Output projections (o_proj, down_proj) are scaled by 1/sqrt(2 * layers).
EMBED_STD = 1.0
LM_HEAD_STD = 0.08  # logits std ~1.3 over the vocabulary: no near-ties for greedy decoding
NORM_NOISE_STD = 0.05  # norms = 1 + noise, so a missing or misplaced norm weight shows
ROUTER_STD = 0.1
CORRECTION_BIAS_STD = 0.1  # non-zero: selection-only use of the bias matters


def target_config(bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """Return the demo target's ``config.json`` (a Kimi-K2 config at toy size).

    Args:
        bos_id, eos_id, pad_id: token ids of ``[BOS]``, ``[EOS]`` and ``[PAD]``.
    """
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": VOCAB_SIZE, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 128,
        "num_hidden_layers": 5, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_attention_heads": 8, "num_key_value_heads": 8,
        "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "initializer_range": 0.02,
        "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "torch_dtype": "bfloat16",
    }


def drafter_config(bos_id: int, eos_id: int) -> dict[str, Any]:
    """Return the demo drafter's ``config.json`` (EAGLE-3, one layer, aux layers [1, 2, 4] as layer inputs).

    Args:
        bos_id, eos_id: token ids of ``[BOS]`` and ``[EOS]``.
    """
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 32,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "draft_vocab_size": DRAFT_VOCAB_SIZE,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rope_scaling": None, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": bos_id, "eos_token_id": eos_id,
        "target_hidden_size": 256,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4], "aux_layer_id_convention": "input",
                         "use_aux_hidden_state": True},
    }


# (name, shape, kind, extra scale); kinds: embed, linear, lm_head, norm, router, bias.
_Spec = tuple[str, tuple[int, ...], str, float]


def _target_specs(cfg: dict[str, Any]) -> list[list[_Spec]]:
    """Tensor specs of the target, grouped per layer: [embed], layer 0, ..., layer L-1, [norm, lm_head]."""
    h, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    n_layers = cfg["num_hidden_layers"]
    out_scale = 1.0 / math.sqrt(2 * n_layers)
    groups: list[list[_Spec]] = [[("model.embed_tokens.weight", (cfg["vocab_size"], h), "embed", 1.0)]]

    def mlp(prefix: str, inter: int) -> list[_Spec]:
        return [(f"{prefix}.gate_proj.weight", (inter, h), "linear", 1.0),
                (f"{prefix}.up_proj.weight", (inter, h), "linear", 1.0),
                (f"{prefix}.down_proj.weight", (h, inter), "linear", out_scale)]

    for n in range(n_layers):
        p = f"model.layers.{n}"
        specs: list[_Spec] = [
            (f"{p}.input_layernorm.weight", (h,), "norm", 1.0),
            (f"{p}.self_attn.q_a_proj.weight", (cfg["q_lora_rank"], h), "linear", 1.0),
            (f"{p}.self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],), "norm", 1.0),
            (f"{p}.self_attn.q_b_proj.weight", (n_heads * qk_head, cfg["q_lora_rank"]), "linear", 1.0),
            (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
             "linear", 1.0),
            (f"{p}.self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],), "norm", 1.0),
            (f"{p}.self_attn.kv_b_proj.weight",
             (n_heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]), "linear", 1.0),
            (f"{p}.self_attn.o_proj.weight", (h, n_heads * cfg["v_head_dim"]), "linear", out_scale),
            (f"{p}.post_attention_layernorm.weight", (h,), "norm", 1.0),
        ]
        if n < cfg["first_k_dense_replace"]:
            specs += mlp(f"{p}.mlp", cfg["intermediate_size"])
        else:
            n_exp = cfg["n_routed_experts"]
            specs += [(f"{p}.mlp.gate.weight", (n_exp, h), "router", 1.0),
                      (f"{p}.mlp.gate.e_score_correction_bias", (n_exp,), "bias", 1.0)]
            for e in range(n_exp):
                specs += mlp(f"{p}.mlp.experts.{e}", cfg["moe_intermediate_size"])
            specs += mlp(f"{p}.mlp.shared_experts", cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
        groups.append(specs)
    groups.append([("model.norm.weight", (h,), "norm", 1.0),
                   ("lm_head.weight", (cfg["vocab_size"], h), "lm_head", 1.0)])
    return groups


def _drafter_specs(cfg: dict[str, Any]) -> list[_Spec]:
    """Tensor specs of the drafter's float tensors (``d2t``/``t2d`` come from the vocabulary)."""
    h, hd, nh, nkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, th = cfg["intermediate_size"], cfg["target_hidden_size"]
    out_scale = 1.0 / math.sqrt(2)
    return [
        ("midlayer.input_layernorm.weight", (h,), "norm", 1.0),
        ("midlayer.hidden_norm.weight", (h,), "norm", 1.0),
        ("midlayer.self_attn.q_proj.weight", (nh * hd, 2 * h), "linear", 1.0),
        ("midlayer.self_attn.k_proj.weight", (nkv * hd, 2 * h), "linear", 1.0),
        ("midlayer.self_attn.v_proj.weight", (nkv * hd, 2 * h), "linear", 1.0),
        ("midlayer.self_attn.o_proj.weight", (h, nh * hd), "linear", out_scale),
        ("midlayer.post_attention_layernorm.weight", (h,), "norm", 1.0),
        ("midlayer.mlp.gate_proj.weight", (inter, h), "linear", 1.0),
        ("midlayer.mlp.up_proj.weight", (inter, h), "linear", 1.0),
        ("midlayer.mlp.down_proj.weight", (h, inter), "linear", out_scale),
        ("fc.weight", (h, 3 * th), "linear", 1.0),
        ("norm.weight", (h,), "norm", 1.0),
        ("lm_head.weight", (cfg["draft_vocab_size"], h), "lm_head", 1.0),
    ]


def _init_tensor(shape: tuple[int, ...], kind: str, scale: float, gen: torch.Generator) -> torch.Tensor:
    """Draw one tensor (float32 draws from ``gen``); bf16 except the float32 correction bias."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if kind == "embed":
        x = x * EMBED_STD
    elif kind == "linear":
        x = x * (scale / math.sqrt(shape[-1]))
    elif kind == "lm_head":
        x = x * LM_HEAD_STD
    elif kind == "norm":
        x = 1.0 + NORM_NOISE_STD * x
    elif kind == "router":
        x = x * ROUTER_STD
    elif kind == "bias":
        return (x * CORRECTION_BIAS_STD).contiguous()
    else:  # pragma: no cover - internal table error
        raise AssertionError(kind)
    return x.to(torch.bfloat16).contiguous()


def _target_shard(name: str, n_layers: int) -> int:
    """Shard index (0 or 1) of a target tensor: shard 1 holds the embedding and layers [0, (L+1)//2)."""
    split = (n_layers + 1) // 2
    if name.startswith("model.embed_tokens."):
        return 0
    if name.startswith("model.layers."):
        return 0 if int(name.split(".")[2]) < split else 1
    return 1


def write_target_checkpoint(target_dir: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor],
                            eos_ids: list[int]) -> int:
    """Write a target's weights in two safetensors shards with ``model.safetensors.index.json``,
    plus ``config.json`` and ``generation_config.json``.

    Args:
        target_dir: existing folder to write into.
        cfg: the target's ``config.json`` dict.
        tensors: published tensor names -> tensors (bf16, ``e_score_correction_bias`` float32), in
            the order they are to be stored.
        eos_ids: ``generation_config.json`` stop ids ([EOS], ``<|im_end|>``).

    Returns:
        The parameter count.
    """
    from safetensors.torch import save_file

    n_layers = cfg["num_hidden_layers"]
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, t in tensors.items():
        shards[_target_shard(name, n_layers)][name] = t.contiguous()
    weight_map: dict[str, str] = {}
    total_bytes = 0
    n_params = 0
    for fname, part in zip(TARGET_SHARDS, shards):
        save_file(part, str(target_dir / fname), metadata={"format": "pt"})
        for name, t in part.items():
            weight_map[name] = fname
            total_bytes += t.numel() * t.element_size()
            n_params += t.numel()
    write_json({"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))},
               target_dir / "model.safetensors.index.json", ensure_ascii=False)
    write_json(cfg, target_dir / "config.json", ensure_ascii=False)
    write_json({"bos_token_id": cfg["bos_token_id"], "eos_token_id": eos_ids, "pad_token_id": cfg["pad_token_id"]},
               target_dir / "generation_config.json", ensure_ascii=False)
    return n_params


def _write_target(target_dir: Path, cfg: dict[str, Any], eos_ids: list[int], seed: int) -> int:
    """Write the random target's weights, index, config and generation config. Returns the parameter count."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for specs in _target_specs(cfg):
        for name, shape, kind, scale in specs:
            tensors[name] = _init_tensor(shape, kind, scale, gen)
    return write_target_checkpoint(target_dir, cfg, tensors, eos_ids)


def write_drafter_checkpoint(drafter_dir: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor],
                             draft_ids: torch.Tensor) -> int:
    """Write an EAGLE-3 drafter's ``model.safetensors`` (float tensors + ``d2t``/``t2d``) and ``config.json``.

    Args:
        drafter_dir: existing folder to write into.
        cfg: the drafter's ``config.json`` dict.
        tensors: published float tensors (``midlayer.*``, ``fc.weight``, ``norm.weight``, ``lm_head.weight``).
        draft_ids: int64 [draft_vocab], ascending target ids of the draft vocabulary.

    Returns:
        The parameter count (``d2t``/``t2d`` excluded).
    """
    from safetensors.torch import save_file

    tensors = {name: t.contiguous() for name, t in tensors.items()}
    n_draft = draft_ids.numel()
    tensors["d2t"] = (draft_ids.to(torch.int64) - torch.arange(n_draft, dtype=torch.int64)).contiguous()
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[draft_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(drafter_dir / "model.safetensors"), metadata={"format": "pt"})
    write_json(cfg, drafter_dir / "config.json", ensure_ascii=False)
    return sum(t.numel() for name, t in tensors.items() if name not in ("d2t", "t2d"))


def _write_drafter(drafter_dir: Path, cfg: dict[str, Any], draft_ids: torch.Tensor, seed: int) -> int:
    """Write the random drafter's ``model.safetensors`` and ``config.json``. Returns the parameter count."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape, kind, scale in _drafter_specs(cfg):
        tensors[name] = _init_tensor(shape, kind, scale, gen)
    return write_drafter_checkpoint(drafter_dir, cfg, tensors, draft_ids)


_README = """\
# Demo models (random weights)

This folder holds two tiny checkpoints with random, seeded weights (seed {seed}) for exercising the
splitspec pipeline without downloading anything: `target/` is a Kimi-K2-format Hugging Face checkpoint
(`model_type: kimi_k2`, architecture `DeepseekV3ForCausalLM`, {n_layers} layers with MLA attention, the first
dense and the rest Mixture-of-Experts with {n_experts} routed experts, {top_k} per token, one shared expert and a
`noaux_tc` sigmoid router; {target_params:,} parameters in bf16, `e_score_correction_bias` in float32, sharded
into two safetensors files with `model.safetensors.index.json`) together with a byte-level BPE tokenizer of
{vocab} tokens trained on the Python standard library's sources (Kimi-style chat tokens and chat template,
readable by `transformers.AutoTokenizer`); `drafter/` is an EAGLE-3 drafter in the published
`LlamaForCausalLMEagle3` layout (one `midlayer`, `fc` over the target's aux hidden states of layers
{aux} read as layer inputs, a {draft_vocab}-token draft vocabulary of the most frequent target tokens with
`d2t` offsets and a `t2d` mask, no embedding of its own; {drafter_params:,} parameters). The weights are
random, so generated text is meaningless and acceptance lengths are low; only formats and numerics are real.
"""


def write_random_pair(out_dir: Path, seed: int = 0) -> None:
    """Write the demo target, drafter, tokenizer and README with random weights into ``out_dir``.

    The pair (laid out as the module says; ``d2t`` int64 [1024], ``t2d`` bool [4096]) is written in
    seconds and exercises formats and numerics only (acceptance length ≈ 1). Everything is built in a
    temporary sibling folder and renamed into place; an existing ``out_dir`` is replaced only once the
    new one is complete. The same ``seed`` on the same Python installation (the tokenizer corpus)
    gives identical files.

    Args:
        out_dir: destination folder.
        seed: seed of the torch generators (target ``seed``, drafter ``seed + 1``).

    Raises:
        ConfigError: ``out_dir`` is an existing file (:func:`splitspec.files.atomic_dir`).
    """
    out_dir = Path(out_dir).absolute()
    t0 = time.perf_counter()
    with atomic_dir(out_dir) as tmp:
        target_dir = tmp / "target"
        drafter_dir = tmp / "drafter"
        target_dir.mkdir()
        drafter_dir.mkdir()

        log(f"training byte-level BPE tokenizer ({VOCAB_SIZE} tokens) on the Python standard library sources")
        train_tokenizer(target_dir, vocab_size=VOCAB_SIZE)
        tok = ChatTokenizer.from_dir(target_dir)
        ids = {t: tok.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_END_TOKEN)}

        tcfg = target_config(ids[BOS_TOKEN], ids[EOS_TOKEN], ids[PAD_TOKEN])
        log(f"writing target (Kimi-K2 layout, {tcfg['num_hidden_layers']} layers, "
            f"{tcfg['n_routed_experts']} experts) with seed {seed}")
        target_params = _write_target(target_dir, tcfg, [ids[EOS_TOKEN], ids[IM_END_TOKEN]], seed)
        log(f"target: {target_params:,} parameters")

        log(f"choosing the {DRAFT_VOCAB_SIZE}-token draft vocabulary from token frequencies on the corpus")
        counts = count_token_frequencies(tok, stdlib_corpus())
        draft_ids = select_draft_vocab(counts, DRAFT_VOCAB_SIZE, always_include=[ids[EOS_TOKEN], ids[IM_END_TOKEN]])
        dcfg = drafter_config(ids[BOS_TOKEN], ids[EOS_TOKEN])
        log(f"writing EAGLE-3 drafter with seed {seed + 1}")
        drafter_params = _write_drafter(drafter_dir, dcfg, torch.from_numpy(draft_ids), seed + 1)
        log(f"drafter: {drafter_params:,} parameters")

        (tmp / "README.md").write_text(_README.format(
            seed=seed, n_layers=tcfg["num_hidden_layers"], n_experts=tcfg["n_routed_experts"],
            top_k=tcfg["num_experts_per_tok"], target_params=target_params, vocab=VOCAB_SIZE,
            aux=dcfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"], draft_vocab=DRAFT_VOCAB_SIZE,
            drafter_params=drafter_params), encoding="utf-8")

        default_permissions(tmp)
    log(f"wrote {out_dir} in {time.perf_counter() - t0:.1f} s")
