"""Engine files: the ``target/`` and ``drafter/`` folders ``splitspec build`` writes (``engine.json`` beside
``rank{i}.safetensors``), read back by each rank. Formats: docs/formats.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from splitspec.config import Mapping, TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.errors import CheckpointError
from splitspec.files import read_json
from splitspec.models.drafters import FP8_WEIGHTS, quantize_drafter
from splitspec.models.shapes import int4_expert_shapes, random_weights


def read_engine_meta(folder: Path, kind: str) -> dict:
    """Read and check ``engine.json`` of a built ``kind`` ('target' or 'drafter') engine: its kind, its config (and,
    for the target, mapping and limits) readable as ``splitspec build`` writes them. Raises CheckpointError naming the
    file and the field."""
    path = Path(folder) / "engine.json"
    meta = read_json(path)  # a JSON object, or CheckpointError
    if meta.get("kind") != kind:
        raise CheckpointError(f"{path}: kind {meta.get('kind')!r}, expected {kind!r}")
    try:
        (TargetConfig if kind == "target" else DrafterConfig).from_dict(meta["config"])
        if kind == "target":
            Mapping.from_dict(meta["mapping"])
            for name in ("max_batch_size", "max_seq_len", "max_draft_len"):
                v = meta["limits"][name]
                if not isinstance(v, int) or isinstance(v, bool) or v < (name != "max_draft_len"):
                    raise ValueError(f"limits.{name} = {v!r}, expected a positive integer")
    except KeyError as e:
        raise CheckpointError(f"{path}: field {e} missing (not an engine.json of splitspec build?)") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from None
    return meta


def load_rank_weights(folder: Path, rank: int, device: str, meta: dict | None = None, shapes: dict | None = None) -> dict[str, torch.Tensor]:
    """Runtime-layout weights of one rank: ``rank{i}.safetensors``, or, for a synthetic engine
    (``engine.json`` ``weights.synthetic``), seeded random tensors of ``shapes`` made on ``device`` — for an
    ``int4`` target its routed experts INT4 in the layout ``build --dtype int4`` writes
    (:func:`splitspec.models.shapes.int4_expert_shapes`), the rest in ``quantization.activation_dtype``; a drafter whose
    ``quantization.weights`` is ``fp8_e4m3_block_scaled`` with its linears then quantised
    (:func:`splitspec.models.drafters.quantize_drafter`, ``quantization.weight_block_size`` tiles)."""
    synthetic = (meta or {}).get("weights", {}).get("synthetic")
    if synthetic is not None:
        group = meta["quantization"]["group_size"] if meta["dtype"] == "int4" else None
        fname = meta["quantization"]["activation_dtype"] if group else meta["dtype"]
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[fname]
        if group:
            shapes = int4_expert_shapes(shapes, group)
        w = random_weights(shapes, dtype, device, int(synthetic.get("seed", 0)) * 1000 + rank, int4_group=group)
        q = meta.get("quantization") or {}
        if meta.get("kind") == "drafter" and q.get("weights") == FP8_WEIGHTS:
            w = quantize_drafter(w, DrafterConfig.from_dict(meta["config"]), tuple(q["weight_block_size"]))
        return w
    path = Path(folder) / f"rank{rank}.safetensors"
    if not path.exists():
        raise CheckpointError(f"{path}: engine weights missing")
    return load_file(str(path), device=device)
