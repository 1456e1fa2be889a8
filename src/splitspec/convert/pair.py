"""Convert: read a published target + EAGLE-3 drafter pair in any of its real formats, check that they fit,
write rank-sharded checkpoints.

Target forms read (DESIGN.md, "Formats" and "Quantized forms"; :mod:`splitspec.quant`):

- bf16 (``kimi_k2`` / ``deepseek_v3``): written as is, sliced per rank;
- FP8 block-scaled (Kimi-K2-Instruct): kept FP8, each slice with its own tiles of ``weight_scale_inv``;
  a slice that would cut through a tile (a TP split not on a 128 boundary) is dequantised to bf16;
- INT4 compressed-tensors (K2-Thinking, K2.5): routed experts dequantised to bf16 here;
  everything the ``ignore`` list matches is read as the float tensor it is;
- K2.5 nesting (``kimi_k25``): fields under ``text_config``, tensors under ``language_model.``;
  the vision part (``vision_tower.*``, ``mm_projector.*``) is skipped with one notice.

Output layout (``checkpoints/<name>/``)::

    target/config.json            {"format", "kind": "target", "config", "mapping", "quantization", "source"}
    target/rank{i}.safetensors    Hugging Face tensor names without any nesting prefix, sliced for rank i;
                                  FP8 linears as ``X.weight`` (float8_e4m3fn) + ``X.weight_scale_inv``
    target/tokenizer files        copied from the target checkpoint
    drafter/config.json           {"format", "kind": "drafter", "config", "capture_points", "embedding", ...}
    drafter/rank0.safetensors     drafter tensors, ``draft_to_target`` and the chosen ``embed_tokens.weight``

Streaming: tensors are read one at a time with positioned reads (:class:`splitspec.convert.safetensors.CheckpointReader`)
and written one at a time (:class:`splitspec.convert.safetensors.StreamingSafetensorsWriter`), so resident memory is the
largest source tensor plus its slice, far below the largest shard plus one rank's output. Every tensor
in either checkpoint is used, deliberately skipped (with a notice), or reported as unused.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from splitspec import quant
from splitspec.config import DrafterConfig, Mapping, TargetConfig
from splitspec.errors import CheckpointError, ConfigError
from splitspec.convert.safetensors import CheckpointReader, write_tensors
from splitspec.files import atomic_dir, read_json, write_json

FORMAT = "splitspec-checkpoint-v1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "tiktoken.model", "chat_template.jinja")
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
DEQUANT_DTYPE = torch.bfloat16  # dtype of weights dequantised at convert time (that of the unquantised tensors)

# A linear weight as read: (weight, None) for float, (float8_e4m3fn weight, float32 scale_inv) for FP8.
Weight = tuple[torch.Tensor, "torch.Tensor | None"]


def _split(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[index]


class TargetSource:
    """A published target checkpoint opened for conversion.

    Resolves the nesting (``language_model.`` for ``kimi_k25``), parses the quantisation scheme, skips
    vision tensors, and reads tensors under canonical (un-nested) Hugging Face names with shape/dtype checks.

    Attributes:
        cfg: the text model's :class:`TargetConfig`.
        scheme: the weights' :class:`splitspec.quant.QuantScheme`.
        prefix: "" or "language_model.".
        skipped: vision tensor names skipped.
        dequantized: FP8 linears stored dequantised because a TP split cut through their tiles.
    Raises:
        CheckpointError: naming the file, tensor or field.
    """

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        where = str(self.folder / "config.json")
        raw = read_json(self.folder / "config.json")
        self.raw = raw
        self.cfg = TargetConfig.from_hf(raw, where)
        text, twhere, nested = TargetConfig.text_config(raw, where)
        self.prefix = "language_model." if nested else ""
        qc = text.get("quantization_config")
        qwhere = twhere
        if qc is None and nested and raw.get("quantization_config"):
            qc, qwhere = raw["quantization_config"], where
        self.scheme = quant.parse_quantization_config(qc, qwhere)
        self.reader = CheckpointReader(self.folder)
        names = self.reader.names()
        self.skipped = [n for n in names if n.startswith(VISION_PREFIXES)]
        self.reader.mark_used(self.skipped)
        self.reader.mark_used(n for n in names if n.endswith("rotary_emb.inv_freq"))
        if nested:
            stray = [n for n in names if not n.startswith(self.prefix) and n not in self.reader.used]
            if stray:
                raise CheckpointError(f"{self.folder}: model_type 'kimi_k25' keeps the text model under 'language_model.', "
                                      f"but tensor '{stray[0]}' is outside it (and {len(stray) - 1} more)")
        self.dequantized: list[str] = []

    def stored(self, name: str) -> str:
        return self.prefix + name

    def tensor(self, name: str, shape: tuple[int, ...], dtype=FLOAT_DTYPES) -> torch.Tensor:
        """A plain tensor (norm, embedding, router) under its canonical name."""
        return self.reader.get(self.stored(name), shape, dtype)

    def linear(self, module: str, shape: tuple[int, int]) -> Weight:
        """The weight of Linear ``module`` (canonical name, no ``.weight``) of logical shape [out, in].

        FP8: (float8_e4m3fn weight, float32 scale_inv) when stored quantised, else (float, None).
        INT4: dequantised to bf16 when the config quantises the module, else read as stored.
        """
        m = self.stored(module)
        r, scheme = self.reader, self.scheme
        if scheme.method == "int4":
            if scheme.int4_quantised(m):
                if m + ".weight_packed" not in r:
                    held = " (it holds '" + m + ".weight' instead)" if m + ".weight" in r else ""
                    raise CheckpointError(f"{self.folder}: tensor '{m}.weight_packed' is missing{held}: quantization_config "
                                          f"quantises '{m}' (no 'ignore' entry matches it)")
                packed = r.get(m + ".weight_packed", None, torch.int32)
                scale = r.get(m + ".weight_scale", None, FLOAT_DTYPES)
                wshape = r.get(m + ".weight_shape", None, (torch.int32, torch.int64))
                quant.check_int4_shapes(m, packed, scale, wshape, shape, scheme.group_size, str(r.file_of(m + ".weight_packed")))
                return quant.dequantize_int4(packed, scale, shape[1], scheme.group_size, DEQUANT_DTYPE), None
            if m + ".weight_packed" in r:
                raise CheckpointError(f"{self.folder}: tensor '{m}.weight_packed' is stored quantised, but quantization_config's "
                                      "'ignore' list says this module is not quantised")
            return r.get(m + ".weight", shape, FLOAT_DTYPES), None
        if scheme.method == "fp8" and m + ".weight" in r and r.info(m + ".weight").dtype == quant.FP8_DTYPE:
            w = r.get(m + ".weight", shape)
            if m + ".weight_scale_inv" not in r:
                raise CheckpointError(f"{self.folder}: tensor '{m}.weight' is float8_e4m3fn but '{m}.weight_scale_inv' is missing")
            want = quant.fp8_scale_shape(shape, scheme.block)
            s = r.get(m + ".weight_scale_inv", None, (torch.float32, torch.bfloat16))
            if tuple(s.shape) != want:
                raise CheckpointError(f"{r.file_of(m + '.weight_scale_inv')}: tensor '{m}.weight_scale_inv' has shape {list(s.shape)}, "
                                      f"expected {list(want)} (one scale per {scheme.block[0]}×{scheme.block[1]} tile of the "
                                      f"{list(shape)} weight, last tiles ragged)")
            return w, s.float()
        if m + ".weight_scale_inv" in r:
            raise CheckpointError(f"{self.folder}: tensor '{m}.weight_scale_inv' is present but '{m}.weight' is not float8_e4m3fn"
                                  + ("" if scheme.method == "fp8" else " and config.json has no FP8 quantization_config"))
        return r.get(m + ".weight", shape, FLOAT_DTYPES), None

    def split(self, module: str, w: Weight, dim: int, parts: int, index: int) -> Weight:
        """Slice ``index`` of ``parts`` along ``dim`` (0 rows, 1 columns), keeping FP8 tiles when the cut allows."""
        t, s = w
        if s is None:
            return _split(t, dim, parts, index), None
        if parts == 1:
            return w
        got = quant.blocked_slice(t, s, dim, parts, index, self.scheme.block)
        if got is not None:
            return got
        if module not in self.dequantized:
            self.dequantized.append(module)
        return _split(quant.dequantize_fp8(t, s, self.scheme.block, DEQUANT_DTYPE), dim, parts, index), None


def _emit(module: str, w: Weight) -> Iterator[tuple[str, torch.Tensor]]:
    yield module + ".weight", w[0]
    if w[1] is not None:
        yield module + ".weight_scale_inv", w[1]


def rank_tensor_count(cfg: TargetConfig, mapping: Mapping) -> int:
    """Number of logical weights (scales not counted) in one target rank's converted shard."""
    experts = cfg.n_routed_experts // mapping.ep_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    dense = cfg.num_hidden_layers - moe_layers
    per_layer = 9
    return 3 + cfg.num_hidden_layers * per_layer + dense * 3 + moe_layers * (2 + 3 * experts + (3 if cfg.n_shared_experts else 0))


