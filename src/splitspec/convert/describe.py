"""``splitspec inspect CHECKPOINT``: say what a checkpoint is before anyone converts it.

Reads ``config.json`` and the safetensors headers only (no tensor data): architecture, sizes,
quantisation (and which linears it covers), tensor count and bytes per dtype and shard, the vision
tensors a conversion would skip, the tokenizer's size, and the conversion plan (weight bytes per rank at
TP1 and TP8, :mod:`splitspec.convert.plan`); for an EAGLE-3 drafter its wiring: aux layer ids, their
convention and where it came from, both readings of the ids, the target states they name, the draft
vocabulary and its mapping, the embedding, and norms before ``fc``. Converted checkpoints and built engines
are recognised by their ``format`` field and summarised.

A folder without shard files (``config.json``, perhaps ``model.safetensors.index.json``) is described from
config arithmetic (:mod:`splitspec.convert.layout`), checked against the index's tensor names when there is one.
"""

from __future__ import annotations

from pathlib import Path

from splitspec import quant
from splitspec.config import TargetConfig, architecture
from splitspec.drafter_config import DRAFTER_ARCHITECTURES, MODELOPT_EAGLE_KEYS, DrafterConfig
from splitspec.convert.layout import LayoutReader, drafter_layout, target_layout
from splitspec.convert.pair import tokenizer_vocab_size
from splitspec.convert.plan import plan_lines
from splitspec.convert.safetensors import INDEX_NAME, CheckpointReader, check_shard_names
from splitspec.convert.target import VISION_PREFIXES
from splitspec.errors import CheckpointError
from splitspec.files import read_json

DRAFTER_ARCHS = tuple(DRAFTER_ARCHITECTURES)  # Llama-attention and MLA (Eagle3DeepseekV2ForCausalLM) drafters


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _open(folder: Path, layout) -> CheckpointReader | LayoutReader:
    """The checkpoint's headers; from config arithmetic (``layout(weight_map)``, the index's map or {}) when no shard
    file named by the index (or no ``*.safetensors`` without one) is present."""
    index = folder / INDEX_NAME
    weight_map = read_json(index).get("weight_map") if index.exists() else None
    if weight_map is not None and not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: 'weight_map' = {weight_map!r:.80}, expected an object of tensor name → shard file")
    if weight_map:
        check_shard_names(weight_map, index)
    shards = set(weight_map.values()) if weight_map else {p.name for p in folder.glob("*.safetensors")}
    if any((folder / f).exists() for f in shards):
        return CheckpointReader(folder)
    return LayoutReader(folder, layout(weight_map or {}), weight_map)


def _source_lines(reader) -> list[str]:
    if not isinstance(reader, LayoutReader):
        return []
    if reader.weight_map is None:
        return ["config only: no shard files and no index — tensors and sizes below are config arithmetic"]
    lines = [f"config only: no shard files; {INDEX_NAME} lists {len(reader.weight_map)} tensors in "
             f"{len(set(reader.weight_map.values()))} shard file(s); shapes and sizes below are config arithmetic"]
    if reader.not_indexed or reader.not_derived:
        lines.append(f"  index DISAGREES with config.json: {len(reader.not_indexed)} implied tensors not indexed "
                     f"{reader.not_indexed[:3]}, {len(reader.not_derived)} indexed tensors not implied {reader.not_derived[:3]}")
    else:
        lines.append("  every indexed tensor is implied by config.json, and every implied tensor is indexed")
    return lines


def _coverage_line(reader, names: list[str]) -> str:
    """Which 2-D weights the stored quantisation covers, by kind, counted from the tensor names."""
    kinds: dict[str, list[int]] = {}
    for n in names:
        if n.endswith(".weight_packed"):
            q = True
        elif n.endswith(".weight") and n.removesuffix(".weight") + ".weight_scale_inv" in reader:
            q = True
        elif n.endswith(".weight") and len(reader.info(n).shape) == 2 and not n.startswith(VISION_PREFIXES):
            q = False
        else:
            continue
        kind = _linear_kind(n)
        kinds.setdefault(kind, [0, 0])[0 if q else 1] += 1
    quantised = [f"{k} ({v[0]})" for k, v in kinds.items() if v[0]]
    kept = [f"{k} ({v[1]})" for k, v in kinds.items() if v[1]]
    return f"  covers: {', '.join(quantised) or 'nothing'}; not quantised: {', '.join(kept) or 'nothing'}"


def _linear_kind(name: str) -> str:
    if ".mlp.experts." in name:
        return "routed experts"
    if ".shared_experts." in name:
        return "shared experts"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.gate." in name or name.endswith("mlp.gate.weight"):
        return "router"
    if ".mlp." in name:
        return "dense MLP"
    if "embed_tokens" in name:
        return "embedding"
    return "lm_head" if "lm_head" in name else "other"


