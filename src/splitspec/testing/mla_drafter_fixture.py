"""An MLA EAGLE-3 drafter (``Eagle3DeepseekV2ForCausalLM``) for any target checkpoint folder, for tests.

:func:`write_mla_drafter` writes one in each form of :data:`MLA_DRAFTER_FORMS`: ``mla`` as
lightseekorg/kimi-k2.5-eagle3-mla is loaded (``layers.0.*``, its own ``embed_tokens`` equal to the target's, full
vocabulary, no ``d2t``/``t2d``, aux convention undeclared), ``mla31`` the EAGLE-3.1 revision (``fc_norm`` +
``norm_output``, ``fc_norm.{0,1,2}.weight``; here with a reduced vocabulary, ``d2t`` and ``t2d``, declared input
convention), ``mla_modelopt`` a ModelOpt export (``midlayer.*``, ModelOpt ``eagle_config`` keys, no embedding, no
``lm_head``: the target's). The Llama-attention drafters and the target forms are :mod:`splitspec.testing.fixtures`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from splitspec.convert.safetensors import CheckpointReader
from splitspec.files import atomic_dir, read_json
from splitspec.testing.fixtures import MODELOPT_KEYS, bf16_exact, write_checkpoint

MLA_DRAFTER_FORMS = ("mla", "mla31", "mla_modelopt")


def mla_drafter_config(target: dict, draft_vocab: int, aux_ids: list[int], **eagle) -> dict:
    """``config.json`` of an MLA EAGLE-3 drafter for ``target`` with the fields the published Kimi-K2.5 MLA drafters
    carry (k-l-lambda/Kimi-K2.5-Eagle3's config: ``Eagle3DeepseekV2ForCausalLM``, ``model_type`` kimi_k2, the target's
    YaRN rope, a leftover Llama ``head_dim``), at toy size: 4 heads, q_lora 64, kv_lora 32, nope/rope/v 16."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 1,
        "hidden_size": target["hidden_size"], "intermediate_size": 2 * target["hidden_size"], "hidden_act": "silu",
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 128, "q_lora_rank": 64, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "rms_norm_eps": 1e-5, "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab,
        "max_position_embeddings": target["max_position_embeddings"], "rope_theta": target["rope_theta"],
        "rope_scaling": dict(target["rope_scaling"]), "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True, **eagle},
    }


def mla_drafter_master(dcfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """An MLA drafter's float weights under ``midlayer.*`` names (bf16-representable), ``fc_norm.{i}.weight``,
    ``lm_head_full`` [vocab, H] and ``draft_ids`` (sorted target ids of a quarter of the vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    lin = lambda o, i, s=1.0: bf16_exact(rnd(o, i) * s / math.sqrt(i))  # noqa: E731
    norm = lambda n: bf16_exact(1 + 0.05 * rnd(n))  # noqa: E731
    H, I, V, nh = dcfg["hidden_size"], dcfg["intermediate_size"], dcfg["vocab_size"], dcfg["num_attention_heads"]
    ql, kl, nope, rope, v = (dcfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    t = {a + "q_a_proj.weight": lin(ql, 2 * H), a + "q_a_layernorm.weight": norm(ql), a + "q_b_proj.weight": lin(nh * (nope + rope), ql),
         a + "kv_a_proj_with_mqa.weight": lin(kl + rope, 2 * H), a + "kv_a_layernorm.weight": norm(kl),
         a + "kv_b_proj.weight": lin(nh * (nope + v), kl), a + "o_proj.weight": lin(H, nh * v, 0.7),
         m + "gate_proj.weight": lin(I, H), m + "up_proj.weight": lin(I, H), m + "down_proj.weight": lin(H, I, 0.7),
         "midlayer.input_layernorm.weight": norm(H), "midlayer.hidden_norm.weight": norm(H),
         "midlayer.post_attention_layernorm.weight": norm(H), "fc.weight": lin(H, 3 * H), "norm.weight": norm(H),
         "lm_head_full": bf16_exact(0.08 * rnd(V, H))}
    t |= {f"fc_norm.{i}.weight": norm(H) for i in range(3)}
    t["draft_ids"] = torch.randperm(V, generator=g)[: V // 4].sort().values
    return t


def write_mla_drafter(folder: Path, target_dir: Path, form: str, seed: int = 11) -> dict[str, torch.Tensor]:
    """Write an MLA EAGLE-3 drafter for the target checkpoint in ``target_dir`` as ``form`` (one of
    :data:`MLA_DRAFTER_FORMS`, see the module docstring) into ``folder``, atomically. Aux ids: inputs to layers 1, 2
    and N−1 of an N-layer target. Returns the master weights it came from (:func:`mla_drafter_master`)."""
    target = read_json(Path(target_dir) / "config.json")
    n, V = target["num_hidden_layers"], target["vocab_size"]
    dm = mla_drafter_master(mla_drafter_config(target, V, [1, 2, n - 1]), seed)
    layer = {k: v for k, v in dm.items() if k.startswith("midlayer.") or k in ("fc.weight", "norm.weight")}
    ids = dm["draft_ids"]
    if form == "mla":
        cfg = mla_drafter_config(target, V, [1, 2, n - 1])
        reader = CheckpointReader(Path(target_dir))
        embed = reader.get("model.embed_tokens.weight")
        reader.close()
        tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in layer.items()} | {
            "embed_tokens.weight": embed, "lm_head.weight": dm["lm_head_full"]}
    elif form == "mla31":
        cfg = mla_drafter_config(target, len(ids), [1, 2, n - 1], aux_layer_id_convention="input") | {"fc_norm": True, "norm_output": True}
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[ids] = True
        tensors = layer | {f"fc_norm.{i}.weight": dm[f"fc_norm.{i}.weight"] for i in range(3)} | {
            "lm_head.weight": dm["lm_head_full"][ids], "d2t": ids - torch.arange(len(ids)), "t2d": t2d}
    elif form == "mla_modelopt":
        cfg = mla_drafter_config(target, V, [0, 1, n - 2], **MODELOPT_KEYS)
        tensors = layer
    else:
        raise ValueError(f"unknown MLA drafter form {form!r}")
    with atomic_dir(Path(folder)) as tmp:
        write_checkpoint(tmp, sorted((k, v if v.dtype in (torch.int64, torch.bool) else v.to(torch.bfloat16)) for k, v in tensors.items()),
                         cfg, shards=1)
    return dm
