"""``splitspec plan``: a memory plan from published checkpoint folders (config-only or with shards), printed as a
table per GPU, as JSON, or as the one-line refusal of a deployment that does not fit (see
:mod:`splitspec.build.memory_plan` for what each item counts and where its formula comes from).
"""

from __future__ import annotations

from pathlib import Path

from splitspec import quant
from splitspec.build.memory_plan import GIB, GROUPS, Deployment, MemoryPlan, plan_memory
from splitspec.build.weight_bytes import Storage, WeightFormat
from splitspec.config import TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.convert.drafter import drafter_scheme
from splitspec.convert.safetensors import CheckpointReader
from splitspec.errors import CheckpointError, ConfigError
from splitspec.files import read_json, write_json
from splitspec.models.drafters import FP8_BLOCK

FORMAT_NOTES = {"int4": "INT4 routed experts as published (packed int32 + bf16 group scales + weight_shape), bf16 elsewhere",
                "fp8": "FP8 block-scaled linears as published (float32 scale_inv per tile), bf16 elsewhere",
                "bfloat16": "bf16", "float16": "float16", "float32": "float32"}


def _has_shards(folder: Path) -> bool:
    """Any shard file here (an index alone, as in a config-only download, does not count; a partial download does
    and is refused by :class:`CheckpointReader`, naming the missing shard)."""
    return any(folder.glob("*.safetensors"))


def _published(folder: Path) -> None:
    """Raise CheckpointError for a folder splitspec wrote (an ``engine.json`` there): plans read published folders."""
    if (folder / "engine.json").is_file():
        raise CheckpointError(f"{folder}: a folder splitspec wrote (engine.json); plan the published checkpoint it came from")


def open_target(folder: Path, dtype: str | None) -> tuple[TargetConfig, WeightFormat, Storage, str]:
    """(config, weight format, storage, source description) of a published target folder.

    Raises:
        CheckpointError: no config.json, a missing field, a shard disagreeing with the config.
        ConfigError: an unknown or unavailable ``dtype``.
    """
    folder = Path(folder)
    _published(folder)
    where = str(folder / "config.json")
    raw = read_json(folder / "config.json")
    cfg = TargetConfig.from_hf(raw, where)
    text, twhere, nested = TargetConfig.text_config(raw, where)
    qc = text.get("quantization_config") or (raw.get("quantization_config") if nested else None)
    scheme = quant.parse_quantization_config(qc, twhere)
    fmt = WeightFormat.choose(dtype, scheme, where)
    if not _has_shards(folder):
        return cfg, fmt, Storage(scheme, prefix="language_model." if nested else ""), f"{where} (config only)"
    reader = CheckpointReader(folder)
    n = len(reader.shard_sizes)
    return (cfg, fmt, Storage(scheme, reader, "language_model." if nested else ""),
            f"{where} and the safetensors headers of {n} shard{'s' * (n > 1)} (shapes and storage checked per tensor)")


def open_drafter(folder: Path, drafter_dtype: str = "float") -> tuple[DrafterConfig, tuple[int, int] | None]:
    """The EAGLE-3 drafter config of a published drafter folder, and the FP8 tile of the drafter ``splitspec build
    --drafter-dtype`` makes from it (fp8: the checkpoint's tile when it is FP8, else 128×128; float: None). The
    aux-id convention may stay unknown: no byte of the plan depends on it."""
    folder = Path(folder)
    _published(folder)
    raw = read_json(folder / "config.json")
    cfg = DrafterConfig.from_hf(raw, str(folder / "config.json"))
    if drafter_dtype != "fp8":
        return cfg, None
    scheme = drafter_scheme(raw, str(folder / "config.json"))
    return cfg, scheme.block or FP8_BLOCK


def plan_checkpoints(target: Path, drafter: Path | None, dep: Deployment, dtype: str | None = None,
                     drafter_dtype: str = "float") -> MemoryPlan:
    """The memory plan of ``dep`` for the published ``target`` (and ``drafter``, as ``drafter_dtype``) folders."""
    cfg, fmt, storage, source = open_target(Path(target), dtype)
    dcfg, dblock = open_drafter(Path(drafter), drafter_dtype) if drafter else (None, None)
    if dcfg is not None and dcfg.target_hidden_size != cfg.hidden_size:
        raise CheckpointError(f"{Path(drafter) / 'config.json'}: target_hidden_size = {dcfg.target_hidden_size}, but the "
                              f"target's hidden_size is {cfg.hidden_size}")
    plan = plan_memory(cfg, fmt, storage, dcfg, dep, source, drafter_block=dblock)
    plan.drafter_name = str(drafter) if drafter else None
    return plan


def _gib(n: int) -> str:
    return f"{n / GIB:9.2f} GiB"


