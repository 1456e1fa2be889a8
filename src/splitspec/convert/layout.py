"""The published tensor layout of a checkpoint, worked out from its ``config.json`` alone: every tensor's name,
shape and dtype as the Hugging Face files store it, without reading a byte of weights.

Used by ``splitspec inspect`` on a folder that holds only ``config.json`` (and perhaps the
``model.safetensors.index.json``), by the conversion plan (:mod:`splitspec.convert.plan`), and to generate
realistic index files for config-only fixtures.

Target forms (docs/formats.md, "Target checkpoints"; :mod:`splitspec.quant`):

- every layer: ``input_layernorm``, ``post_attention_layernorm``; MLA ``self_attn.{q_a_proj, q_a_layernorm,
  q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}``;
- layers below ``first_k_dense_replace``: a dense ``mlp.{gate,up,down}_proj`` of width ``intermediate_size``;
  the others: router ``mlp.gate.weight`` [E, H] bf16 and ``mlp.gate.e_score_correction_bias`` [E] float32,
  ``mlp.experts.{e}.{gate,up,down}_proj`` of width ``moe_intermediate_size`` and the shared expert(s)
  ``mlp.shared_experts.*`` of width ``moe_intermediate_size × n_shared_experts``;
- ``model.embed_tokens``, ``model.norm``, ``lm_head`` (bf16 in every published form);
- a linear is stored as ``weight`` bf16; FP8 block-scaled as ``weight`` float8_e4m3fn + ``weight_scale_inv``
  float32 [ceil(out/b0), ceil(in/b1)] (Kimi-K2-Instruct: every linear but the router and ``lm_head``); INT4
  compressed-tensors as ``weight_packed`` int32 [out, in/8] + ``weight_scale`` bf16 [out, in/group] +
  ``weight_shape`` int32 [2] for each ``Linear`` the ``ignore`` list leaves quantised (the router is not an
  ``nn.Linear`` in the published modelling code, so it stays bf16 whatever the list says);
- Kimi-K2-Instruct (FP8) also stores ``self_attn.rotary_emb.inv_freq`` per layer (bf16 [56] as published);
- ``kimi_k25`` nests the text model under ``language_model.`` and adds the MoonViT tower (``vision_tower.*``)
  and the projector (``mm_projector.*``), their shapes from ``vision_config``.

These rules reproduce the published tensor counts exactly (Kimi-K2-Instruct 139,644; Kimi-K2.5 208,550).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from splitspec import quant
from splitspec.config import TargetConfig
from splitspec.convert.stored_bytes import int4_shapes
from splitspec.drafter_config import DrafterConfig

BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
INV_FREQ_LEN = 56  # length of the inv_freq buffers Kimi-K2-Instruct's files store (a published fact, not derived)


@dataclass(frozen=True)
class Tensor:
    """One stored tensor: ``name`` as published, ``shape``, ``dtype``; ``module`` is the Linear it belongs to
    (without the weight suffix) or "" for a plain tensor; ``split`` how a TP conversion cuts it ("replicated",
    "tp": ``tp`` ways, "expert": to one expert group, then ``tp / ep`` ways, "vision": not converted) and ``dim``
    the dimension it cuts (-1: none), as :func:`splitspec.convert.target.target_rank_tensors` does; ``base`` the
    weight shape a ``weight_scale_inv`` belongs to."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    module: str = ""
    split: str = "replicated"
    dim: int = -1
    base: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class _Int4Ignore:
    """``QuantScheme.int4_quantised`` with its patterns compiled once (the layout asks ~70,000 times)."""

    def __init__(self, scheme: quant.QuantScheme):
        self.exact = {e for e in scheme.ignore if not e.startswith("re:")}
        patterns = [f"(?:{e[3:]})" for e in scheme.ignore if e.startswith("re:")]
        self.match = re.compile("|".join(patterns)).match if patterns else (lambda _: None)

    def quantised(self, module: str) -> bool:
        return module not in self.exact and not self.match(module)


def _linear(module: str, out: int, inp: int, scheme: quant.QuantScheme, split=("replicated", -1), int4=None) -> list[Tensor]:
    s, d = split
    if scheme.method == "fp8":
        return [Tensor(module + ".weight", (out, inp), quant.FP8_DTYPE, module, s, d),
                Tensor(module + ".weight_scale_inv", quant.fp8_scale_shape((out, inp), scheme.block), F32, module, s, d, (out, inp))]
    if scheme.method == "int4" and (int4 or _Int4Ignore(scheme)).quantised(module):
        packed, scale = int4_shapes(out, inp, scheme.group_size)
        return [Tensor(module + ".weight_packed", packed, I32, module, s, d),
                Tensor(module + ".weight_scale", scale, BF16, module, s, d),
                Tensor(module + ".weight_shape", (2,), I32, module, s, -1)]
    return [Tensor(module + ".weight", (out, inp), BF16, module, s, d)]


