"""Train the demo target: transformers' ``DeepseekV3ForCausalLM`` (the independent reference implementation
of the Kimi-K2 architecture) with next-token cross-entropy, and its self-distillation data.

The ``noaux_tc`` router's ``e_score_correction_bias`` is trained with DeepSeek-V3's auxiliary-loss-free
balancing rule (DeepSeek-V3 technical report, arXiv:2412.19437, §2.1.2; :class:`RouterBalancer`). The
result is rounded to bf16, the published dtype (:func:`round_to_published`), and that rounded model is
used from then on: its greedy continuations (:func:`greedy_continuations`) are what the drafter learns on.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from splitspec.demo.corpus import WindowSampler, pad_batch, token_windows
from splitspec.demo.train_config import TrainConfig, adamw, lr_at, progress_bar


def build_target(config: dict[str, Any], seed: int, device: str | torch.device = "cpu") -> Any:
    """A freshly initialised ``DeepseekV3ForCausalLM`` for the Kimi-K2 ``config`` (float32, train mode).

    ``model_type`` is set to ``deepseek_v3`` as in :func:`splitspec.testing.reference.load_hf_reference_target`.
    Initialisation is transformers' own (normal, std ``initializer_range``), drawn after
    ``torch.manual_seed(seed)``; the correction bias starts at zero.
    """
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    hf_cfg.model_type = "deepseek_v3"
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_cfg).to(device=device, dtype=torch.float32)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.e_score_correction_bias.zero_()
    return model.train()


class RouterBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing of the ``noaux_tc`` routers (arXiv:2412.19437).

    Forward hooks on every router count how many tokens select each expert; :meth:`update` then
    moves each layer's ``e_score_correction_bias`` (float32 [E]) by ``γ · sign(mean load − load_e)``:
    overloaded experts become less likely to be selected, underloaded ones more. The bias only
    shifts *selection*; gating weights still come from the unbiased sigmoid scores.
    """

    def __init__(self, model: Any, gamma: float):
        self.gamma = gamma
        self.routers = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        self.loads = {i: None for i, _ in self.routers}
        self.active = False
        self._handles = [gate.register_forward_hook(self._hook(i)) for i, gate in self.routers]

    def _hook(self, layer: int) -> Callable:
        def hook(module, inputs, output) -> None:
            if not self.active:
                return
            idx = output[2].detach().reshape(-1)
            counts = torch.bincount(idx, minlength=module.num_experts).to(torch.float32)
            prev = self.loads[layer]
            self.loads[layer] = counts if prev is None else prev + counts
        return hook

    @torch.no_grad()
    def update(self) -> float:
        """Apply the bias update for the loads counted since the last call; return the mean over
        layers of max load / mean load (1.0 = perfectly balanced)."""
        imbalance = []
        for i, gate in self.routers:
            load = self.loads[i]
            if load is None:
                continue
            gate.e_score_correction_bias.add_(self.gamma * torch.sign(load.mean() - load))
            imbalance.append(float(load.max() / load.mean().clamp_min(1e-9)))
            self.loads[i] = None
        return float(np.mean(imbalance)) if imbalance else 1.0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def train_target(model: Any, sampler: WindowSampler, cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train the target with next-token cross-entropy for ``cfg.target_steps`` steps.

    Each step: one batch [target_batch_size, target_seq_len + 1] from ``sampler``, AdamW with warm-up
    and cosine decay, gradient clipping at ``cfg.grad_clip``, then the router-bias update
    (:class:`RouterBalancer`).

    Returns:
        History: ``loss`` (nats/token per step), ``imbalance`` (max/mean expert load per step), ``seconds``.
    """
    device = next(model.parameters()).device
    opt = adamw(list(model.named_parameters()), cfg.target_lr, cfg.weight_decay)
    balancer = RouterBalancer(model, cfg.bias_update_speed)
    hist: dict[str, Any] = {"loss": [], "imbalance": []}
    t0 = time.perf_counter()
    bar = progress_bar(cfg.target_steps, "target", progress)
    model.train()
    try:
        for step in range(cfg.target_steps):
            lr = lr_at(step, cfg.target_steps, cfg.target_lr, cfg.target_warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            x = sampler.batch(step).to(device)
            balancer.active = True
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
            balancer.active = False
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip, foreach=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
            imb = balancer.update()
            loss = float(loss.detach())
            hist["loss"].append(loss)
            hist["imbalance"].append(imb)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.1e}", load=f"{imb:.2f}")
            if progress and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.target_steps):
                w = hist["loss"][-cfg.log_every:]
                bar.write(f"  target step {step + 1:5d}/{cfg.target_steps}  loss {np.mean(w):.3f}  "
                          f"max/mean expert load {np.mean(hist['imbalance'][-cfg.log_every:]):.2f}  "
                          f"{(step + 1) * x.shape[0] * (x.shape[1] - 1) / (time.perf_counter() - t0):.0f} tok/s")
    finally:
        bar.close()
        balancer.remove()
    model.eval()
    hist["seconds"] = time.perf_counter() - t0
    return hist


def target_published_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The target's tensors under the published Kimi-K2 names, bf16 (``e_score_correction_bias`` float32).

    transformers stacks routed experts (``experts.gate_up_proj`` [E, 2·I, H], ``experts.down_proj``
    [E, H, I]); they are split back into ``experts.E.{gate,up,down}_proj.weight``.
    """
    cfg = model.config
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    bf = lambda t: t.to(torch.bfloat16).contiguous()  # noqa: E731
    inter = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": bf(sd["model.embed_tokens.weight"])}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}."
        for name in ("input_layernorm.weight", "self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                     "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
                     "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight"):
            out[p + name] = bf(sd[p + name])
        if n < cfg.first_k_dense_replace:
            for name in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}mlp.{name}.weight"] = bf(sd[f"{p}mlp.{name}.weight"])
            continue
        out[p + "mlp.gate.weight"] = bf(sd[p + "mlp.gate.weight"])
        out[p + "mlp.gate.e_score_correction_bias"] = sd[p + "mlp.gate.e_score_correction_bias"].float().contiguous()
        gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
        for e in range(cfg.n_routed_experts):
            out[f"{p}mlp.experts.{e}.gate_proj.weight"] = bf(gate_up[e, :inter])
            out[f"{p}mlp.experts.{e}.up_proj.weight"] = bf(gate_up[e, inter:])
            out[f"{p}mlp.experts.{e}.down_proj.weight"] = bf(down[e])
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.shared_experts.{name}.weight"] = bf(sd[f"{p}mlp.shared_experts.{name}.weight"])
    out["model.norm.weight"] = bf(sd["model.norm.weight"])
    out["lm_head.weight"] = bf(sd["lm_head.weight"])
    return out