def _columns(plan: MemoryPlan) -> list[tuple[str, object]]:
    gpus = plan.gpus
    cols = [("GPU 0", gpus[0])]
    rest = gpus[1:]
    if rest:
        same = all(g.items == rest[0].items for g in rest)
        span = f"{rest[0].gpu}-{rest[-1].gpu}" if len(rest) > 1 else f"{rest[0].gpu}"
        heaviest = max(rest, key=lambda g: g.total)
        cols.append((f"GPU {span} (each)" if same else f"GPU {heaviest.gpu} (heaviest of {span})", heaviest))
    return cols


def render(plan: MemoryPlan) -> list[str]:
    """The plan as text lines: deployment, one row per item, totals, the KV budget and the verdict."""
    d, f = plan.deployment, plan.fmt
    drafter = ("no drafter" if plan.drafter_name is None else
               "drafter TP1 on GPU 0" if d.draft_tp == 1 else f"drafter sharded over the {d.tp} GPUs")
    if plan.drafter_block is not None:
        drafter += f" (FP8 linears, {plan.drafter_block[0]}×{plan.drafter_block[1]} tiles)"
    lines = [f"memory plan: {f.name} weights ({FORMAT_NOTES[f.name]}), TP{d.tp} EP{d.ep}, {drafter}",
             f"  from: {plan.source}",
             f"  limits: max_batch_size {d.max_batch_size}, max_seq_len {d.max_seq_len}, "
             f"{'max_draft_len ' + str(d.max_draft_len) if plan.drafter_name else 'no speculation'}, prefill chunk {d.max_prefill_tokens}, CUDA graphs {'on' if d.cuda_graphs else 'off'}"
             + (", draft-ahead" if d.draft_ahead and plan.drafter_name and d.draft_tp == 1 else "")]
    cols = _columns(plan)
    labels = list(dict.fromkeys(label for _, g in cols for label in g.items))
    lines.append(f"  {'':44}" + "".join(f"{name:>24}" for name, _ in cols))
    for group in GROUPS:
        for label in labels:
            row = [g.items.get(label) for _, g in cols]
            if any(r and r[0] == group for r in row):
                lines.append(f"  {label:44}" + "".join(f"{_gib(r[1]) if r else '—':>24}" for r in row))
    lines.append(f"  {'total':44}" + "".join(f"{_gib(g.total):>24}" for _, g in cols))
    if d.budget_bytes is not None:
        lines.append(f"  {'budget':44}" + "".join(f"{_gib(d.budget_bytes):>24}" for _ in cols))
        lines.append(f"  {'free':44}" + "".join(f"{_gib(d.budget_bytes - g.total):>24}" for _, g in cols))
    g0 = plan.gpus[0]
    kv = g0.group("kv")
    per = plan.kv_bytes_per_token[0]
    text = (f"  KV budget: {plan.kv_tokens} tokens ({'--kv-tokens' if d.kv_tokens else f'{d.max_batch_size} × {d.max_seq_len}'}) "
            f"= {kv / GIB:.2f} GiB on GPU 0 ({per / 1024:.1f} KiB per token: target latent"
            + (" + drafter K/V" if plan.drafter_name else "") + ")")
    fits = [plan.kv_fit(g) for g in plan.gpus]
    if fits[0] is not None:
        most = min(fits)
        text += f"; within the budget the tightest GPU holds up to {most} tokens ({most // d.max_seq_len} sequences of {d.max_seq_len})"
    lines.append(text)
    over = plan.over()
    if d.budget_bytes is not None:
        lines.append("  fits: yes" if not over else f"  fits: NO ({len(over)} of {len(plan.gpus)} GPUs over budget)")
    return lines


def to_json(plan: MemoryPlan) -> dict:
    """The plan as a JSON object: deployment, weight format, per-GPU items (bytes) and totals."""
    d = plan.deployment
    return {"deployment": {k: getattr(d, k) for k in d.__dataclass_fields__}, "weights": plan.fmt.name,
            "source": plan.source, "kv_tokens": plan.kv_tokens, "kv_bytes_per_token": plan.kv_bytes_per_token,
            "fits": not plan.over() if d.budget_bytes is not None else None,
            "gpus": [{"gpu": g.gpu, "total": g.total, "kv_tokens_fit": plan.kv_fit(g),
                      "items": [{"label": label, "group": grp, "bytes": b} for label, (grp, b) in g.items.items()]}
                     for g in plan.gpus]}


def main(target: Path, drafter: Path | None, dep: Deployment, dtype: str | None = None, json_out: Path | None = None,
         drafter_dtype: str = "float") -> None:
    """Print the plan; write it as JSON to ``json_out``; raise MemoryPlanError (one line) when it does not fit.
    Raises ConfigError, before planning, for a ``json_out`` inside the target's or drafter's folder (it could replace
    a file the plan reads)."""
    for folder in (target, drafter):
        if json_out is not None and folder is not None and Path(folder).resolve() in Path(json_out).resolve().parents:
            raise ConfigError(f"--json {json_out}: inside the input folder {folder}; write the plan elsewhere")
    plan = plan_checkpoints(target, drafter, dep, dtype, drafter_dtype)
    print("\n".join(render(plan)))
    if json_out is not None:
        write_json(to_json(plan), Path(json_out))
    plan.check()