def target_layout(cfg: TargetConfig, scheme: quant.QuantScheme, raw: dict | None = None) -> list[Tensor]:
    """Every tensor of the published target checkpoint described by ``cfg`` / ``scheme`` (and, for ``kimi_k25``,
    the raw config's ``vision_config``), in layer order, under its stored name."""
    nested = cfg.model_type == "kimi_k25"
    p = "language_model." if nested else ""
    H, heads, q = cfg.hidden_size, cfg.num_attention_heads, _Int4Ignore(scheme)
    rows, cols = ("tp", 0), ("tp", 1)
    out: list[Tensor] = []
    for i in range(cfg.num_hidden_layers):
        layer = f"{p}model.layers.{i}."
        a = layer + "self_attn."
        out += [Tensor(layer + "input_layernorm.weight", (H,), BF16), Tensor(layer + "post_attention_layernorm.weight", (H,), BF16)]
        out += _linear(a + "q_a_proj", cfg.q_lora_rank, H, scheme, int4=q)
        out.append(Tensor(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), BF16))
        out += _linear(a + "q_b_proj", heads * cfg.qk_head_dim, cfg.q_lora_rank, scheme, rows, q)
        out += _linear(a + "kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, H, scheme, int4=q)
        out.append(Tensor(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), BF16))
        out += _linear(a + "kv_b_proj", heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, scheme, rows, q)
        out += _linear(a + "o_proj", H, heads * cfg.v_head_dim, scheme, cols, q)
        if scheme.method == "fp8":
            out.append(Tensor(a + "rotary_emb.inv_freq", (INV_FREQ_LEN,), BF16))
        m = layer + "mlp."
        if not cfg.is_moe_layer(i):
            out += _mlp(m, cfg.intermediate_size, H, scheme, "tp", q)
            continue
        E = cfg.n_routed_experts
        out += [Tensor(m + "gate.weight", (E, H), BF16), Tensor(m + "gate.e_score_correction_bias", (E,), F32)]
        for e in range(E):
            out += _mlp(f"{m}experts.{e}.", cfg.moe_intermediate_size, H, scheme, "expert", q)
        if cfg.n_shared_experts:
            out += _mlp(m + "shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts, H, scheme, "tp", q)
    V = cfg.vocab_size
    out += [Tensor(p + "model.embed_tokens.weight", (V, H), BF16, "", "tp", 0), Tensor(p + "model.norm.weight", (H,), BF16),
            Tensor(p + "lm_head.weight", (V, H), BF16, "", "tp", 0)]
    if nested and raw:
        out += [Tensor(t.name, t.shape, t.dtype, t.module, "vision") for t in vision_layout(raw.get("vision_config") or {})]
    return out


def _mlp(prefix: str, inter: int, H: int, scheme: quant.QuantScheme, split: str, int4: _Int4Ignore) -> list[Tensor]:
    return (_linear(prefix + "gate_proj", inter, H, scheme, (split, 0), int4) + _linear(prefix + "up_proj", inter, H, scheme, (split, 0), int4)
            + _linear(prefix + "down_proj", H, inter, scheme, (split, 1), int4))


def vision_layout(vc: dict) -> list[Tensor]:
    """MoonViT tower and patch-merger projector of a ``kimi_k25`` checkpoint (all bf16), from ``vision_config``:
    ``vt_num_hidden_layers`` blocks of width ``vt_hidden_size`` (fused ``wqkv``, ``wo``, MLP ``fc0``/``fc1`` of
    ``vt_intermediate_size``, two LayerNorms, all with biases), a learned position table
    [init_pos_emb_height, init_pos_emb_width, width], a ``patch_size``² RGB patch embedding, and a projector
    (LayerNorm, then Linear over ``merge_kernel_size`` merged patches, GELU, Linear to ``text_hidden_size``).
    """
    needed = ("vt_hidden_size", "vt_intermediate_size", "patch_size", "merge_kernel_size", "vt_num_hidden_layers",
              "init_pos_emb_height", "init_pos_emb_width", "text_hidden_size")
    if any(k not in vc for k in needed):
        return []  # not a MoonViT config this layout knows: the vision part is left out
    W, inter, ps = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["patch_size"]
    merged = W * vc["merge_kernel_size"][0] * vc["merge_kernel_size"][1]
    t = "vision_tower."
    out = [Tensor(t + "patch_embed.pos_emb.weight", (vc["init_pos_emb_height"], vc["init_pos_emb_width"], W), BF16),
           Tensor(t + "patch_embed.proj.weight", (W, 3, ps, ps), BF16), Tensor(t + "patch_embed.proj.bias", (W,), BF16)]
    for b in range(vc["vt_num_hidden_layers"]):
        k = f"{t}encoder.blocks.{b}."
        for name, shape in (("wqkv", (3 * W, W)), ("wo", (W, W)), ("mlp.fc0", (inter, W)), ("mlp.fc1", (W, inter))):
            out += [Tensor(k + name + ".weight", shape, BF16, k + name), Tensor(k + name + ".bias", (shape[0],), BF16)]
        out += [Tensor(k + n + s, (W,), BF16) for n in ("norm0", "norm1") for s in (".weight", ".bias")]
    out += [Tensor(t + "encoder.final_layernorm" + s, (W,), BF16) for s in (".weight", ".bias")]
    mp = "mm_projector."
    out += [Tensor(mp + "pre_norm" + s, (W,), BF16) for s in (".weight", ".bias")]
    out += [Tensor(mp + "proj.0.weight", (merged, merged), BF16, mp + "proj.0"), Tensor(mp + "proj.0.bias", (merged,), BF16),
            Tensor(mp + "proj.2.weight", (vc["text_hidden_size"], merged), BF16, mp + "proj.2"),
            Tensor(mp + "proj.2.bias", (vc["text_hidden_size"],), BF16)]
    return out


def drafter_layout(cfg: DrafterConfig, own_embedding: bool = False, layer_prefix: str = "midlayer.") -> list[Tensor]:
    """The tensors of a published Llama-style EAGLE-3 drafter (SpecForge / EAGLE naming, bf16), as
    :func:`splitspec.convert.drafter.drafter_tensors` reads them: ``fc`` [H, 3·target_hidden], one decoder layer
    whose q/k/v take [embedding, hidden] (2H) inputs, ``norm``, ``lm_head`` over the draft vocabulary, and for a
    reduced vocabulary ``d2t`` int64 [draft_vocab] and ``t2d`` bool [vocab]."""
    H, TH, hd, I = cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim, cfg.intermediate_size
    nq, nkv, lp = cfg.num_attention_heads, cfg.num_key_value_heads, layer_prefix
    out = [Tensor("fc.weight", (H, 3 * TH), BF16, "fc")]
    for name, shape in (("self_attn.q_proj", (nq * hd, 2 * H)), ("self_attn.k_proj", (nkv * hd, 2 * H)),
                        ("self_attn.v_proj", (nkv * hd, 2 * H)), ("self_attn.o_proj", (H, nq * hd)),
                        ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)), ("mlp.down_proj", (H, I))):
        out.append(Tensor(lp + name + ".weight", shape, BF16, lp + name))
    out += [Tensor(lp + n + ".weight", (H,), BF16) for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    out += [Tensor("norm.weight", (H,), BF16), Tensor("lm_head.weight", (cfg.draft_vocab_size, H), BF16, "lm_head")]
    if cfg.norm_before_fc:
        out.append(Tensor("input_norm.weight", (3 * TH,), BF16))
    if cfg.fc_norm:
        out += [Tensor(f"fc_norm.{i}.weight", (TH,), BF16) for i in range(3)]
    if cfg.draft_vocab_size < cfg.vocab_size:
        out += [Tensor("d2t", (cfg.draft_vocab_size,), torch.int64), Tensor("t2d", (cfg.vocab_size,), torch.bool)]
    if own_embedding:
        out.append(Tensor("embed_tokens.weight", (cfg.vocab_size, H), BF16))
    return out


def index_for(tensors: list[Tensor], shard_names: list[str]) -> dict:
    """A ``model.safetensors.index.json`` body for ``tensors`` spread over ``shard_names`` in order, each shard
    filled to about total/len(shard_names) bytes: ``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``.
    The assignment is generated, not the published one (which only the real index records)."""
    total = sum(t.nbytes for t in tensors)
    per, done, weight_map = total / len(shard_names), 0, {}
    for t in tensors:
        weight_map[t.name] = shard_names[min(int(done // per), len(shard_names) - 1)] if per else shard_names[0]
        done += t.nbytes
    return {"metadata": {"total_size": total}, "weight_map": weight_map}


class LayoutReader:
    """Header facts of a checkpoint whose shard files are absent, from its config arithmetic (``tensors``) and, when
    present, its index (``weight_map``): the subset of :class:`splitspec.convert.safetensors.CheckpointReader` that
    ``splitspec inspect`` reads (``names``, ``in``, ``info``, ``shard_sizes``).

    Attributes:
        not_indexed: tensors the config implies but the index does not list.
        not_derived: index entries the config does not account for (their shapes are unknown; left out of ``names``).
    """

    config_only = True

    def __init__(self, folder, tensors: list[Tensor], weight_map: dict[str, str] | None = None):
        self.folder = folder
        self._by_name = {t.name: t for t in tensors}
        self.weight_map = weight_map
        if weight_map is None:
            self.location = {n: "(config arithmetic)" for n in self._by_name}
            self.not_indexed, self.not_derived = [], []
        else:
            self.location = {n: f for n, f in weight_map.items() if n in self._by_name}
            self.not_indexed = sorted(set(self._by_name) - set(weight_map))
            self.not_derived = sorted(set(weight_map) - set(self._by_name))

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        return sorted(self.location)

    def info(self, name: str) -> Tensor:
        return self._by_name[name]

    @property
    def shard_sizes(self) -> dict[str, int]:
        """Tensor bytes per shard file named by the index (headers not counted)."""
        sizes: dict[str, int] = {}
        for n, f in self.location.items():
            sizes[f] = sizes.get(f, 0) + self._by_name[n].nbytes
        return sizes

    def close(self) -> None:
        pass
