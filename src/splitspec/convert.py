"""Convert: read a Hugging Face target + EAGLE-3 drafter pair, check they fit, write rank-sharded checkpoints.

Output layout (``checkpoints/<name>/``)::

    target/config.json            {"format", "kind": "target", "config", "mapping", "source"}
    target/rank{i}.safetensors    Hugging Face tensor names, each sliced for rank i
    target/tokenizer*.json        copied from the target checkpoint
    drafter/config.json           {"format", "kind": "drafter", "config", "source", "embedding"}
    drafter/rank0.safetensors     drafter tensors (+ the target's embed_tokens when the drafter has none)

Tensors are read and written one at a time per rank, so peak memory is one rank's output
plus one tensor. Every tensor in either checkpoint is used or reported as unused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from splitspec.config import DrafterConfig, Mapping, TargetConfig
from splitspec.errors import CheckpointError
from splitspec.io import CheckpointReader, atomic_dir, read_json, save_tensors, write_json

FORMAT = "splitspec-checkpoint-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _split(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[index]


def target_rank_tensors(reader: CheckpointReader, cfg: TargetConfig, mapping: Mapping, rank: int):
    """Yield (name, tensor) of target rank ``rank`` under Hugging Face names, sliced for TP/EP.

    Split rules: q_b_proj/kv_b_proj rows and o_proj columns by head; dense and shared-expert
    gate/up rows and down columns by intermediate; routed experts by expert group (EP) and
    intermediate slice (expert-TP); embed_tokens/lm_head rows by vocabulary. q_a_proj,
    kv_a_proj_with_mqa, their norms, the router and all layer norms are replicated.
    Every tensor's shape and dtype is checked against ``cfg``.
    """
    tp, H = mapping.tp_size, cfg.hidden_size
    heads, mtp, mrank = cfg.num_attention_heads, mapping.moe_tp_size, mapping.moe_tp_rank(rank)

    def get(name, shape, dtype=FLOAT_DTYPES):
        return reader.get(name, shape, dtype)

    yield "model.embed_tokens.weight", _split(get("model.embed_tokens.weight", (cfg.vocab_size, H)), 0, tp, rank)
    yield "lm_head.weight", _split(get("lm_head.weight", (cfg.vocab_size, H)), 0, tp, rank)
    yield "model.norm.weight", get("model.norm.weight", (H,))
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        for n in ("input_layernorm", "post_attention_layernorm"):
            yield p + n + ".weight", get(p + n + ".weight", (H,))
        yield a + "q_a_proj.weight", get(a + "q_a_proj.weight", (cfg.q_lora_rank, H))
        yield a + "q_a_layernorm.weight", get(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        yield a + "kv_a_proj_with_mqa.weight", get(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H))
        yield a + "kv_a_layernorm.weight", get(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        yield a + "q_b_proj.weight", _split(get(a + "q_b_proj.weight", (heads * cfg.qk_head_dim, cfg.q_lora_rank)), 0, tp, rank)
        yield a + "kv_b_proj.weight", _split(get(a + "kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)), 0, tp, rank)
        yield a + "o_proj.weight", _split(get(a + "o_proj.weight", (H, heads * cfg.v_head_dim)), 1, tp, rank)
        m = p + "mlp."
        if not cfg.is_moe_layer(layer):
            for n in ("gate_proj", "up_proj"):
                yield m + n + ".weight", _split(get(m + n + ".weight", (cfg.intermediate_size, H)), 0, tp, rank)
            yield m + "down_proj.weight", _split(get(m + "down_proj.weight", (H, cfg.intermediate_size)), 1, tp, rank)
            continue
        E = cfg.n_routed_experts
        yield m + "gate.weight", get(m + "gate.weight", (E, H))
        yield m + "gate.e_score_correction_bias", get(m + "gate.e_score_correction_bias", (E,), (torch.float32, torch.bfloat16))
        per = E // mapping.ep_size
        first = mapping.ep_rank(rank) * per
        for e in range(E):
            x = f"{m}experts.{e}."
            if not first <= e < first + per:
                continue
            for n in ("gate_proj", "up_proj"):
                yield x + n + ".weight", _split(get(x + n + ".weight", (cfg.moe_intermediate_size, H)), 0, mtp, mrank)
            yield x + "down_proj.weight", _split(get(x + "down_proj.weight", (H, cfg.moe_intermediate_size)), 1, mtp, mrank)
        if cfg.n_shared_experts:
            s, inter = m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts
            for n in ("gate_proj", "up_proj"):
                yield s + n + ".weight", _split(get(s + n + ".weight", (inter, H)), 0, tp, rank)
            yield s + "down_proj.weight", _split(get(s + "down_proj.weight", (H, inter)), 1, tp, rank)


def check_pair(target: TargetConfig, drafter: DrafterConfig, drafter_dir: Path) -> None:
    """Check that the drafter fits the target.

    Raises:
        CheckpointError: naming the drafter config field that disagrees (target_hidden_size,
            vocab_size, aux layer ids out of range).
    """
    where = drafter_dir / "config.json"
    if drafter.target_hidden_size != target.hidden_size:
        raise CheckpointError(f"{where}: target_hidden_size = {drafter.target_hidden_size}, but the target's hidden_size is {target.hidden_size}")
    if drafter.vocab_size != target.vocab_size:
        raise CheckpointError(f"{where}: vocab_size = {drafter.vocab_size}, but the target's vocab_size is {target.vocab_size}")
    if drafter.draft_vocab_size > drafter.vocab_size:
        raise CheckpointError(f"{where}: draft_vocab_size = {drafter.draft_vocab_size} exceeds vocab_size = {drafter.vocab_size}")
    n = target.num_hidden_layers
    for i, point in zip(drafter.aux_layer_ids, drafter.capture_points()):
        if point > n:
            raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids contains {i}, out of range for a "
                                  f"{n}-layer target under the '{drafter.aux_convention}' convention")


def read_draft_vocab(reader: CheckpointReader, cfg: DrafterConfig) -> torch.Tensor:
    """Read d2t (offsets: target id = draft id + d2t[draft id]) and check it against t2d.

    Returns draft_to_target [draft_vocab] int64 (absolute target ids).
    Raises:
        CheckpointError: a reduced vocabulary without d2t; ids outside the target vocabulary;
            a mapping that is not one-to-one; t2d disagreeing with d2t.
    """
    dv, v = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in reader:
        if dv < v:
            raise CheckpointError(f"{reader.folder}: draft_vocab_size {dv} < vocab_size {v} but tensor 'd2t' is missing")
        return torch.arange(dv, dtype=torch.int64)
    d2t = reader.get("d2t", (dv,), (torch.int64, torch.int32)).to(torch.int64)
    mapped = torch.arange(dv, dtype=torch.int64) + d2t
    if mapped.min() < 0 or mapped.max() >= v:
        bad = int(((mapped < 0) | (mapped >= v)).nonzero()[0])
        raise CheckpointError(f"{reader.folder}: d2t maps draft id {bad} to target id {int(mapped[bad])}, outside the target vocabulary [0, {v})")
    if mapped.unique().numel() != dv:
        raise CheckpointError(f"{reader.folder}: d2t is not one-to-one (two draft ids map to the same target id)")
    if "t2d" in reader:
        t2d = reader.get("t2d", (v,), (torch.bool, torch.uint8, torch.int64)).bool()
        expect = torch.zeros(v, dtype=torch.bool)
        expect[mapped] = True
        if not torch.equal(t2d, expect):
            raise CheckpointError(f"{reader.folder}: t2d disagrees with d2t at {int((t2d != expect).sum())} target ids")
    return mapped


def drafter_tensors(reader: CheckpointReader, cfg: DrafterConfig, target_reader: CheckpointReader) -> tuple[dict, str]:
    """Read and check every drafter tensor. Returns (tensors under published names plus
    ``draft_to_target`` and ``embed_tokens.weight``, a note on where the embedding came from)."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    shapes = {
        "midlayer.self_attn.q_proj.weight": (nq * hd, 2 * H), "midlayer.self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (nkv * hd, 2 * H), "midlayer.self_attn.o_proj.weight": (H, nq * hd),
        "midlayer.mlp.gate_proj.weight": (I, H), "midlayer.mlp.up_proj.weight": (I, H), "midlayer.mlp.down_proj.weight": (H, I),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,), "midlayer.post_attention_layernorm.weight": (H,),
        "fc.weight": (H, 3 * cfg.target_hidden_size), "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H),
    }
    if "fc.weight" in reader and reader.get("fc.weight").shape[1] != 3 * cfg.target_hidden_size:
        raise CheckpointError(f"{reader.folder}: tensor 'fc.weight' has {reader.get('fc.weight').shape[1]} input columns, "
                              f"expected 3 × target hidden size = {3 * cfg.target_hidden_size}")
    out = {name: reader.get(name, shape, FLOAT_DTYPES) for name, shape in shapes.items()}
    out["draft_to_target"] = read_draft_vocab(reader, cfg)
    target_embed = target_reader.get("model.embed_tokens.weight", (cfg.vocab_size, cfg.target_hidden_size), FLOAT_DTYPES)
    own = next((n for n in ("embed_tokens.weight", "model.embed_tokens.weight") if n in reader), None)
    if own is None:
        out["embed_tokens.weight"], note = target_embed, "shared from the target (drafter has none)"
    else:
        emb = reader.get(own, (cfg.vocab_size, H), FLOAT_DTYPES)
        same = emb.shape == target_embed.shape and torch.equal(emb.float(), target_embed.float())
        out["embed_tokens.weight"] = emb
        note = "drafter's own, equal to the target's" if same else "drafter's own (DIFFERS from the target's; the drafter's is used)"
    return out, note