def target_rank_tensors(src: TargetSource, cfg: TargetConfig, mapping: Mapping, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of target rank ``rank`` under canonical Hugging Face names, sliced for TP/EP.

    Split rules: q_b_proj/kv_b_proj rows and o_proj columns by head; dense and shared-expert
    gate/up rows and down columns by intermediate; routed experts by expert group (EP) and
    intermediate slice (expert-TP); embed_tokens/lm_head rows by vocabulary. q_a_proj,
    kv_a_proj_with_mqa, their norms, the router and all layer norms are replicated.
    FP8 linears are followed by their ``weight_scale_inv`` slice. Every tensor's shape and dtype is
    checked against ``cfg``.
    """
    tp, H = mapping.tp_size, cfg.hidden_size
    heads, mtp, mrank = cfg.num_attention_heads, mapping.moe_tp_size, mapping.moe_tp_rank(rank)
    V = cfg.vocab_size

    def lin(module, shape, dim=None, parts=1, index=0):
        w = src.linear(module, shape)
        if dim is not None:
            w = src.split(module, w, dim, parts, index)
        return _emit(module, w)

    yield "model.embed_tokens.weight", _split(src.tensor("model.embed_tokens.weight", (V, H)), 0, tp, rank)
    yield "lm_head.weight", _split(src.tensor("lm_head.weight", (V, H)), 0, tp, rank)
    yield "model.norm.weight", src.tensor("model.norm.weight", (H,))
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        for n in ("input_layernorm", "post_attention_layernorm"):
            yield p + n + ".weight", src.tensor(p + n + ".weight", (H,))
        yield from lin(a + "q_a_proj", (cfg.q_lora_rank, H))
        yield a + "q_a_layernorm.weight", src.tensor(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
        yield from lin(a + "kv_a_proj_with_mqa", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H))
        yield a + "kv_a_layernorm.weight", src.tensor(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        yield from lin(a + "q_b_proj", (heads * cfg.qk_head_dim, cfg.q_lora_rank), 0, tp, rank)
        yield from lin(a + "kv_b_proj", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), 0, tp, rank)
        yield from lin(a + "o_proj", (H, heads * cfg.v_head_dim), 1, tp, rank)
        m = p + "mlp."
        if not cfg.is_moe_layer(layer):
            for n in ("gate_proj", "up_proj"):
                yield from lin(m + n, (cfg.intermediate_size, H), 0, tp, rank)
            yield from lin(m + "down_proj", (H, cfg.intermediate_size), 1, tp, rank)
            continue
        E = cfg.n_routed_experts
        yield m + "gate.weight", src.tensor(m + "gate.weight", (E, H))
        yield m + "gate.e_score_correction_bias", src.tensor(m + "gate.e_score_correction_bias", (E,), (torch.float32, torch.bfloat16))
        per = E // mapping.ep_size
        first = mapping.ep_rank(rank) * per
        for e in range(first, first + per):
            x = f"{m}experts.{e}."
            for n in ("gate_proj", "up_proj"):
                yield from lin(x + n, (cfg.moe_intermediate_size, H), 0, mtp, mrank)
            yield from lin(x + "down_proj", (H, cfg.moe_intermediate_size), 1, mtp, mrank)
        if cfg.n_shared_experts:
            s, inter = m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts
            for n in ("gate_proj", "up_proj"):
                yield from lin(s + n, (inter, H), 0, tp, rank)
            yield from lin(s + "down_proj", (H, inter), 1, tp, rank)


def check_pair(target: TargetConfig, drafter: DrafterConfig, drafter_dir: Path) -> None:
    """Check that the drafter fits the target.

    Raises:
        CheckpointError: naming the drafter config field that disagrees (target_hidden_size,
            vocab_size, draft_vocab_size, aux layer ids out of range).
        ConfigError: the aux-id convention is unknown.
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
            last = n if drafter.aux_convention == "input" else n - 1
            raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids contains {i}, out of range for a "
                                  f"{n}-layer target under the '{drafter.aux_convention}' convention (largest valid id: {last})")


