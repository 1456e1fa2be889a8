"""Which drafter implementation a drafter config names: Llama attention (:mod:`splitspec.models.drafter`) or MLA
(:mod:`splitspec.models.drafter_mla`), chosen by :attr:`splitspec.drafter_config.DrafterConfig.attention`."""

from __future__ import annotations

import torch

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
