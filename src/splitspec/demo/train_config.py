"""What determines the trained demo pair: :class:`TrainConfig`, its checks, and deterministic execution.

Everything in :class:`TrainConfig` enters the cache key (:mod:`splitspec.demo.cache`). The optimiser and
learning-rate schedule shared by the target's and the drafter's training are here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from splitspec.demo.checkpoints import drafter_config, target_config
from splitspec.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained pair (all of it enters the cache key).

    Sizes are Kimi-K2's structure at toy width; step counts and batch sizes are set so that the
    whole pipeline runs in minutes on a small CPU (:meth:`preset`; the README gives measured times).
    Token counts are in tokens of the 4096-entry BPE vocabulary; learning rates are AdamW peak rates.
    """

    seed: int = 0
    device: str = "cpu"
    num_threads: int = 2  # fixed torch intra-op threads: results depend on the reduction split
    # --- target (overrides onto checkpoints.target_config) ---
    hidden_size: int = 256
    num_hidden_layers: int = 5
    intermediate_size: int = 768
    moe_intermediate_size: int = 128
    num_attention_heads: int = 8
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    # --- drafter (overrides onto checkpoints.drafter_config) ---
    drafter_intermediate_size: int = 768
    aux_layer_ids: tuple[int, int, int] = (1, 2, 4)  # inputs to target layers: low, mid, high
    draft_vocab_size: int = 1024
    # --- data ---
    heldout_every: int = 40  # every 40th corpus file (sorted order) is held out
    chat_fraction: float = 0.2  # share of chat samples among training tokens (at most)
    max_corpus_files: int | None = None  # cap on corpus files (tests); None = all
    # --- target training ---
    target_steps: int = 520
    target_batch_size: int = 8
    target_seq_len: int = 256
    target_lr: float = 2e-3
    target_warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_speed: float = 1e-3  # γ of the aux-loss-free balancing rule
    # --- self-distillation data ---
    distill_code_prompts: int = 320
    distill_chat_prompts: int = 96
    distill_prompt_tokens: int = 48
    distill_new_tokens: int = 96
    distill_corpus_windows: int = 128
    generate_batch_size: int = 64
    # --- drafter training ---
    drafter_steps: int = 224
    drafter_batch_size: int = 12
    ttt_steps: int = 4
    drafter_lr: float = 2e-3
    drafter_warmup: int = 20
    ttt_step_weight: float = 0.8  # loss weight of step s is ttt_step_weight ** (s - 1)
    # --- report ---
    eval_prompts: int = 12
    eval_new_tokens: int = 64
    eval_draft_tokens: int = 4
    log_every: int = 20

    @staticmethod
    def preset(device: str = "cpu", seed: int = 0) -> "TrainConfig":
        """The configuration ``splitspec demo-models`` trains.

        ``cpu``: the 10.3M-parameter demo target (5 layers, hidden 256, 16 experts), sized for a
        2-core CPU. ``cuda``: a larger pair (8 layers, hidden 384, 32 experts, about 56M parameters;
        8M training tokens, 2.7k self-distillation sequences) sized for one data-centre GPU.

        Raises:
            ConfigError: an unknown device kind.
        """
        if device == "cpu":
            return TrainConfig(seed=seed, device="cpu")
        if device.startswith("cuda"):
            return TrainConfig(
                seed=seed, device=device, num_threads=8,
                hidden_size=384, num_hidden_layers=8, intermediate_size=1152, moe_intermediate_size=192,
                num_attention_heads=16, n_routed_experts=32, num_experts_per_tok=4, q_lora_rank=128,
                kv_lora_rank=96, drafter_intermediate_size=1152, aux_layer_ids=(1, 4, 7),
                target_steps=1000, target_batch_size=16, target_seq_len=512, target_lr=1.5e-3, target_warmup=50,
                distill_code_prompts=1536, distill_chat_prompts=768, distill_corpus_windows=384,
                distill_new_tokens=128, generate_batch_size=256,
                drafter_steps=1000, drafter_batch_size=32, ttt_steps=5, eval_prompts=24, log_every=100)
        raise ConfigError(f"device '{device}': expected 'cpu' or 'cuda[:N]'")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d