def _tensor_lines(reader: CheckpointReader) -> list[str]:
    names = reader.names()
    by_dtype: dict = {}
    for n in names:
        info = reader.info(n)
        c = by_dtype.setdefault(info.dtype, [0, 0])
        c[0] += 1
        c[1] += info.nbytes
    counts = {str(d).removeprefix("torch."): c for d, c in by_dtype.items()}
    shards = reader.shard_sizes
    total = sum(c[1] for c in counts.values())
    where = (f"in {len(shards)} shard(s)" if getattr(reader, "weight_map", {}) is not None else "(no shard files)")
    lines = [f"tensors: {len(names)} {where}, {_mib(total)} of tensor data"
             + (f" (largest shard {_mib(max(shards.values()))})" if len(shards) > 1 else ""),
             "  by dtype: " + ", ".join(f"{d} {counts[d][0]} ({_mib(counts[d][1])})" for d in sorted(counts))]
    return lines


def _human_count(n: int) -> str:
    """``n`` with a thousands suffix and in full: 1026408235864 → '1.03 T (1,026,408,235,864)', 999995 → '1.00 M
    (999,995)'; under a thousand as it is."""
    if n < 1000:
        return str(n)
    scale, suffix = next((s, x) for s, x in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")) if round(n / s, 2) >= 1)
    return f"{n / scale:.2f} {suffix} ({n:,})"


def _param_count(reader: CheckpointReader) -> int:
    n = 0
    for name in reader.names():
        info = reader.info(name)
        if name.endswith(("weight_scale_inv", "weight_scale", "weight_shape")) or name.startswith(VISION_PREFIXES):
            continue
        numel = info.nbytes // max(info.dtype.itemsize, 1)
        n += numel * 8 if name.endswith("weight_packed") else numel
    return n


def inspect_target(folder: Path, raw: dict) -> list[str]:
    where = str(folder / "config.json")
    cfg = TargetConfig.from_hf(raw, where)
    text, _, nested = TargetConfig.text_config(raw, where)
    qc = text.get("quantization_config") or (raw.get("quantization_config") if nested else None)
    scheme = quant.parse_quantization_config(qc, where)
    layout = target_layout(cfg, scheme, raw)
    reader = _open(folder, lambda _: layout)
    names = reader.names()
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    dense = cfg.num_hidden_layers - moe
    arch = architecture(raw, str(folder / "config.json")) or "?"
    lines = [f"{folder}: target checkpoint", *_source_lines(reader),
             f"architecture: {arch} (model_type {raw.get('model_type')}"
             + (f"; text model {text.get('model_type', 'deepseek_v3')} under text_config, tensors under language_model.)" if nested else ")"),
             f"sizes: {cfg.num_hidden_layers} layers ({dense} dense: first_k_dense_replace {cfg.first_k_dense_replace}"
             + (f", layer{'s 0–' + str(dense - 1) if dense > 1 else ' 0'} dense; " if dense else "; ")
             + f"{moe} MoE), hidden {cfg.hidden_size}, "
             f"vocab {cfg.vocab_size}, {cfg.num_attention_heads} heads (MLA: q_lora {cfg.q_lora_rank}, kv_lora {cfg.kv_lora_rank}, "
             f"nope {cfg.qk_nope_head_dim} / rope {cfg.qk_rope_head_dim} / v {cfg.v_head_dim})",
             f"experts: {cfg.n_routed_experts} routed ({cfg.num_experts_per_tok} per token, width {cfg.moe_intermediate_size}) + "
             f"{cfg.n_shared_experts} shared; dense width {cfg.intermediate_size}; router noaux_tc, scaling {cfg.routed_scaling_factor}",
             f"rope: theta {cfg.rope.theta:g}" + (f", YaRN factor {cfg.rope.factor:g} (original {cfg.rope.original_max_position_embeddings}, "
                                                 f"beta_fast {cfg.rope.beta_fast:g}, beta_slow {cfg.rope.beta_slow:g})" if cfg.rope.factor > 1 else "")
             + f"; max positions {cfg.max_position_embeddings}",
             f"parameters: {_human_count(_param_count(reader))} (text model; INT4 counted as unpacked values)",
             f"quantisation: {scheme.describe()}"]
    if scheme.method == "fp8":
        fp8 = [n for n in names if n.endswith(".weight") and reader.info(n).dtype == quant.FP8_DTYPE]
        scales = [n for n in names if n.endswith("weight_scale_inv")]
        ragged = sum(1 for n in fp8 if any(d % b for d, b in zip(reader.info(n).shape, scheme.block)))
        lines.append(f"  {len(fp8)} float8_e4m3fn weights ({ragged} with ragged last tiles), {len(scales)} weight_scale_inv tensors")
    elif scheme.method == "int4":
        packed = [n for n in names if n.endswith("weight_packed")]
        routed = sum(1 for n in packed if ".experts." in n)
        lines.append(f"  {len(packed)} packed linears ({routed} routed-expert), the rest kept as stored; ignore: {list(scheme.ignore)}")
    if scheme.method != "none":
        lines.append(_coverage_line(reader, names))
    lines += _tensor_lines(reader)
    vision = [n for n in names if n.startswith(VISION_PREFIXES)]
    if vision:
        lines.append(f"vision: {len(vision)} tensors (vision_tower.*, mm_projector.*) — skipped by convert (text model only)")
    tok = tokenizer_vocab_size(folder)
    lines.append(f"tokenizer: {tok[1]}, {tok[0]} ids" + (" — MORE than vocab_size!" if tok[0] > cfg.vocab_size else "")
                 if tok else "tokenizer: none in this folder")
    lines.append("convert plan (weights of one rank, text model; as converted: INT4 routed experts kept packed, FP8 cut inside a tile bf16):")
    lines += ["  " + x for x in plan_lines(cfg, scheme, layout)]
    return lines


def inspect_drafter(folder: Path, raw: dict, target: Path | None, aux_convention: str | None) -> list[str]:
    where = str(folder / "config.json")
    cfg = DrafterConfig.from_hf(raw, where, aux_convention)
    reader = _open(folder, lambda wm: drafter_layout(cfg, own_embedding="embed_tokens.weight" in wm,
                                                     layer_prefix="layers.0." if "layers.0.fc.weight" not in wm
                                                     and any(n.startswith("layers.0.") for n in wm) else "midlayer."))
    eagle = raw.get("eagle_config") or {}
    n_layers = None
    if target is not None:
        n_layers = TargetConfig.from_hf(read_json(Path(target) / "config.json"), str(Path(target) / "config.json")).num_hidden_layers
    fc = reader.info("fc.weight").shape if "fc.weight" in reader else None
    lines = [f"{folder}: EAGLE-3 drafter", *_source_lines(reader),
             f"architecture: {(architecture(raw, str(folder / 'config.json')) or '?')} (one decoder layer), hidden {cfg.hidden_size}, "
             f"{cfg.describe_attention()}, intermediate {cfg.intermediate_size}",
             f"fc: {list(fc) if fc else 'MISSING'} over 3 × target hidden {cfg.target_hidden_size}"
             + ("" if not fc or fc[-1] == 3 * cfg.target_hidden_size else " — WIDTH DISAGREES")]
    mapping = [x for x in ("d2t", "t2d") if x in reader]
    if cfg.draft_vocab_size < cfg.vocab_size:
        lines.append(f"vocabulary: draft {cfg.draft_vocab_size} of {cfg.vocab_size} target ids, mapping: "
                     + (" + ".join(mapping) if mapping else "NONE (d2t missing: convert will refuse)"))
    else:
        lines.append(f"vocabulary: the full {cfg.vocab_size} ids" + (f" ({' + '.join(mapping)} present)" if mapping else ""))
    if cfg.aux_convention:
        lines.append(f"aux layer ids {list(cfg.aux_layer_ids)}: {cfg.aux_convention}-of-layer convention ({cfg.aux_convention_source})")
        lines.append("  target states: " + cfg.describe_capture(n_layers)
                     + (f" (target has {n_layers} layers)" if n_layers else " (pass --target to check them against a target)"))
        if n_layers is not None and max(cfg.capture_points()) > n_layers:
            lines.append(f"  OUT OF RANGE for a {n_layers}-layer target")
    else:
        markers = [k for k in MODELOPT_EAGLE_KEYS if k in eagle]
        lines.append(f"aux layer ids {list(cfg.aux_layer_ids)}: convention UNKNOWN (no eagle_config.aux_layer_id_convention"
                     + (f", markers {markers}" if markers else ", no known origin marker")
                     + "); input-of-layer would read them as inputs to layers "
                     + f"{list(cfg.aux_layer_ids)}, output-of-layer as inputs to {[i + 1 for i in cfg.aux_layer_ids]}; "
                     "convert needs --aux-convention input|output")
    lines += aux_readings(cfg.aux_layer_ids, n_layers, cfg.aux_convention)
    own = next((n for n in ("embed_tokens.weight", "model.embed_tokens.weight") if n in reader), None)
    tied = bool(eagle.get("share_target_embedding", raw.get("share_target_embedding", False)))
    lines.append(f"embedding: own '{own}' {list(reader.info(own).shape)}" + (" (declared tied to the target's)" if tied else
                 " (convert compares it with the target's)") if own else "embedding: none (uses the target's)")
    norms = [x for x, on in (("norm_before_fc (input_norm.weight)", cfg.norm_before_fc),
                             ("fc_norm (fc_norm.{0,1,2}.weight)", cfg.fc_norm)) if on]
    lines.append("norms before fc: " + (", ".join(norms) if norms else "none"))
    if cfg.norm_output:
        lines.append("next step's state: after the final norm (norm_output)")
    if "lm_head.weight" not in reader:
        lines.append("lm_head: none (convert uses the target's" + (")" if cfg.draft_vocab_size == cfg.vocab_size else "; needs the full vocabulary)"))
    lines += _tensor_lines(reader)
    return lines


def aux_readings(ids, n_layers: int | None = None, chosen: str | None = None) -> list[str]:
    """Both readings of EAGLE-3 aux layer ids (docs/formats.md, "Aux layers and their convention").

    Input-of-layer: id i names the input to target layer i (= the output of layer i − 1); output-of-layer: id i
    names the output of layer i (= the input to layer i + 1). So ids [1, 29, 57] read as output-of-layer name the
    same states as [2, 30, 58] read as input-of-layer. ``chosen`` marks the reading the drafter resolved to;
    ``n_layers`` (the target's) flags ids that fall outside the target.
    """
    ids = list(ids)
    lines = ["  both readings of the ids:"]
    for conv, shift, other, back in (("input", 0, "output", -1), ("output", 1, "input", 1)):
        points = [i + shift for i in ids]
        same = [i + back for i in ids]
        text = (f"    {conv}-of-layer: inputs to layers {points} = outputs of layers {[p - 1 for p in points]}"
                f" (the same states as ids {same} read as {other}-of-layer)")
        if n_layers is not None:
            bad = [i for i, p in zip(ids, points) if p > n_layers or (conv == "input" and i < 0)]
            text += (f"; OUT OF RANGE for a {n_layers}-layer target: {bad}" if bad else f"; within a {n_layers}-layer target"
                     + (" (the last one is after the final layer, before the final norm)" if max(points) == n_layers else ""))
        lines.append(text + (" ← this drafter" if conv == chosen else ""))
    return lines


def inspect_converted(folder: Path, meta: dict) -> list[str]:
    kind = meta.get("kind")
    lines = [f"{folder}: {meta.get('format')} ({kind})"]
    if "mapping" in meta:
        lines.append(f"mapping: {meta['mapping']}")
    if "quantization" in meta:
        lines.append(f"quantisation: {meta['quantization']}")
    for k in ("capture", "aux_convention", "embedding", "limits", "dtype"):
        if meta.get(k) is not None:
            lines.append(f"{k}: {meta[k]}")
    return lines


def inspect_checkpoint(path: Path, target: Path | None = None, aux_convention: str | None = None) -> list[str]:
    """Lines describing the checkpoint (or converted checkpoint / engine) at ``path``.

    Raises:
        CheckpointError: not a folder with a config this project reads.
    """
    path = Path(path)
    if not path.is_dir():
        why = "not a folder" if path.exists() else "a link to nothing (broken or looping)" if path.is_symlink() else "not found"
        raise CheckpointError(f"{path}: {why} (expected a checkpoint folder)")
    for name in ("engine.json", "config.json"):
        if (path / name).exists():
            raw = read_json(path / name)
            break
    else:
        inner = sorted(p.name for p in path.iterdir() if (p / "config.json").exists() or (p / "engine.json").exists())
        hint = f"; it holds {', '.join(inner)}: inspect one of them" if inner else ""
        raise CheckpointError(f"{path}: no config.json (or engine.json) — not a checkpoint folder{hint}")
    if str(raw.get("format", "")).startswith("splitspec-"):
        return inspect_converted(path, raw)
    if name == "engine.json":
        raise CheckpointError(f"{path / name}: format {raw.get('format')!r}, expected 'splitspec-…' (written by "
                              "splitspec convert or build)")
    if architecture(raw, str(path / name)) in DRAFTER_ARCHS:
        return inspect_drafter(path, raw, target, aux_convention)
    return inspect_target(path, raw)


def main(path: Path, target: Path | None = None, aux_convention: str | None = None) -> None:
    """Print :func:`inspect_checkpoint`'s lines."""
    print("\n".join(inspect_checkpoint(path, target, aux_convention)))