def read_draft_vocab(reader: CheckpointReader, cfg: DrafterConfig) -> torch.Tensor:
    """Read d2t (offsets: target id = draft id + d2t[draft id]; all zeros = identity) and check it against t2d.

    Returns draft_to_target [draft_vocab] int64 (absolute target ids).
    Raises:
        CheckpointError: a reduced vocabulary without d2t; ids outside the target vocabulary;
            a mapping that is not one-to-one; t2d disagreeing with d2t.
    """
    dv, v = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in reader:
        if dv < v:
            raise CheckpointError(f"{reader.folder}: draft_vocab_size {dv} < vocab_size {v} but tensor 'd2t' (the draft → target "
                                  "vocabulary mapping) is missing")
        if "t2d" in reader:
            t2d = reader.get("t2d", (v,), (torch.bool, torch.uint8, torch.int64)).bool()
            if not bool(t2d.all()):
                raise CheckpointError(f"{reader.folder}: t2d marks {int((~t2d).sum())} target ids as absent, but the draft "
                                      "vocabulary is the full vocabulary")
        return torch.arange(dv, dtype=torch.int64)
    d2t = reader.get("d2t", (dv,), (torch.int64, torch.int32)).to(torch.int64)
    mapped = torch.arange(dv, dtype=torch.int64) + d2t
    if mapped.min() < 0 or mapped.max() >= v:
        bad = int(((mapped < 0) | (mapped >= v)).nonzero()[0])
        raise CheckpointError(f"{reader.file_of('d2t')}: tensor 'd2t' maps draft id {bad} to target id {int(mapped[bad])}, "
                              f"outside the target vocabulary [0, {v})")
    if mapped.unique().numel() != dv:
        raise CheckpointError(f"{reader.file_of('d2t')}: tensor 'd2t' is not one-to-one (two draft ids map to the same target id)")
    if "t2d" in reader:
        t2d = reader.get("t2d", (v,), (torch.bool, torch.uint8, torch.int64)).bool()
        expect = torch.zeros(v, dtype=torch.bool)
        expect[mapped] = True
        if not torch.equal(t2d, expect):
            raise CheckpointError(f"{reader.file_of('t2d')}: tensor 't2d' disagrees with d2t at {int((t2d != expect).sum())} target ids")
    return mapped