def trained_target_config(cfg: TrainConfig, bos_id: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    """The trained target's ``config.json``: :func:`splitspec.demo.checkpoints.target_config` at ``cfg``'s sizes."""
    c = target_config(bos_id, eos_id, pad_id)
    c.update(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
             intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
             n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
             q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank)
    return c


def trained_drafter_config(cfg: TrainConfig, bos_id: int, eos_id: int) -> dict[str, Any]:
    """The trained drafter's ``config.json``: :func:`splitspec.demo.checkpoints.drafter_config` at ``cfg``'s sizes."""
    c = drafter_config(bos_id, eos_id)
    heads = cfg.num_attention_heads
    c.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.drafter_intermediate_size,
             num_attention_heads=heads, num_key_value_heads=heads, head_dim=cfg.hidden_size // heads,
             draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.hidden_size)
    c["eagle_config"] = dict(c["eagle_config"], eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
                             aux_layer_id_convention="input")
    return c


def check_config(cfg: TrainConfig) -> None:
    """Raise ConfigError for sizes or counts the pipeline cannot run."""
    if not (cfg.device == "cpu" or cfg.device.startswith("cuda")):
        raise ConfigError(f"TrainConfig.device = '{cfg.device}': expected 'cpu' or 'cuda[:N]'")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"TrainConfig.device = '{cfg.device}' but torch.cuda.is_available() is False "
                          f"(torch {torch.__version__}); train on the CPU with --device cpu")
    for name in ("num_threads", "target_steps", "target_batch_size", "target_seq_len", "drafter_steps",
                 "drafter_batch_size", "ttt_steps", "distill_prompt_tokens", "distill_new_tokens",
                 "generate_batch_size", "heldout_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"TrainConfig.{name} = {getattr(cfg, name)}, expected ≥ 1")
    if sorted(cfg.aux_layer_ids) != list(cfg.aux_layer_ids) or not all(0 <= i < cfg.num_hidden_layers for i in cfg.aux_layer_ids):
        raise ConfigError(f"TrainConfig.aux_layer_ids = {cfg.aux_layer_ids}: expected three ascending "
                          f"input-to-layer ids in [0, {cfg.num_hidden_layers})")
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads {cfg.num_attention_heads}")
    for name in ("num_attention_heads", "n_routed_experts"):
        if getattr(cfg, name) % 8:
            raise ConfigError(f"TrainConfig.{name} = {getattr(cfg, name)}: must be divisible by 8 (TP8)")
    if not 0.0 <= cfg.chat_fraction < 1.0:
        raise ConfigError(f"TrainConfig.chat_fraction = {cfg.chat_fraction}, expected in [0, 1)")


@contextlib.contextmanager
def deterministic_mode(cfg: TrainConfig) -> Iterator[None]:
    """Fix the thread count and turn on deterministic algorithms for the duration; restore afterwards.

    On CUDA, cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first use for deterministic
    results (set here if absent), TF32 is turned off, and ops without a deterministic CUDA kernel
    only warn (``warn_only``) instead of failing.
    """
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    cuda = cfg.device.startswith("cuda")
    prev_tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) if cuda else None
    torch.set_num_threads(cfg.num_threads)
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=cuda)
    try:
        yield
    finally:
        torch.set_num_threads(prev_threads)
        torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
        if prev_tf32 is not None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev_tf32


def lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor · peak`` at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def adamw(params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (β = 0.9, 0.95) with weight decay on matrices only (not norms, not the embedding)."""
    decay = [p for n, p in params if p.requires_grad and p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in params if p.requires_grad and not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar over training steps, on stdout (with the loss lines)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True, leave=True, file=sys.stdout)