def convert_pair(target_dir: Path, drafter_dir: Path, out: Path, tp_size: int = 2, ep_size: int = 1,
                 aux_convention: str | None = None) -> Path:
    """Check a target/drafter pair and write ``out/target`` (TP-``tp_size`` shards) and ``out/drafter`` (TP1).

    Args:
        target_dir: Hugging Face Kimi-K2 / DeepSeek-V3 checkpoint folder.
        drafter_dir: Hugging Face EAGLE-3 drafter folder.
        out: output folder, replaced atomically on success.
        tp_size, ep_size: target mapping (see :class:`splitspec.config.Mapping`).
        aux_convention: "input" or "output", when the drafter's config does not declare it.
    Returns: ``out``.
    Raises:
        CheckpointError / ConfigError: a clear message naming the file, tensor or field; ``out`` untouched.
    """
    target_dir, drafter_dir, out = Path(target_dir), Path(drafter_dir), Path(out)
    tcfg = TargetConfig.from_hf(read_json(target_dir / "config.json"), str(target_dir / "config.json"))
    dcfg = DrafterConfig.from_hf(read_json(drafter_dir / "config.json"), str(drafter_dir / "config.json"), aux_convention)
    mapping = Mapping(tp_size=tp_size, ep_size=ep_size)
    mapping.check(tcfg, where=f"target {target_dir} at tp_size={tp_size}")
    check_pair(tcfg, dcfg, drafter_dir)
    treader, dreader = CheckpointReader(target_dir), CheckpointReader(drafter_dir)
    with atomic_dir(out) as tmp:
        (tmp / "target").mkdir()
        (tmp / "drafter").mkdir()
        for rank in range(tp_size):
            tensors = {}
            for name, t in tqdm(target_rank_tensors(treader, tcfg, mapping, rank), desc=f"convert target rank {rank}/{tp_size}",
                                unit="tensor", leave=False):
                tensors[name] = t.clone()
            save_tensors(tensors, tmp / "target" / f"rank{rank}.safetensors")
            del tensors
        write_json({"format": FORMAT, "kind": "target", "config": tcfg.to_dict(), "mapping": mapping.to_dict(),
                    "source": str(target_dir.resolve())}, tmp / "target" / "config.json")
        for f in TOKENIZER_FILES:
            if (target_dir / f).exists():
                shutil.copy2(target_dir / f, tmp / "target" / f)
        dtensors, embed_note = drafter_tensors(dreader, dcfg, treader)
        save_tensors(dtensors, tmp / "drafter" / "rank0.safetensors")
        write_json({"format": FORMAT, "kind": "drafter", "config": dcfg.to_dict(), "embedding": embed_note,
                    "capture_points": list(dcfg.capture_points()), "source": str(drafter_dir.resolve())},
                   tmp / "drafter" / "config.json")
    unused = [f"target:{n}" for n in treader.unused() if not n.endswith("rotary_emb.inv_freq")]
    unused += [f"drafter:{n}" for n in dreader.unused()]
    n = tcfg.num_hidden_layers
    print(f"converted target {target_dir} ({tcfg.model_type}, {n} layers, hidden {tcfg.hidden_size}, "
          f"{tcfg.n_routed_experts} experts) → {out}/target at TP{tp_size} (EP{ep_size})")
    points = ", ".join(f"{i} → {'input to layer ' + str(p) if p < n else 'after the last layer (before final norm)'}"
                       for i, p in zip(dcfg.aux_layer_ids, dcfg.capture_points()))
    print(f"converted drafter {drafter_dir} (draft vocab {dcfg.draft_vocab_size}/{dcfg.vocab_size}) → {out}/drafter at TP1; "
          f"aux ids ({dcfg.aux_convention} convention): {points}; embedding: {embed_note}")
    if unused:
        print(f"unused tensors ({len(unused)}): " + ", ".join(unused[:20]) + (" …" if len(unused) > 20 else ""))
    return out