@torch.no_grad()
def round_to_published(model: Any) -> None:
    """Round every parameter to bf16 in place (kept in float32 storage), as the export stores them;
    the correction bias stays float32. From then on the in-memory model is the exported one."""
    for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).to(p.dtype))


@torch.no_grad()
def target_heldout_loss(model: Any, tok: Any, texts: list[str], seq_len: int, max_windows: int = 64,
                        batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over non-overlapping windows of ``texts``.

    The windows are :func:`splitspec.demo.corpus.token_windows` (``seq_len + 1`` tokens, at most
    ``max_windows``), scored in right-padded batches of ``batch_size``.
    """
    device = next(model.parameters()).device
    windows = token_windows(tok, texts, seq_len, max_windows)
    total, count = 0.0, 0
    for b in range(0, len(windows), batch_size):
        x, lengths = pad_batch(windows[b:b + batch_size], 0)
        x = x.to(device)
        labels = x[:, 1:].clone()
        labels[torch.arange(labels.shape[1], device=device)[None, :] + 1 >= lengths.to(device)[:, None]] = -100
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
    return total / max(count, 1)


@torch.no_grad()
def greedy_continuations(model: Any, prompts: list[list[int]], new_tokens: int, stop_ids: list[int], pad_id: int,
                         batch_size: int, progress: bool = True) -> list[list[int]]:
    """The target's greedy continuations of ``prompts`` (left-padded batches, transformers ``generate``).

    Prompts are batched in order of length so padding stays small; a continuation ends after its
    first stop token or after ``new_tokens`` tokens.

    Returns:
        For each prompt (input order), prompt + continuation token ids.
    """
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    out: list[list[int] | None] = [None] * len(prompts)
    from tqdm import tqdm

    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc="self-distillation: greedy continuations", unit="batch", disable=not progress,
                    dynamic_ncols=True, file=sys.stdout):
        width = max(len(prompts[i]) for i in idx)
        x = torch.full((len(idx), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(idx), width), dtype=torch.int64)
        for r, i in enumerate(idx):
            x[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        gen = model.generate(input_ids=x.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=list(stop_ids), pad_token_id=pad_id)[:, width:].tolist()
        for r, i in enumerate(idx):
            cont = []
            for t in gen[r]:
                cont.append(int(t))
                if t in stop_ids:
                    break
            out[i] = list(prompts[i]) + cont
    return [o for o in out if o is not None]
