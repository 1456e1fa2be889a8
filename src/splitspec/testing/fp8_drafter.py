"""An FP8 copy of a Hugging Face EAGLE-3 drafter folder, stored as Kimi-K2-Instruct stores its linears: each linear of
the decoder layer (``*_proj.weight``) and ``fc.weight`` as float8_e4m3fn with a float32 ``weight_scale_inv`` per
128×128 tile (:func:`splitspec.quant.quantize_fp8`), and ``quantization_config`` = {"quant_method": "fp8", "fmt":
"e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"} in config.json; every other tensor and file
as it was. For the tests and the FP8-drafter lab entry (no published FP8 EAGLE-3 drafter is at hand)."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from splitspec import quant
from splitspec.files import read_json, write_json

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def is_fp8_linear(name: str) -> bool:
    """Whether a published drafter tensor name is one this copy stores in FP8 (the layer's linears and ``fc``)."""
    return name.endswith("_proj.weight") or name == "fc.weight"


def write_fp8_drafter(src: Path, out: Path, block: tuple[int, int] = (128, 128)) -> list[str]:
    """Copy drafter folder ``src`` to ``out`` (replaced) with its linears in block-scaled FP8. Returns their names."""
    src, out = Path(src), Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    done = []
    for f in sorted(out.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in [n for n in tensors if is_fp8_linear(n)]:
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quant.quantize_fp8(tensors[name], block)
            done.append(name)
        save_file(tensors, str(f))
    index = out / "model.safetensors.index.json"
    if index.exists():
        meta = read_json(index)
        for name in done:
            meta["weight_map"][name.removesuffix("weight") + "weight_scale_inv"] = meta["weight_map"][name]
        write_json(meta, index)
    cfg = read_json(out / "config.json")
    cfg["quantization_config"] = dict(FP8_CONFIG, weight_block_size=list(block))
    write_json(cfg, out / "config.json")
    return done
