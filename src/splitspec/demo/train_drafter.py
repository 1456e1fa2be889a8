"""Train the demo's EAGLE-3 drafter (Li et al. 2025, arXiv:2503.01840) by distillation from the target.

The drafter reads the target's aux hidden states (inputs to layers ``aux_layer_ids``) and predicts over
a reduced draft vocabulary (the most frequent tokens). It is trained against the target's softmax
restricted to the draft vocabulary (:func:`drafter_loss`), with EAGLE-3's *training-time test* over
``ttt_steps`` steps: see :class:`Eagle3Trainable` and :func:`ttt_attention_mask`.

Indexing (as in :mod:`splitspec.runtime.scheduler`): drafter row j pairs the target's aux state at position j
with token j+1 at rotary position j and predicts token j+2; its teacher is the target's logits at
position j+1.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitspec.drafter_config import DrafterConfig
from splitspec.demo.corpus import pad_batch
from splitspec.demo.train_config import TrainConfig, adamw, lr_at, progress_bar
from splitspec.errors import ConfigError
from splitspec.models.layers import Rotary, rms_norm


def ttt_attention_mask(rows: int, step: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """Which keys a step-``step`` query sees in EAGLE-3's training-time test.

    The keys are the step-1..step-``step`` keys of all rows, concatenated step-major: column
    ``(t − 1)·rows + i`` is the step-t key of row i (at rotary position i). A step-s query at row j
    sees exactly what the runtime's drafter KV cache holds when it drafts at position j
    (:mod:`splitspec.runtime.scheduler`): step-1 keys of rows ``i ≤ j − s + 1`` (written by the extend over
    accepted tokens) and, for t = 2..s, the step-t key of row ``j − s + t`` (written by the t-th draft
    step of the same cycle). For s = 1 this is the causal mask.

    Returns:
        bool [rows, step · rows]; True = visible.
    """
    j = torch.arange(rows, device=device)[:, None]
    i = torch.arange(rows, device=device)[None, :]
    blocks = [i <= j - step + 1] + [i == j - step + t for t in range(2, step + 1)]
    return torch.cat(blocks, dim=1)


class Eagle3Trainable(nn.Module):
    """Differentiable EAGLE-3 drafter: the function of :class:`splitspec.models.drafter.DrafterModel`.

    Parameters use the published names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``); the token
    embedding is the target's, frozen (a buffer, not exported). Per step, for rows j (rotary position
    j, token ``tokens[:, j + 1]``):

        a   = concat(input_layernorm(embed(token)), hidden_norm(g))       # g: fc(aux) at step 1,
        h   = g + o_proj(attn(a))                                         # else the previous step's
        out = h + mlp(post_attention_layernorm(h))                        # output at row j − 1
        logits = lm_head(norm(out))  over the draft vocabulary

    Args:
        config: the drafter's ``config.json`` dict.
        embed: [vocab, hidden] float, the target's token embedding.
        seed: seed of the initialisation (normal, std 0.02; norms 1).
        lm_head_init: optional [draft_vocab, hidden] initial ``lm_head`` (the target's rows).
    """

    def __init__(self, config: dict[str, Any], embed: torch.Tensor, seed: int, lm_head_init: torch.Tensor | None = None):
        super().__init__()
        self.cfg = DrafterConfig.from_hf(config, "drafter config")
        c = self.cfg
        if getattr(c, "norm_before_fc", False) or getattr(c, "fc_norm", False):
            raise ConfigError("drafter config asks for norm_before_fc / fc_norm, which this trainer does not implement")
        H, nq, nkv, hd, inter = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
        gen = torch.Generator().manual_seed(seed)
        normal = lambda *shape: nn.Parameter(torch.randn(*shape, generator=gen) * 0.02)  # noqa: E731
        ones = lambda n: nn.Parameter(torch.ones(n))  # noqa: E731
        self.params = nn.ParameterDict({k.replace(".", "__"): v for k, v in {
            "fc.weight": normal(H, 3 * c.target_hidden_size),
            "midlayer.input_layernorm.weight": ones(H),
            "midlayer.hidden_norm.weight": ones(H),
            "midlayer.self_attn.q_proj.weight": normal(nq * hd, 2 * H),
            "midlayer.self_attn.k_proj.weight": normal(nkv * hd, 2 * H),
            "midlayer.self_attn.v_proj.weight": normal(nkv * hd, 2 * H),
            "midlayer.self_attn.o_proj.weight": normal(H, nq * hd),
            "midlayer.post_attention_layernorm.weight": ones(H),
            "midlayer.mlp.gate_proj.weight": normal(inter, H),
            "midlayer.mlp.up_proj.weight": normal(inter, H),
            "midlayer.mlp.down_proj.weight": normal(H, inter),
            "norm.weight": ones(H),
            "lm_head.weight": normal(c.draft_vocab_size, H),
        }.items()})
        if lm_head_init is not None:
            with torch.no_grad():
                self._p("lm_head.weight").copy_(lm_head_init)
        self.register_buffer("embed", embed.detach().float().clone(), persistent=False)
        self.rotary = Rotary(c.rope, "cpu")

    # nn.ParameterDict keys may not contain dots; map them.
    def _p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def to(self, *args, **kwargs):  # keep the rotary table on the module's device
        out = super().to(*args, **kwargs)
        self.rotary.inv_freq = self.rotary.inv_freq.to(self.embed.device)
        return out

    def published_tensors(self) -> dict[str, torch.Tensor]:
        """Float tensors under the published names, bf16, on the CPU."""
        return {k.replace("__", "."): v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in self.params.items()}

    def load_published(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load published tensors (e.g. an exported ``model.safetensors``) into the parameters."""
        with torch.no_grad():
            for k, v in self.params.items():
                v.copy_(tensors[k.replace("__", ".")].to(v.dtype))

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., 3·target_hidden] → g [..., H] (``fc``)."""
        return F.linear(aux, self._p("fc.weight"))

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             past_k: list[torch.Tensor], past_v: list[torch.Tensor], mask: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training-time-test step over all rows.

        Args:
            tokens: int64 [B, R], the token of each row (target ids).
            hidden: [B, R, H], g at step 1, else the previous step's outputs shifted by one row.
            positions: int64 [R], rotary positions (row indices).
            past_k, past_v: keys/values of the earlier steps, each [B, kv_heads, R, head_dim].
            mask: bool [R, (len(past_k) + 1)·R] (:func:`ttt_attention_mask`).

        Returns:
            (logits [B, R, draft_vocab] float32, out [B, R, H] (pre-norm output state), k, v of this step).
        """
        c = self.cfg
        B, R = tokens.shape
        nq, nkv, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        emb = self.embed[tokens]
        a = torch.cat((rms_norm(emb, self._p("midlayer.input_layernorm.weight"), c.rms_norm_eps),
                       rms_norm(hidden, self._p("midlayer.hidden_norm.weight"), c.rms_norm_eps)), -1)
        q = F.linear(a, self._p("midlayer.self_attn.q_proj.weight")).view(B, R, nq, hd)
        k = F.linear(a, self._p("midlayer.self_attn.k_proj.weight")).view(B, R, nkv, hd)
        v = F.linear(a, self._p("midlayer.self_attn.v_proj.weight")).view(B, R, nkv, hd)
        cos, sin = self.rotary.cos_sin(positions)
        q = self.rotary.apply(q, cos, sin).transpose(1, 2)
        k = self.rotary.apply(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        keys = torch.cat(past_k + [k], dim=2).repeat_interleave(nq // nkv, dim=1)
        vals = torch.cat(past_v + [v], dim=2).repeat_interleave(nq // nkv, dim=1)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=hd ** -0.5)
        h = hidden + F.linear(o.transpose(1, 2).reshape(B, R, nq * hd), self._p("midlayer.self_attn.o_proj.weight"))
        x = rms_norm(h, self._p("midlayer.post_attention_layernorm.weight"), c.rms_norm_eps)
        mlp = F.linear(F.silu(F.linear(x, self._p("midlayer.mlp.gate_proj.weight"))) * F.linear(x, self._p("midlayer.mlp.up_proj.weight")),
                       self._p("midlayer.mlp.down_proj.weight"))
        out = h + mlp
        logits = F.linear(rms_norm(out, self._p("norm.weight"), c.rms_norm_eps), self._p("lm_head.weight")).float()
        return logits, out, k, v

    def forward(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test over a batch of sequences.

        Args:
            tokens: int64 [B, T], target ids x_0..x_{T−1}.
            aux: [B, T, 3·target_hidden], the target's aux states at positions 0..T−1.
            steps: number of draft steps s = 1..steps.

        Returns:
            ``steps`` tensors of logits [B, T − 1, draft_vocab]: entry s−1, row j is the step-s
            prediction of x_{j+2}; valid for rows j ≥ s − 1 (earlier rows have no step-(s−1) state).
        """
        B, T = tokens.shape
        R = T - 1
        toks = tokens[:, 1:]
        positions = torch.arange(R, device=tokens.device)
        hidden = self.fuse(aux[:, :R])
        past_k: list[torch.Tensor] = []
        past_v: list[torch.Tensor] = []
        outs = []
        for s in range(1, steps + 1):
            mask = ttt_attention_mask(R, s, tokens.device)
            logits, out, k, v = self.step(toks, hidden, positions, past_k, past_v, mask)
            outs.append(logits)
            past_k.append(k)
            past_v.append(v)
            hidden = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)  # row j gets row j−1's state
        return outs


@torch.no_grad()
def target_aux_and_logits(model: Any, tokens: torch.Tensor, aux_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target forward for drafter training: (aux [B, T, 3·H] = inputs to layers ``aux_ids``
    concatenated, logits [B, T, vocab] float32). transformers' ``hidden_states[i]`` is the input to layer i."""
    out = model(input_ids=tokens, use_cache=False, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1).float()
    return aux, out.logits.float()


@dataclass
class TeacherData:
    """The frozen target's view of the drafter's training sequences, computed once.

    Per sequence i of length L_i: ``tokens[i]`` int64 [L_i]; ``aux[i]`` float16 [L_i, 3·H] (inputs to
    the aux layers); ``draft_logits[i]`` float16 [L_i, draft_vocab] (the target's logits at the
    draft-vocabulary ids); ``greedy[i]`` int64 [L_i] (the target's argmax over the full vocabulary).
    Position p of each is the target's state/prediction after token p.
    """

    tokens: list[torch.Tensor]
    aux: list[torch.Tensor]
    draft_logits: list[torch.Tensor]
    greedy: list[torch.Tensor]

    def batch(self, idx: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
        """Right-padded batch of sequences ``idx``: (tokens [B, T], aux [B, T, 3H] float32,
        draft_logits [B, T, Vd] float32, greedy [B, T], lengths [B]); padding repeats nothing
        meaningful and is excluded by ``lengths``."""
        T = max(len(self.tokens[i]) for i in idx)

        def pad(ts: list[torch.Tensor]) -> torch.Tensor:
            out = ts[0].new_zeros((len(ts), T) + tuple(ts[0].shape[1:]))
            for r, t in enumerate(ts):
                out[r, :len(t)] = t
            return out

        lengths = torch.tensor([len(self.tokens[i]) for i in idx], dtype=torch.int64)
        return (pad([self.tokens[i] for i in idx]).to(device), pad([self.aux[i] for i in idx]).to(device).float(),
                pad([self.draft_logits[i] for i in idx]).to(device).float(), pad([self.greedy[i] for i in idx]).to(device),
                lengths.to(device))


@torch.no_grad()
def compute_teacher(model: Any, sequences: list[list[int]], aux_ids: tuple[int, ...], draft_ids: torch.Tensor,
                    batch_size: int, pad_id: int, progress: bool = True) -> TeacherData:
    """Run the frozen target once over ``sequences`` (right-padded batches in length order; causal
    attention keeps padding out of real positions) and keep what the drafter learns from
    (:class:`TeacherData`, stored in the model's device memory)."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    ids = draft_ids.to(device)
    order = sorted(range(len(sequences)), key=lambda i: (len(sequences[i]), i))
    data = TeacherData([None] * len(sequences), [None] * len(sequences), [None] * len(sequences), [None] * len(sequences))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for idx in tqdm(batches, desc="target aux states and logits", unit="batch", disable=not progress,
                    dynamic_ncols=True, file=sys.stdout):
        tokens, lengths = pad_batch([sequences[i] for i in idx], pad_id)
        aux, logits = target_aux_and_logits(model, tokens.to(device), aux_ids)
        for r, i in enumerate(idx):
            n = int(lengths[r])
            data.tokens[i] = tokens[r, :n].to(device)
            data.aux[i] = aux[r, :n].half()
            data.draft_logits[i] = logits[r, :n][:, ids].half()
            data.greedy[i] = logits[r, :n].argmax(-1)
    return data


def drafter_loss(step_logits: list[torch.Tensor], teacher_draft_logits: torch.Tensor, teacher_greedy: torch.Tensor,
                 lengths: torch.Tensor, draft_ids: torch.Tensor, step_weight: float
                 ) -> tuple[torch.Tensor, list[float], list[float]]:
    """Distillation loss of the training-time test, with per-step accuracy.

    Row j of step s is scored against the target's distribution at position j + 1 restricted to the
    draft vocabulary (softmax over its logits at the draft ids): cross-entropy
    −Σ p_target · log p_drafter. Rows count where ``j ≥ s − 1`` and ``j + 1 < length`` of their
    sequence. Step s has weight ``step_weight ** (s − 1)``.

    Args:
        step_logits: per step [B, R, draft_vocab] (R = T − 1).
        teacher_draft_logits: [B, T, draft_vocab] float32, the target's logits at the draft ids.
        teacher_greedy: int64 [B, T], the target's argmax over the full vocabulary.
        lengths: int64 [B], real tokens per (right-padded) sequence.
        draft_ids: int64 [draft_vocab], target id of each draft id.

    Returns:
        (weighted mean loss, per-step mean cross-entropy (nats), per-step accuracy: fraction of rows
        whose drafter argmax maps to the target's greedy token).
    """
    B, R, _ = step_logits[0].shape
    soft = teacher_draft_logits[:, 1:R + 1].softmax(-1)
    greedy = teacher_greedy[:, 1:R + 1]
    rows = torch.arange(R, device=lengths.device)
    total, wsum, losses, accs = 0.0, 0.0, [], []
    for s, logits in enumerate(step_logits, start=1):
        valid = (rows[None, :] >= s - 1) & (rows[None, :] + 1 < lengths[:, None])
        n = valid.sum().clamp_min(1)
        ce = -(soft * logits.log_softmax(-1)).sum(-1)
        loss = (ce * valid).sum() / n
        hit = (draft_ids[logits.argmax(-1)] == greedy) & valid
        w = step_weight ** (s - 1)
        total = total + w * loss
        wsum += w
        losses.append(float(loss.detach()))
        accs.append(float(hit.sum() / n))
    return total / wsum, losses, accs


def train_drafter(drafter: Eagle3Trainable, teacher: TeacherData, draft_ids: torch.Tensor, cfg: TrainConfig,
                  progress: bool = True) -> dict[str, Any]:
    """Train the drafter for ``cfg.drafter_steps`` steps of the training-time test.

    Each step takes ``cfg.drafter_batch_size`` sequences of ``teacher`` (a seeded permutation per
    epoch), runs :meth:`Eagle3Trainable.forward` over ``cfg.ttt_steps`` steps and
    :func:`drafter_loss`; AdamW with warm-up and cosine decay, gradient clipping.

    Returns:
        History: ``loss`` (weighted, per step), ``step_loss`` / ``step_acc`` (per training step, a list
        over draft steps), ``seconds``.
    """
    device = drafter.embed.device
    opt = adamw(list(drafter.named_parameters()), cfg.drafter_lr, cfg.weight_decay)
    ids = draft_ids.to(device)
    hist: dict[str, Any] = {"loss": [], "step_loss": [], "step_acc": []}
    n, B = len(teacher.tokens), cfg.drafter_batch_size
    if n < B:
        raise ConfigError(f"{n} drafter training sequences, fewer than drafter_batch_size = {B}")
    per_epoch = n // B
    t0 = time.perf_counter()
    bar = progress_bar(cfg.drafter_steps, "drafter", progress)
    drafter.train()
    perm = None
    try:
        for step in range(cfg.drafter_steps):
            epoch, j = divmod(step, per_epoch)
            if j == 0 or perm is None:
                perm = np.random.default_rng([cfg.seed, 3, epoch]).permutation(n)
            lr = lr_at(step, cfg.drafter_steps, cfg.drafter_lr, cfg.drafter_warmup)
            for g in opt.param_groups:
                g["lr"] = lr
            tokens, aux, tlogits, greedy, lengths = teacher.batch([int(i) for i in perm[j * B:(j + 1) * B]], device)
            step_logits = drafter(tokens, aux, cfg.ttt_steps)
            loss, losses, accs = drafter_loss(step_logits, tlogits, greedy, lengths, ids, cfg.ttt_step_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip, foreach=False)
            opt.step()
            opt.zero_grad(set_to_none=True)
            hist["loss"].append(float(loss.detach()))
            hist["step_loss"].append(losses)
            hist["step_acc"].append(accs)
            bar.update(1)
            bar.set_postfix(loss=f"{hist['loss'][-1]:.3f}", acc1=f"{accs[0]:.2f}", accK=f"{accs[-1]:.2f}")
            if progress and ((step + 1) % cfg.log_every == 0 or step + 1 == cfg.drafter_steps):
                w = slice(-cfg.log_every, None)
                acc = np.mean(hist["step_acc"][w], axis=0)
                bar.write(f"  drafter step {step + 1:5d}/{cfg.drafter_steps}  loss {np.mean(hist['loss'][w]):.3f}  "
                          f"accuracy by draft step " + " ".join(f"{a:.2f}" for a in acc))
    finally:
        bar.close()
    drafter.eval()
    hist["seconds"] = time.perf_counter() - t0
    return hist