def _drafter_layer_prefix(reader: CheckpointReader) -> str:
    """``midlayer.`` (EAGLE-3 / SpecForge) or ``layers.0.`` (some exports name the single layer so)."""
    if any(n.startswith("midlayer.") for n in reader.names()):
        return "midlayer."
    if any(n.startswith("layers.0.") for n in reader.names()):
        return "layers.0."
    return "midlayer."


def drafter_tensors(reader: CheckpointReader, cfg: DrafterConfig, target: TargetSource,
                    embedding: str | None = None, tied: bool = False) -> tuple[dict, dict]:
    """Read and check every drafter tensor.

    Args:
        embedding: None (decide: the target's when the drafter has none or an equal one, the drafter's
            own when it differs), "target" or "own" (forced by the caller).
        tied: the drafter's config declares its embedding is the target's (``eagle_config.share_target_embedding``).
    Returns:
        (tensors under published names with the layer as ``midlayer.*``, plus ``draft_to_target``,
        ``embed_tokens.weight`` and, when asked for, ``input_norm.weight`` / ``fc_norm.{i}.weight``;
        embedding decision {"source": "target"|"drafter", "note": str}).
    Raises:
        CheckpointError: naming the tensor (wrong shape/dtype, ``fc`` width not 3 × target hidden, ...).
    """
    H, I, TH = cfg.hidden_size, cfg.intermediate_size, cfg.target_hidden_size
    nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    lp = _drafter_layer_prefix(reader)
    layer = {
        "self_attn.q_proj.weight": (nq * hd, 2 * H), "self_attn.k_proj.weight": (nkv * hd, 2 * H),
        "self_attn.v_proj.weight": (nkv * hd, 2 * H), "self_attn.o_proj.weight": (H, nq * hd),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,),
    }
    top = {"fc.weight": (H, 3 * TH), "norm.weight": (H,), "lm_head.weight": (cfg.draft_vocab_size, H)}
    if cfg.norm_before_fc:
        top["input_norm.weight"] = (3 * TH,)
    if cfg.fc_norm:
        top.update({f"fc_norm.{i}.weight": (TH,) for i in range(3)})
    if "fc.weight" in reader:
        fc = reader.info("fc.weight")
        if len(fc.shape) == 2 and fc.shape[1] != 3 * TH:
            raise CheckpointError(f"{reader.file_of('fc.weight')}: tensor 'fc.weight' has {fc.shape[1]} input columns, "
                                  f"expected 3 × target hidden size = 3 × {TH} = {3 * TH}")
    out = {"midlayer." + name: reader.get(lp + name, shape, FLOAT_DTYPES) for name, shape in layer.items()}
    out.update({name: reader.get(name, shape, FLOAT_DTYPES) for name, shape in top.items()})
    out["draft_to_target"] = read_draft_vocab(reader, cfg)
    target_embed = None
    if TH == H:
        target_embed = target.tensor("model.embed_tokens.weight", (cfg.vocab_size, TH))
    own_name = next((n for n in ("embed_tokens.weight", "model.embed_tokens.weight") if n in reader), None)
    own = reader.get(own_name, (cfg.vocab_size, H), FLOAT_DTYPES) if own_name else None
    if own is None:
        if target_embed is None:
            raise CheckpointError(f"{reader.folder}: the drafter has no embed_tokens and its hidden size {H} differs from the "
                                  f"target's {TH}, so the target's embedding cannot stand in")
        if embedding == "own":
            raise ConfigError(f"{reader.folder}: --drafter-embedding own, but the drafter has no embed_tokens")
        out["embed_tokens.weight"] = target_embed
        return out, {"source": "target", "note": "the target's (the drafter has none)"}
    if target_embed is None:
        if embedding == "target":
            raise ConfigError(f"{reader.folder}: --drafter-embedding target, but the drafter's hidden size {H} differs from the target's {TH}")
        out["embed_tokens.weight"] = own
        return out, {"source": "drafter", "note": "the drafter's own (its hidden size differs from the target's)"}
    diff = (own.float() - target_embed.float()).abs().max().item()
    if diff == 0:
        out["embed_tokens.weight"] = target_embed
        return out, {"source": "target", "note": f"the target's (the drafter's own '{own_name}' is equal to it)"}
    if embedding == "target" or (embedding is None and tied):
        why = "--drafter-embedding target" if embedding == "target" else "eagle_config.share_target_embedding = true"
        out["embed_tokens.weight"] = target_embed
        return out, {"source": "target", "note": f"the target's ({why}; the drafter's own '{own_name}' differs by up to {diff:.3g} and is not used)"}
    out["embed_tokens.weight"] = own
    why = "--drafter-embedding own" if embedding == "own" else "it is what the drafter was trained with; pass --drafter-embedding target to use the target's"
    return out, {"source": "drafter", "note": f"the drafter's own '{own_name}', which DIFFERS from the target's by up to {diff:.3g} ({why})"}


