"""Which drafter implementation a drafter config names: Llama attention (:mod:`splitspec.models.drafter`) or MLA
(:mod:`splitspec.models.drafter_mla`), chosen by :attr:`splitspec.drafter_config.DrafterConfig.attention`, and which of
its runtime-layout weights an FP8 drafter keeps in FP8 (:func:`drafter_linears`, :func:`quantize_drafter`)."""

from __future__ import annotations

import torch

from splitspec import quant
from splitspec.drafter_config import DrafterConfig
from splitspec.models.drafter import DrafterKVCache, DrafterModel, Eagle3Drafter, shard_drafter
from splitspec.models.drafter_mla import MLADrafterKVCache, MLADrafterModel, shard_mla_drafter
from splitspec.models.layers import TPComm


def drafter_model(cfg: DrafterConfig, weights: dict[str, torch.Tensor], comm: TPComm | None = None) -> Eagle3Drafter:
    """The drafter (one rank of it, with ``comm`` of its draft_tp group) over runtime-layout ``weights``."""
    return (MLADrafterModel if cfg.is_mla else DrafterModel)(cfg, weights, comm)


def drafter_cache(cfg: DrafterConfig, rows: int, dtype: torch.dtype, device, tp_size: int = 1):
    """The drafter's KV cache on one rank of a draft_tp = ``tp_size`` group: ``rows`` token rows."""
    return (MLADrafterKVCache if cfg.is_mla else DrafterKVCache)(cfg, rows, dtype, device, tp_size)


def shard_drafter_weights(w: dict[str, torch.Tensor], cfg: DrafterConfig, rank: int, size: int) -> dict[str, torch.Tensor]:
    """TP1 runtime-layout drafter weights sliced for rank ``rank`` of a draft_tp = ``size`` group."""
    return (shard_mla_drafter if cfg.is_mla else shard_drafter)(w, cfg, rank, size)


FP8_WEIGHTS = "fp8_e4m3_block_scaled"  # engine.json ``quantization.weights`` of an engine keeping FP8 linears
FP8_BLOCK = (128, 128)  # the tile of a drafter quantised at build (Kimi-K2-Instruct's weight_block_size)


def drafter_linears(cfg: DrafterConfig) -> tuple[str, ...]:
    """Runtime-layout weights an FP8 drafter keeps in FP8: ``fc``, the attention's linears (``qkv_proj``, ``o_proj``;
    MLA: ``attn.fused_qkv_a``, ``attn.q_b_proj``, ``attn.o_proj``) and the MLP's ``mlp.w13`` / ``mlp.w2``. Not the
    embedding (a row gather), ``lm_head`` (its argmax is the proposal: kept in the activation dtype, as Kimi-K2-Instruct
    keeps its own), the norms, nor an MLA drafter's ``attn.w_uk`` / ``attn.w_uv`` (einsum operands, as in the target)."""
    attn = ("attn.fused_qkv_a", "attn.q_b_proj", "attn.o_proj") if cfg.is_mla else ("qkv_proj", "o_proj")
    return ("fc", *attn, "mlp.w13", "mlp.w2")


def quantize_drafter(w: dict[str, torch.Tensor], cfg: DrafterConfig, block: tuple[int, int] = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """TP1 runtime-layout drafter weights with every :func:`drafter_linears` weight in FP8: those already FP8 (with
    ``<name>.scale_inv``, as a checkpoint's tiles survived build) kept, the others quantised in ``block`` tiles by
    :func:`splitspec.quant.quantize_fp8` (scale = tile amax / 448), plus ``fp8.weight_block_size`` int64 [2] (on the CPU). Works on
    the meta device (shapes only). Raises ValueError when kept tiles differ from ``block``."""
    have = quant.block_size_of(w)
    if have is not None and have != tuple(block):
        raise ValueError(f"the drafter's FP8 weights are in {have[0]}×{have[1]} tiles, not {block[0]}×{block[1]}")
    out = dict(w)
    for name in drafter_linears(cfg):
        if name + ".scale_inv" not in out:
            out[name], out[name + ".scale_inv"] = quant.quantize_fp8(w[name], block)
    out[quant.FP8_BLOCK_KEY] = torch.tensor(block, dtype=torch.int64)  # on the CPU: read by quant.block_size_of
    return out
