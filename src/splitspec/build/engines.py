"""Build: turn converted rank shards into engines in the runtime layout.

The runtime layout of the engines' tensors (float, FP8 and INT4 forms, and the drafter's) is made by
:mod:`splitspec.build.runtime_layout`, which describes it.

``engine.json`` records architecture, dtype, weight format, model config, mapping, limits (max batch size,
max sequence length, max draft length) and, for the drafter, its aux layer ids and convention.
Weights are read and written one tensor at a time. :func:`build_pair` is convert + build in one call, for
a Hugging Face pair folder (the demo, the tests, bench/acceptance.py).
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from splitspec.config import Mapping, TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.build.memory_plan import LIMITS, check_build
from splitspec.build.runtime_layout import drafter_runtime_layout, iter_target_runtime_layout
from splitspec.convert.pair import FORMAT, convert_pair, tokenizer_files
from splitspec.errors import CheckpointError, ConfigError
from splitspec.convert.safetensors import CheckpointReader, write_tensors
from splitspec.files import atomic_dir, read_json, write_json
from splitspec.models.drafters import FP8_BLOCK, FP8_WEIGHTS, drafter_linears, quantize_drafter

ENGINE_FORMAT = "splitspec-engine-v1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BUILD_DTYPES = (*DTYPES, "fp8", "int4")
DRAFTER_DTYPES = ("float", "fp8")  # the drafter in the engine's float dtype, or its linears FP8
QUANT_FLOAT_DTYPE = "bfloat16"  # default dtype of what fp8 / int4 engines do not keep quantised, and of their activations
INT4_LAYOUT = {"w13": "int32 [E_local, 2*I_e, H/8] (gate rows, then up) + w13.scale [E_local, 2*I_e, H/G]",
               "w2": "int32 [E_local, H, I_e/8] + w2.scale [E_local, H, I_e/G]",
               "packing": "8 values per int32 along the input dimension, value j in bits 4j..4j+3, value = nibble - 8",
               "dequantised": "(nibble - 8) * scale[row, col // G]"}


def int4_quantization(group: int, float_dtype: str, source) -> dict:
    """``engine.json`` ``quantization`` of a target keeping its routed experts INT4 in groups of ``group``, everything
    else (and the activations) ``float_dtype``; ``source``: what the weights came from (docs/formats.md)."""
    return {"weights": "int4_routed_experts", "weight_block_size": None, "activation_dtype": float_dtype, "source": source,
            "format": "compressed-tensors pack-quantized, symmetric INT4 (routed experts only)", "group_size": group,
            "layout": INT4_LAYOUT}


def _read_checkpoint_config(folder: Path, kind: str) -> dict:
    meta = read_json(folder / "config.json")
    if meta.get("format") != FORMAT or meta.get("kind") != kind:
        raise CheckpointError(f"{folder / 'config.json'}: not a converted {kind} checkpoint (format {meta.get('format')!r}, "
                              f"kind {meta.get('kind')!r}); run 'splitspec convert' first")
    return meta


def build_engines(checkpoints: Path, out: Path, dtype: str | None = None, max_batch_size: int = 8,
                  max_seq_len: int = 1024, max_draft_len: int = 8, progress: bool = True,
                  gpu_memory_gib: float | None = None, float_dtype: str | None = None, drafter_dtype: str | None = None) -> Path:
    """Build ``out/target`` and ``out/drafter`` engines from ``checkpoints`` (output of :func:`convert_pair`).

    Args:
        dtype: weight/activation dtype of the engines ("float32", "bfloat16", "float16"); "fp8": keep an FP8
            block-scaled checkpoint's linear weights in FP8 with their tile scales (computed through
            :func:`splitspec.quant.linear`); "int4": keep an INT4 checkpoint's routed experts packed with their
            group scales (:mod:`splitspec.models.int4_routed`). None: "int4" for an INT4 checkpoint, else "float32".
            The router and its correction bias stay float32.
        float_dtype: with "fp8" / "int4", the dtype of everything else and of the activations (default bfloat16).
        drafter_dtype: None or "float": the drafter in the engine's float dtype (an FP8 drafter checkpoint dequantised);
            "fp8": its linears (:func:`splitspec.models.drafters.drafter_linears`) in FP8 — an FP8 drafter checkpoint's
            tiles kept where they survive the fusion, every other one quantised here in 128×128 tiles (the
            checkpoint's tile when it has one) — and the rest in the engine's float dtype (:data:`DRAFTER_DTYPES`).
        max_batch_size: sequences the KV caches hold at once (slots).
        max_seq_len: tokens per sequence (prompt + generated + draft), bounds the KV caches.
        max_draft_len: largest number of draft tokens per cycle a request may ask for.
        progress: show a tqdm progress bar.
        gpu_memory_gib: per-GPU budget the memory plan is checked against (default: this machine's free GPU
            memory; on a CPU machine no check), :func:`splitspec.build.memory_plan.check_build`.
    Raises:
        MemoryPlanError: the engines would not fit the budget (checked before anything is written).
        ConfigError: a limit out of range; fp8 / int4 asked of a checkpoint not stored so; a drafter
            variant the engine would not run faithfully. CheckpointError: a missing or malformed shard.
    """
    checkpoints, out = Path(checkpoints), Path(out)
    if dtype is None:
        qm = _read_checkpoint_config(checkpoints / "target", "target").get("quantization") or {}
        dtype = "int4" if qm.get("method") == "int4" else "float32"
    if dtype not in BUILD_DTYPES:
        raise ConfigError(f"dtype '{dtype}' is not supported (expected one of {', '.join(BUILD_DTYPES)})")
    if drafter_dtype not in (None, *DRAFTER_DTYPES):
        raise ConfigError(f"drafter_dtype '{drafter_dtype}' is not supported (expected one of {', '.join(DRAFTER_DTYPES)})")
    for name, v in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len), ("max_draft_len", max_draft_len)):
        if not 1 <= v <= LIMITS[name]:
            raise ConfigError(f"{name} = {v}, expected an integer in 1..{LIMITS[name]}")
    if max_seq_len < max_draft_len + 3:  # Sequence.need_tokens: a one-token prompt, one new token, k + 1 verified
        raise ConfigError(f"max_seq_len = {max_seq_len}, expected ≥ max_draft_len + 3 = {max_draft_len + 3} (or a smaller k)")
    tmeta = _read_checkpoint_config(checkpoints / "target", "target")
    dmeta = _read_checkpoint_config(checkpoints / "drafter", "drafter")
    tcfg, mapping = TargetConfig.from_dict(tmeta["config"]), Mapping.from_dict(tmeta["mapping"])
    dcfg = DrafterConfig.from_dict(dmeta["config"])
    if max_seq_len > tcfg.max_position_embeddings:
        raise ConfigError(f"max_seq_len = {max_seq_len} exceeds the target's max_position_embeddings = {tcfg.max_position_embeddings}")
    qmeta = tmeta.get("quantization") or {"method": "none"}
    block = tuple(qmeta["weight_block_size"]) if qmeta.get("method") == "fp8" else None
    group = qmeta.get("group_size") if qmeta.get("method") == "int4" else None
    keep_fp8, keep_int4 = dtype == "fp8", dtype == "int4"
    if (keep_fp8 and block is None) or (keep_int4 and group is None):
        what = "an FP8 block-scaled checkpoint's weights" if keep_fp8 else "an INT4 checkpoint's routed experts"
        raise ConfigError(f"dtype '{dtype}' keeps {what}, but {checkpoints / 'target'} holds "
                          f"{qmeta.get('source', 'float weights')}; choose float32, bfloat16 or float16")
    quantised = keep_fp8 or keep_int4
    if float_dtype is not None and (float_dtype not in DTYPES or not quantised and float_dtype != dtype):
        raise ConfigError(f"float_dtype '{float_dtype}' goes with dtype fp8 or int4 (one of {', '.join(DTYPES)}); "
                          f"dtype '{dtype}' is the engine's float dtype already")
    fname = (float_dtype or QUANT_FLOAT_DTYPE) if quantised else dtype
    tdt = DTYPES[fname]
    weight_format = (int4_quantization(group, fname, qmeta.get("source")) if keep_int4 else
                     {"weights": FP8_WEIGHTS if keep_fp8 else fname, "weight_block_size": list(block) if keep_fp8 else None,
                      "activation_dtype": fname, "source": qmeta.get("source")})
    limits = {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len, "max_draft_len": max_draft_len}
    dq = dmeta.get("quantization") or {"method": "none"}
    dsrc_block = tuple(dq["weight_block_size"]) if dq.get("method") == "fp8" else None
    dfp8 = drafter_dtype == "fp8"
    dblock = (dsrc_block or FP8_BLOCK) if dfp8 else None
    print(check_build(tcfg, mapping, dcfg, dtype, block, limits, gpu_memory_gib, float_bytes=tdt.itemsize, group=group,
                      drafter_block=dblock))
    with atomic_dir(out, keep=(checkpoints,)) as tmp:
        (tmp / "target").mkdir()
        (tmp / "drafter").mkdir()
        for rank in tqdm(range(mapping.tp_size), desc="build target ranks", unit="rank", disable=not progress):
            shard = checkpoints / "target" / f"rank{rank}.safetensors"
            if not shard.exists():
                raise CheckpointError(f"{shard}: shard missing (mapping says tp_size={mapping.tp_size})")
            src = CheckpointReader.single(shard)
            write_tensors(iter_target_runtime_layout(src, tcfg, mapping, rank, tdt, block, keep_fp8, group, keep_int4),
                          tmp / "target" / f"rank{rank}.safetensors")
            src.close()
        for f in tokenizer_files(checkpoints / "target"):
            shutil.copy2(checkpoints / "target" / f, tmp / "target" / f)
        write_json({"format": ENGINE_FORMAT, "kind": "target", "architecture": "DeepseekV3ForCausalLM", "dtype": dtype,
                    "quantization": weight_format, "config": tcfg.to_dict(), "mapping": mapping.to_dict(), "limits": limits},
                   tmp / "target" / "engine.json")
        dlayout = drafter_runtime_layout(CheckpointReader.single(checkpoints / "drafter" / "rank0.safetensors"), tdt, dcfg,
                                         dsrc_block, dfp8)
        quantised = [n for n in drafter_linears(dcfg) if n + ".scale_inv" not in dlayout] if dfp8 else []
        if dfp8:
            dlayout = quantize_drafter(dlayout, dcfg, dblock)
        write_tensors(dlayout.items(), tmp / "drafter" / "rank0.safetensors")
        del dlayout
        dformat = {"weights": FP8_WEIGHTS if dfp8 else fname, "weight_block_size": list(dblock) if dfp8 else None,
                   "activation_dtype": fname, "fp8_linears": list(drafter_linears(dcfg)) if dfp8 else [],
                   "quantised_at_build": quantised, "source": dq.get("source"),
                   "not_fp8": "embed_tokens, lm_head, norms" + (", attn.w_uk, attn.w_uv" if dcfg.is_mla else "") if dfp8 else None}
        write_json({"format": ENGINE_FORMAT, "kind": "drafter", "architecture": dcfg.architecture,
                    "dtype": fname, "quantization": dformat,
                    "config": dcfg.to_dict(), "mapping": {"tp_size": 1}, "limits": limits,
                    "aux_layer_ids": list(dcfg.aux_layer_ids), "aux_convention": dcfg.aux_convention,
                    "aux_convention_source": dcfg.aux_convention_source, "capture_points": list(dcfg.capture_points()),
                    "capture": dmeta.get("capture"), "embedding": dmeta.get("embedding"),
                    "embedding_source": dmeta.get("embedding_source")},
                   tmp / "drafter" / "engine.json")
    print(f"built engines → {out}/target (TP{mapping.tp_size}, {dtype}"
          + (f": FP8 weights in {block[0]}×{block[1]} tiles, {fname} activations" if keep_fp8 else "")
          + (f": INT4 routed experts in groups of {group}, everything else {fname}" if keep_int4 else "")
          + f") and {out}/drafter (TP1, {str(tdt).removeprefix('torch.')}"
          + (f": FP8 linears in {dblock[0]}×{dblock[1]} tiles" + (f", {len(quantised)} quantised here" if quantised else "")
             if dfp8 else "") + f"); limits {limits}")
    return out


def build_pair(models_dir: Path, out_dir: Path, tp_size: int = 1, ep_size: int = 1, max_batch_size: int = 1,
               max_seq_len: int = 1024, quiet: bool = False, drafter_dtype: str | None = None,
               dtype: str = "float32") -> Path:
    """Convert and build ``models_dir/{target,drafter}`` (Hugging Face checkpoints) into ``out_dir``: the
    converted checkpoint in ``out_dir/ckpt``, engines in ``out_dir/engines`` (returned): in ``dtype`` (float32,
    bfloat16 or float16), or for an INT4 target its routed experts INT4 and the rest float32.

    Args:
        tp_size, ep_size: the target's mapping (:func:`splitspec.convert.pair.convert_pair`).
        max_batch_size, max_seq_len: engine limits (:func:`build_engines`).
        drafter_dtype: None (the engine's float dtype) or "fp8" (:func:`build_engines`).
        dtype: the engines' float dtype (:func:`build_engines`); with float32 an INT4 target keeps its experts INT4.
        quiet: swallow what convert and build print (progress bars, notices).
    """
    models_dir, out_dir = Path(models_dir), Path(out_dir)
    with contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        convert_pair(models_dir / "target", models_dir / "drafter", out_dir / "ckpt", tp_size=tp_size, ep_size=ep_size)
        kind = {"float_dtype": "float32"} if dtype == "float32" else {"dtype": dtype}  # float32: INT4 experts stay INT4
        return build_engines(out_dir / "ckpt", out_dir / "engines", max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                             drafter_dtype=drafter_dtype, **kind)