def tokenizer_vocab_size(folder: Path) -> tuple[int, str] | None:
    """Token count of a checkpoint's tokenizer (highest id + 1) and the file it came from, or None without one.

    Reads ``tokenizer.json`` with the ``tokenizers`` library, or counts a tiktoken ``tiktoken.model``
    (one token per line) plus the ``added_tokens_decoder`` ids of ``tokenizer_config.json``.
    """
    folder = Path(folder)
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(f"{folder / 'tokenizer.json'}: cannot be read by the tokenizers library ({e})") from None
        ids = list(tok.get_vocab(with_added_tokens=True).values())
        return (max(ids) + 1 if ids else 0), "tokenizer.json"
    if (folder / "tiktoken.model").exists():
        n = sum(1 for line in (folder / "tiktoken.model").read_text().splitlines() if line.strip())
        added = {}
        if (folder / "tokenizer_config.json").exists():
            added = read_json(folder / "tokenizer_config.json").get("added_tokens_decoder") or {}
        ids = [int(k) for k in added] + [n - 1]
        return max(ids) + 1, "tiktoken.model"
    return None


def check_tokenizer(folder: Path, vocab_size: int) -> None:
    """Raise CheckpointError when the checkpoint's tokenizer can produce ids the model has no row for."""
    got = tokenizer_vocab_size(folder)
    if got is not None and got[0] > vocab_size:
        raise CheckpointError(f"{Path(folder) / got[1]}: the tokenizer has {got[0]} token ids but config.json's vocab_size is "
                              f"{vocab_size}; ids ≥ {vocab_size} would index past the embedding")


def convert_pair(target_dir: Path, drafter_dir: Path, out: Path, tp_size: int = 2, ep_size: int = 1,
                 aux_convention: str | None = None, drafter_embedding: str | None = None, progress: bool = True) -> Path:
    """Check a target/drafter pair and write ``out/target`` (TP-``tp_size`` shards) and ``out/drafter`` (TP1).

    Args:
        target_dir: Hugging Face Kimi-K2 / K2.5 / DeepSeek-V3 checkpoint folder (bf16, FP8 or INT4).
        drafter_dir: Hugging Face EAGLE-3 drafter folder.
        out: output folder, replaced atomically on success.
        tp_size, ep_size: target mapping (see :class:`splitspec.config.Mapping`).
        aux_convention: "input" or "output", when the drafter's config does not declare it.
        drafter_embedding: None (decide, see :func:`drafter_tensors`), "target" or "own".
        progress: show tqdm progress bars.
    Returns: ``out``.
    Raises:
        CheckpointError / ConfigError: a clear message naming the file, tensor or field; ``out`` untouched.
    """
    target_dir, drafter_dir, out = Path(target_dir), Path(drafter_dir), Path(out)
    if drafter_embedding not in (None, "target", "own"):
        raise ConfigError(f"drafter_embedding = {drafter_embedding!r}, expected 'target' or 'own'")
    src = TargetSource(target_dir)
    tcfg = src.cfg
    draw = read_json(drafter_dir / "config.json")
    dcfg = DrafterConfig.from_hf(draw, str(drafter_dir / "config.json"), aux_convention)
    tied = bool((draw.get("eagle_config") or {}).get("share_target_embedding", draw.get("share_target_embedding", False)))
    mapping = Mapping(tp_size=tp_size, ep_size=ep_size)
    mapping.check(tcfg, where=f"target {target_dir} at tp_size={tp_size}")
    check_pair(tcfg, dcfg, drafter_dir)
    check_tokenizer(target_dir, tcfg.vocab_size)
    dreader = CheckpointReader(drafter_dir)
    try:
        return _convert(src, dreader, dcfg, mapping, target_dir, drafter_dir, out, drafter_embedding, tied, progress)
    finally:
        src.reader.close()
        dreader.close()


def _convert(src: TargetSource, dreader: CheckpointReader, dcfg: DrafterConfig, mapping: Mapping, target_dir: Path,
             drafter_dir: Path, out: Path, drafter_embedding: str | None, tied: bool, progress: bool) -> Path:
    tcfg, tp_size, ep_size = src.cfg, mapping.tp_size, mapping.ep_size
    total = rank_tensor_count(tcfg, mapping)
    written = []
    with atomic_dir(out, keep=(target_dir, drafter_dir)) as tmp:
        (tmp / "target").mkdir()
        (tmp / "drafter").mkdir()
        for rank in range(tp_size):
            bar = tqdm(total=total, desc=f"convert target rank {rank + 1}/{tp_size}", unit="tensor", disable=not progress)

            def counted(items):
                for name, t in items:
                    if not name.endswith("_scale_inv"):
                        bar.update(1)
                    yield name, t

            try:
                written.append(write_tensors(counted(target_rank_tensors(src, tcfg, mapping, rank)),
                                             tmp / "target" / f"rank{rank}.safetensors"))
            finally:
                bar.close()
        qmeta = {"method": "fp8" if src.scheme.method == "fp8" else "none",
                 "weight_block_size": list(src.scheme.block) if src.scheme.method == "fp8" else None,
                 "source": src.scheme.describe(), "source_config": src.scheme.source,
                 "dequantized_at_convert": (["routed experts (INT4)"] if src.scheme.method == "int4" else []) + src.dequantized}
        write_json({"format": FORMAT, "kind": "target", "config": tcfg.to_dict(), "mapping": mapping.to_dict(),
                    "quantization": qmeta, "source": str(target_dir.resolve())}, tmp / "target" / "config.json")
        for f in TOKENIZER_FILES:
            if (target_dir / f).exists():
                shutil.copy2(target_dir / f, tmp / "target" / f)
        dtensors, emb = drafter_tensors(dreader, dcfg, src, drafter_embedding, tied)
        write_tensors(dtensors.items(), tmp / "drafter" / "rank0.safetensors")
        capture = dcfg.describe_capture(tcfg.num_hidden_layers)
        write_json({"format": FORMAT, "kind": "drafter", "config": dcfg.to_dict(), "embedding": emb["note"],
                    "embedding_source": emb["source"], "capture_points": list(dcfg.capture_points()), "capture": capture,
                    "aux_convention_source": dcfg.aux_convention_source, "source": str(drafter_dir.resolve())},
                   tmp / "drafter" / "config.json")
    unused = [f"target:{n}" for n in src.reader.unused()] + [f"drafter:{n}" for n in dreader.unused()]
    n = tcfg.num_hidden_layers
    print(f"converted target {target_dir} ({tcfg.model_type}, {n} layers, hidden {tcfg.hidden_size}, "
          f"{tcfg.n_routed_experts} experts; weights: {src.scheme.describe()}) → {out}/target at TP{tp_size} (EP{ep_size}), "
          f"{sum(written) / 2**20:.1f} MiB in {tp_size} shard(s)")
    if src.skipped:
        print(f"notice: skipped {len(src.skipped)} vision tensors (vision_tower.*, mm_projector.*): the vision part of "
              f"{tcfg.model_type} is out of scope; only the text model is converted")
    if src.scheme.method == "int4":
        print("notice: INT4 routed experts dequantised to bfloat16 ((nibble − 8) × group scale)")
    if src.dequantized:
        print(f"notice: {len(src.dequantized)} FP8 weights stored dequantised (bfloat16) because the TP{tp_size} split cuts "
              f"through their {src.scheme.block[0]}×{src.scheme.block[1]} tiles: {', '.join(src.dequantized[:6])}"
              + (" …" if len(src.dequantized) > 6 else ""))
    print(f"converted drafter {drafter_dir} (draft vocab {dcfg.draft_vocab_size}/{dcfg.vocab_size}) → {out}/drafter at TP1")
    print(f"  target states feeding the drafter ({dcfg.aux_convention} convention, {dcfg.aux_convention_source}): {capture}")
    extra = [x for x, on in (("RMSNorm over the concatenated aux states before fc (norm_before_fc)", dcfg.norm_before_fc),
                             ("one RMSNorm per aux state before fc (fc_norm)", dcfg.fc_norm)) if on]
    if extra:
        print(f"  drafter norms before fc: {'; '.join(extra)}")
    print(f"  drafter embedding: {emb['note']}")
    if unused:
        print(f"unused tensors ({len(unused)}): " + ", ".join(unused[:20]) + (" …" if len(unused) > 20 else ""))
    return out
