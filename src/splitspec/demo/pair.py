"""Train the demo pair: a small Kimi-K2-architecture target and its EAGLE-3 drafter, deterministically.

Pipeline (:func:`train_pair`), everything seeded from :attr:`TrainConfig.seed`:

1. **Corpus.** The Python standard library's ``.py`` sources (:func:`corpus_split`), minus the codec
   tables under ``encodings/``; every ``heldout_every``-th file is held out for the held-out loss and
   the acceptance report. Chat-style samples are built from the training files' documented functions
   (:func:`chat_samples`): "write a function that <docstring>" → the function's code, and "what does
   <function> do?" → its docstring, rendered with the Kimi-style chat template.
2. **Target.** transformers' ``DeepseekV3ForCausalLM`` (the independent reference implementation of
   the architecture) is trained with next-token cross-entropy on windows of the token stream. The
   ``noaux_tc`` router's ``e_score_correction_bias`` is trained with DeepSeek-V3's auxiliary-loss-free
   balancing rule (DeepSeek-V3 technical report, arXiv:2412.19437, §2.1.2): after every step,
   ``b_e += γ · sign(mean load − load_e)`` per MoE layer, loads counted over the step's tokens.
   The result is rounded to bf16, the published dtype, and that rounded model is used from then on.
3. **Self-distillation data.** The rounded target continues code windows and chat questions greedily;
   the drafter learns on these sequences (what speculation sees) plus plain corpus windows.
4. **Drafter.** An EAGLE-3 drafter (Li et al. 2025, arXiv:2503.01840) over the target's aux hidden
   states (inputs to layers ``aux_layer_ids``) with a reduced draft vocabulary (most frequent tokens),
   trained by distillation (cross-entropy against the target's softmax restricted to the draft
   vocabulary) with EAGLE-3's *training-time test* over ``ttt_steps`` steps: see
   :class:`Eagle3Trainable` and :func:`ttt_attention_mask`.
5. **Export and report.** Both are written in the published Hugging Face formats (``demo.py``), the
   acceptance by draft position is measured with the real engines (convert → build →
   :class:`splitspec.runtime.scheduler.SpeculativeEngine`) on held-out prompts, and PNGs of the loss curves and of
   acceptance by position are saved next to the models.

Results are cached by content hash (:func:`cache_key`: training code, config, seed, corpus contents,
library versions) under ``$SPLITSPEC_CACHE`` (default ``~/.cache/splitspec``) as ``demo-<hash>/``
(:func:`ensure_trained_pair`), so a machine trains once.

Indexing (as in :mod:`splitspec.runtime.scheduler`): drafter row j pairs the target's aux state at position j
with token j+1 at rotary position j and predicts token j+2; its teacher is the target's logits at
position j+1.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import textwrap
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitspec.errors import ConfigError
from splitspec.files import replace_dir

CACHE_ENV = "SPLITSPEC_CACHE"
TRAINING_INFO = "training.json"
LOSS_PNG = "training_loss.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"
EXCLUDED_CORPUS_DIRS = ("encodings",)  # codec tables: hundreds of KB of "'\x00' # 0x00 -> NULL" lines
# Files whose code defines the trained pair: a change to any of them gives a new cache key.
_CODE_FILES = ("demo/pair.py", "demo/checkpoints.py", "runtime/tokenizer.py")


def _log(msg: str) -> None:
    print(f"[demo-models] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained pair (all of it enters the cache key).

    Sizes are Kimi-K2's structure at toy width; step counts and batch sizes are set so that the
    whole pipeline takes about 10 minutes on a 2-core CPU (:meth:`preset`). Token counts are in
    tokens of the 4096-entry BPE vocabulary; learning rates are AdamW peak rates.
    """

    seed: int = 0
    device: str = "cpu"
    num_threads: int = 2  # fixed torch intra-op threads: results depend on the reduction split
    # --- target (overrides onto demo.target_config) ---
    hidden_size: int = 256
    num_hidden_layers: int = 5
    intermediate_size: int = 768
    moe_intermediate_size: int = 128
    num_attention_heads: int = 8
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    q_lora_rank: int = 96
    kv_lora_rank: int = 64
    # --- drafter (overrides onto demo.drafter_config) ---
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

        ``cpu``: the 10.3M-parameter demo target (5 layers, hidden 256, 16 experts) for about 10
        minutes on 2 idle cores. ``cuda``: a larger pair (8 layers, hidden 384, 32 experts, about 56M
        parameters; 8M training tokens, 2.7k self-distillation sequences) meant to take under 10
        minutes on one data-centre GPU.

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
    from splitspec.demo.checkpoints import target_config

    c = target_config(bos_id, eos_id, pad_id)
    c.update(hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
             intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.moe_intermediate_size,
             num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
             n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
             q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank)
    return c


def trained_drafter_config(cfg: TrainConfig, bos_id: int, eos_id: int) -> dict[str, Any]:
    """The trained drafter's ``config.json``: :func:`splitspec.demo.checkpoints.drafter_config` at ``cfg``'s sizes."""
    from splitspec.demo.checkpoints import drafter_config

    c = drafter_config(bos_id, eos_id)
    heads = cfg.num_attention_heads
    c.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.drafter_intermediate_size,
             num_attention_heads=heads, num_key_value_heads=heads, head_dim=cfg.hidden_size // heads,
             draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.hidden_size)
    c["eagle_config"] = dict(c["eagle_config"], eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
                             aux_layer_id_convention="input")
    return c


def _check_config(cfg: TrainConfig) -> None:
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


# --------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


@dataclass
class CorpusSplit:
    """Standard-library sources as (path relative to the stdlib folder, text), split by file."""

    train: list[tuple[str, str]]
    heldout: list[tuple[str, str]]


def corpus_split(heldout_every: int = 40, max_files: int | None = None) -> CorpusSplit:
    """Read the training corpus and split it into training and held-out files.

    Files come from :func:`splitspec.runtime.tokenizer.stdlib_source_files` (sorted, tests excluded), minus
    those under :data:`EXCLUDED_CORPUS_DIRS`; file i (in that order) is held out when
    ``i % heldout_every == heldout_every // 2``.

    Args:
        heldout_every: one file in this many is held out.
        max_files: keep only the first ``max_files`` files (tests); None keeps all.

    Raises:
        ConfigError: no readable source file.
    """
    import sysconfig

    from splitspec.runtime.tokenizer import stdlib_source_files

    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, str]] = []
    for path in stdlib_source_files():
        rel = path.relative_to(root).as_posix()
        if rel.split("/")[0] in EXCLUDED_CORPUS_DIRS:
            continue
        try:
            text = path.read_bytes().decode("utf-8", errors="ignore")
        except OSError:
            continue
        if text.strip():
            files.append((rel, text))
        if max_files is not None and len(files) >= max_files:
            break
    if not files:
        raise ConfigError(f"no readable .py file under the standard library folder {root}")
    split = CorpusSplit([], [])
    for i, item in enumerate(files):
        (split.heldout if i % heldout_every == heldout_every // 2 else split.train).append(item)
    if not split.train:
        raise ConfigError("the corpus split left no training file")
    return split


def corpus_fingerprint(split: CorpusSplit) -> str:
    """sha256 over every file's role, relative path and contents (part of the cache key)."""
    h = hashlib.sha256()
    for role, files in (("train", split.train), ("heldout", split.heldout)):
        for rel, text in files:
            h.update(f"{role}\0{rel}\0{len(text)}\0".encode())
            h.update(text.encode("utf-8"))
    return h.hexdigest()


_CODE_ASKS = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "{doc}\n\nImplement this in Python as `{sig}`.",
    "How would I write `{name}` in Python? It should work like this: {doc}",
    "Can you show me a Python implementation of `{sig}`? {doc}",
)
_EXPLAIN_ASKS = (
    "What does `{qual}` in the `{module}` module do?",
    "Explain what the Python function `{qual}` from `{module}` is for.",
    "I found `{qual}` in `{module}`. What is it used for?",
)


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def chat_samples(files: list[tuple[str, str]]) -> list[list[dict[str, str]]]:
    """Chat conversations built from the documented public functions of ``files``.

    For a function with a docstring: one of "write a function `sig` that <first docstring
    paragraph>" → "```python\\n<the function's source>\\n```", or "what does `module.qualname` do?"
    → the docstring (chosen by a CRC of the name, so the result is deterministic).

    Returns:
        Lists of ``{"role": "user"|"assistant", "content": str}`` messages, in file order.
    """
    out: list[list[dict[str, str]]] = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        lines = text.splitlines(keepends=True)  # (ast.get_source_segment re-splits the file on every call)
        stack: list[tuple[ast.AST, str]] = [(tree, "")]
        while stack:
            node, prefix = stack.pop(0)
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef) and not prefix:
                    stack.append((child, child.name + "."))
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or child.name.startswith("_"):
                    continue
                doc = ast.get_docstring(child, clean=True)
                if not doc:
                    continue
                para = _first_paragraph(doc)
                if not 20 <= len(para) <= 400:
                    continue
                qual = prefix + child.name
                crc = zlib.crc32(f"{module}.{qual}".encode())
                try:
                    sig = f"{child.name}({ast.unparse(child.args)})"
                except Exception:  # pragma: no cover - unparse failure on odd syntax
                    continue
                if crc % 3 == 0:
                    answer = doc.strip()
                    if len(answer) > 800:
                        answer = answer[:800].rsplit("\n\n", 1)[0].strip()
                    ask = _EXPLAIN_ASKS[(crc // 3) % len(_EXPLAIN_ASKS)].format(qual=qual, module=module)
                else:
                    src = "".join(lines[child.lineno - 1:child.end_lineno or child.lineno])
                    if len(src) > 1500 or src.count("\n") < 3:
                        continue
                    code = textwrap.dedent(src).rstrip("\n")
                    answer = f"```python\n{code}\n```"
                    ask = _CODE_ASKS[(crc // 3) % len(_CODE_ASKS)].format(sig=sig, name=child.name, doc=para)
                out.append([{"role": "user", "content": ask}, {"role": "assistant", "content": answer}])
    return out


def build_token_stream(tok: Any, split: CorpusSplit, cfg: TrainConfig) -> tuple[np.ndarray, list[list[int]]]:
    """Encode the training corpus into one token stream.

    Documents (whole source files, and chat samples rendered with the chat template, up to
    ``cfg.chat_fraction`` of the tokens) are shuffled with ``cfg.seed`` and concatenated, each
    followed by ``[EOS]``.

    Returns:
        (stream: int64 [N], chat prompts: token ids of each chat sample's conversation up to and
        including the assistant header, in shuffled order; used for self-distillation).
    """
    rng = np.random.default_rng([cfg.seed, 1])
    code_ids = [e.ids for e in tok._tok.encode_batch([t for _, t in split.train], add_special_tokens=False)]
    n_code = sum(len(x) for x in code_ids)
    chats = chat_samples(split.train)
    order = rng.permutation(len(chats))
    chats = [chats[i] for i in order]
    rendered = [tok.apply_chat_template(c, add_generation_prompt=False) for c in chats]
    chat_ids = [e.ids for e in tok._tok.encode_batch(rendered, add_special_tokens=False)] if rendered else []
    budget = cfg.chat_fraction / (1.0 - cfg.chat_fraction) * n_code
    used, n_chat = 0, 0
    while used < len(chat_ids) and n_chat < budget:
        n_chat += len(chat_ids[used]) + 1
        used += 1
    prompts = [tok.encode(tok.apply_chat_template(c[:1], add_generation_prompt=True)) for c in chats[used:]]
    prompts += [tok.encode(tok.apply_chat_template(c[:1], add_generation_prompt=True)) for c in chats[:used]]
    docs = code_ids + chat_ids[:used]
    eos = tok.eos_token_id
    parts = [np.asarray(docs[i] + [eos], dtype=np.int64) for i in rng.permutation(len(docs))]
    return np.concatenate(parts), prompts


class WindowSampler:
    """Batches of windows [B, seq_len + 1] cut from a token stream, in a seeded order.

    Epoch e cuts the stream at a random offset into non-overlapping windows and visits them in a
    random permutation (numpy ``default_rng([seed, e])``); batch i is a pure function of (seed, i).
    """

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.stream, self.L, self.B, self.seed = stream, seq_len + 1, batch_size, seed
        if len(stream) < self.L * (batch_size + 1):
            raise ConfigError(f"token stream of {len(stream)} tokens is too short for batches of "
                              f"{batch_size} × {seq_len + 1}")
        self._epoch, self._starts = -1, np.empty(0, dtype=np.int64)

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 2, epoch])
        offset = int(rng.integers(self.L))
        n = (len(self.stream) - offset) // self.L
        starts = offset + self.L * np.arange(n, dtype=np.int64)
        return starts[rng.permutation(n)][: (n // self.B) * self.B]

    def batch(self, i: int) -> torch.Tensor:
        """Batch ``i``: int64 [B, seq_len + 1]."""
        per_epoch = len(self._epoch_starts(0)) // self.B
        epoch, j = divmod(i, per_epoch)
        if epoch != self._epoch:
            self._epoch, self._starts = epoch, self._epoch_starts(epoch)
        starts = self._starts[j * self.B:(j + 1) * self.B]
        return torch.from_numpy(np.stack([self.stream[s:s + self.L] for s in starts]))


# --------------------------------------------------------------------------------------------
# Target (transformers' DeepseekV3ForCausalLM)
# --------------------------------------------------------------------------------------------


def build_target(config: dict[str, Any], seed: int, device: str | torch.device = "cpu") -> Any:
    """A freshly initialised ``DeepseekV3ForCausalLM`` for the Kimi-K2 ``config`` (float32, train mode).

    ``model_type`` is set to ``deepseek_v3`` as in :func:`splitspec.demo.checkpoints.load_hf_reference_target`.
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


def _lr_at(step: int, steps: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``floor · peak`` at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _adamw(params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (β = 0.9, 0.95) with weight decay on matrices only (not norms, not the embedding)."""
    decay = [p for n, p in params if p.requires_grad and p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in params if p.requires_grad and not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", disable=not enabled, dynamic_ncols=True, leave=True, file=sys.stdout)


def train_target(model: Any, sampler: WindowSampler, cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train the target with next-token cross-entropy for ``cfg.target_steps`` steps.

    Each step: one batch [target_batch_size, target_seq_len + 1] from ``sampler``, AdamW with warm-up
    and cosine decay, gradient clipping at ``cfg.grad_clip``, then the router-bias update
    (:class:`RouterBalancer`).

    Returns:
        History: ``loss`` (nats/token per step), ``imbalance`` (max/mean expert load per step), ``seconds``.
    """
    device = next(model.parameters()).device
    opt = _adamw(list(model.named_parameters()), cfg.target_lr, cfg.weight_decay)
    balancer = RouterBalancer(model, cfg.bias_update_speed)
    hist: dict[str, Any] = {"loss": [], "imbalance": []}
    t0 = time.perf_counter()
    bar = _progress(cfg.target_steps, "target", progress)
    model.train()
    try:
        for step in range(cfg.target_steps):
            lr = _lr_at(step, cfg.target_steps, cfg.target_lr, cfg.target_warmup)
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

    Each text is encoded on its own and cut into windows of ``seq_len + 1`` tokens (a last partial
    window counts if it has at least 2 tokens); at most ``max_windows`` windows, taken in order and
    scored in right-padded batches of ``batch_size``.
    """
    device = next(model.parameters()).device
    windows: list[list[int]] = []
    for ids in (e.ids for e in tok._tok.encode_batch(texts, add_special_tokens=False)):
        windows += [ids[s:s + seq_len + 1] for s in range(0, len(ids) - 1, seq_len + 1) if len(ids[s:s + seq_len + 1]) >= 2]
    windows = windows[:max_windows]
    total, count = 0.0, 0
    for b in range(0, len(windows), batch_size):
        x, lengths = _pad_batch(windows[b:b + batch_size], 0)
        x = x.to(device)
        labels = x[:, 1:].clone()
        labels[torch.arange(labels.shape[1], device=device)[None, :] + 1 >= lengths.to(device)[:, None]] = -100
        logits = model(input_ids=x[:, :-1], use_cache=False).logits.float()
        total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
    return total / max(count, 1)


# --------------------------------------------------------------------------------------------
# Self-distillation data
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# EAGLE-3 drafter with the training-time test
# --------------------------------------------------------------------------------------------


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
        from splitspec.config import DrafterConfig
        from splitspec.models.layers import Rotary

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
        from splitspec.models.layers import rms_norm

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
        tokens, lengths = _pad_batch([sequences[i] for i in idx], pad_id)
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


def _pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad ``seqs`` → (tokens int64 [B, max len], lengths int64 [B])."""
    width = max(len(s) for s in seqs)
    x = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    for r, s in enumerate(seqs):
        x[r, :len(s)] = torch.tensor(s, dtype=torch.int64)
    return x, torch.tensor([len(s) for s in seqs], dtype=torch.int64)


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
    opt = _adamw(list(drafter.named_parameters()), cfg.drafter_lr, cfg.weight_decay)
    ids = draft_ids.to(device)
    hist: dict[str, Any] = {"loss": [], "step_loss": [], "step_acc": []}
    n, B = len(teacher.tokens), cfg.drafter_batch_size
    if n < B:
        raise ConfigError(f"{n} drafter training sequences, fewer than drafter_batch_size = {B}")
    per_epoch = n // B
    t0 = time.perf_counter()
    bar = _progress(cfg.drafter_steps, "drafter", progress)
    drafter.train()
    perm = None
    try:
        for step in range(cfg.drafter_steps):
            epoch, j = divmod(step, per_epoch)
            if j == 0 or perm is None:
                perm = np.random.default_rng([cfg.seed, 3, epoch]).permutation(n)
            lr = _lr_at(step, cfg.drafter_steps, cfg.drafter_lr, cfg.drafter_warmup)
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


# --------------------------------------------------------------------------------------------
# Measuring speculation with the real engines
# --------------------------------------------------------------------------------------------


def build_demo_engines(models_dir: Path, out_dir: Path, tp_size: int = 1, max_seq_len: int = 1024) -> Path:
    """convert + build ``models_dir/{target,drafter}`` into ``out_dir/engines`` (float32); returns that folder."""
    import io

    from splitspec.build.engines import build_engines
    from splitspec.convert.pair import convert_pair

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        convert_pair(models_dir / "target", models_dir / "drafter", out_dir / "ckpt", tp_size=tp_size)
        return build_engines(out_dir / "ckpt", out_dir / "engines", max_batch_size=1, max_seq_len=max_seq_len)


def speculative_acceptance(engines_dir: Path, prompts: list[list[int]], max_tokens: int, k: int,
                           stop_ids: list[int], target_device_ids: list[int] | None = None,
                           check_lossless: bool = True, progress: bool = True) -> dict[str, Any]:
    """Greedy speculative decoding of every prompt with ``k`` draft tokens (one sequence at a time).

    Returns:
        ``acceptance_length`` (tokens emitted per target verify forward, over all cycles of all
        prompts; 1.0 = no gain), ``per_position`` (fraction of cycles whose draft i+1 was accepted,
        i = 0..k−1), ``cycles``, ``per_prompt`` (acceptance length, cycles, tokens, accepted per
        position, wall seconds with and without speculation), ``outputs`` (generated token ids),
        ``spec_seconds`` / ``target_only_seconds`` (total wall time), ``lossless`` (True when every
        output was checked equal to target-only greedy decoding, None when not checked).

    Raises:
        SplitspecError: a speculative output differs from target-only greedy decoding.
    """
    from tqdm import tqdm

    from splitspec.errors import SplitspecError
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.settings import ServeConfig

    cycles, emitted, accepted = 0, 0, [0] * k
    per_prompt, outputs = [], []
    spec_s = ref_s = 0.0
    with SpeculativeEngine.load(ServeConfig.from_env(engines_dir=engines_dir, target_device_ids=target_device_ids or (),
                                                     num_draft_tokens=k)) as eng:
        for ids in tqdm(prompts, desc=f"speculative decoding (k={k})", unit="prompt", disable=not progress,
                        dynamic_ncols=True, file=sys.stdout):
            t = time.perf_counter()
            res = eng.generate(ids, max_tokens, num_draft_tokens=k, stop_token_ids=set(stop_ids))
            dt = time.perf_counter() - t
            spec_s += dt
            ref_dt = None
            if check_lossless:
                t = time.perf_counter()
                ref = eng.generate(ids, max_tokens, num_draft_tokens=0, stop_token_ids=set(stop_ids))
                ref_dt = time.perf_counter() - t
                ref_s += ref_dt
                if ref.token_ids != res.token_ids:
                    raise SplitspecError("speculative output differs from target-only greedy decoding "
                                         f"(prompt of {len(ids)} tokens)")
            cycles += res.num_cycles
            emitted += round(res.acceptance_length * res.num_cycles)
            accepted = [a + b for a, b in zip(accepted, res.accepted_per_position)]
            per_prompt.append({"acceptance_length": res.acceptance_length, "cycles": res.num_cycles,
                               "tokens": len(res.token_ids), "accepted_per_position": res.accepted_per_position,
                               "spec_seconds": dt, "target_only_seconds": ref_dt})
            outputs.append(res.token_ids)
    return {"k": k, "acceptance_length": emitted / max(cycles, 1), "cycles": cycles,
            "per_position": [a / max(cycles, 1) for a in accepted], "per_prompt": per_prompt, "outputs": outputs,
            "spec_seconds": spec_s, "target_only_seconds": ref_s if check_lossless else None,
            "lossless": True if check_lossless else None}


def heldout_prompts(tok: Any, split: CorpusSplit, n: int, prompt_tokens: int = 48) -> list[list[int]]:
    """Prompts from the held-out files: half code (the last ``prompt_tokens`` tokens up to the ``:`` of
    a ``def`` line), half chat questions about their documented functions (chat template applied)."""
    code: list[list[int]] = []
    for rel, text in split.heldout:
        lines = text.splitlines(keepends=True)
        defs = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("def ") and ln.rstrip().endswith(":")]
        if not defs:
            continue
        i = defs[zlib.crc32(rel.encode()) % len(defs)]
        # End on the ':' of the def line, not after its newline: byte-level BPE merges a newline with
        # the next line's indentation, so a prompt ending in a bare "\n" is followed, in training
        # text, by an unindented line, and the model would start a new top-level statement.
        ids = tok.encode("".join(lines[:i + 1]).rstrip("\n"))
        if len(ids) >= prompt_tokens // 2:
            code.append(ids[-prompt_tokens:])
    chats = [tok.encode(tok.apply_chat_template(c[:1], add_generation_prompt=True)) for c in chat_samples(split.heldout)]
    n_code = min(len(code), n - min(len(chats), n // 2))
    return code[:n_code] + chats[:n - n_code]


# --------------------------------------------------------------------------------------------
# Plots and text curves
# --------------------------------------------------------------------------------------------


def _smooth(values: list[float], window: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    if len(v) == 0 or window <= 1:
        return v
    k = np.ones(min(window, len(v))) / min(window, len(v))
    return np.convolve(v, k, mode="valid")


def text_curve(values: list[float], width: int = 60, label: str = "") -> str:
    """A one-line sparkline of ``values`` (smoothed, resampled to ``width``) with first/last values."""
    v = _smooth(values, max(1, len(values) // width))
    if len(v) == 0:
        return f"{label}: (no data)"
    idx = np.linspace(0, len(v) - 1, min(width, len(v))).round().astype(int)
    v = v[idx]
    lo, hi = float(v.min()), float(v.max())
    bars = "▁▂▃▄▅▆▇█"
    line = "".join(bars[int((x - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for x in v)
    return f"{label:>16} {v[0]:7.3f} {line} {v[-1]:7.3f}"


def save_plots(report: dict[str, Any], folder: Path) -> list[str]:
    """Write :data:`LOSS_PNG` (target and drafter training loss) and :data:`ACCEPTANCE_PNG`
    (acceptance by draft position) into ``folder``. Returns the file names written (none, with a
    notice, when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib is not installed: skipping the PNG plots (pip install matplotlib)")
        return []
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    t = report["target"]
    w = max(1, len(t["loss"]) // 50)
    axes[0].plot(t["loss"], color="0.8", lw=0.8, label="per step")
    axes[0].plot(np.arange(len(_smooth(t["loss"], w))) + w - 1, _smooth(t["loss"], w), color="C0", label=f"mean of {w}")
    if t.get("heldout_loss") is not None:
        axes[0].axhline(t["heldout_loss"], color="C3", ls="--", label=f"held-out {t['heldout_loss']:.3f}")
    axes[0].set(title="target: next-token cross-entropy", xlabel="step", ylabel="nats / token")
    axes[0].legend()
    d = report["drafter"]
    for ax, key, title, ylabel in ((axes[1], "step_loss", "drafter: cross-entropy vs the target's distribution",
                                    "nats / token (≥ the target's entropy)"),
                                   (axes[2], "step_acc", "drafter: top-1 agreement with the target (training)",
                                    "fraction of rows")):
        v = np.asarray(d[key]) if d[key] else np.zeros((0, 1))
        w = max(1, len(v) // 50)
        for s in range(v.shape[1]):
            ax.plot(np.arange(len(_smooth(list(v[:, s]), w))) + w - 1, _smooth(list(v[:, s]), w), label=f"draft step {s + 1}")
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / LOSS_PNG, dpi=100)
    plt.close(fig)
    written.append(LOSS_PNG)
    acc = report.get("acceptance")
    if acc:
        fig, ax = plt.subplots(figsize=(6, 4))
        pos = np.arange(1, len(acc["per_position"]) + 1)
        ax.bar(pos, acc["per_position"], color="C2")
        for x, y in zip(pos, acc["per_position"]):
            ax.text(x, y + 0.01, f"{y:.2f}", ha="center")
        ax.set(ylim=(0, 1.05), xticks=pos, xlabel="draft position", ylabel="fraction of cycles accepted",
               title=f"{acc.get('prompts', '')} held-out prompts, k={acc['k']}: acceptance length {acc['acceptance_length']:.2f}")
        fig.tight_layout()
        fig.savefig(folder / ACCEPTANCE_PNG, dpi=100)
        plt.close(fig)
        written.append(ACCEPTANCE_PNG)
    return written


# --------------------------------------------------------------------------------------------
# The whole pipeline
# --------------------------------------------------------------------------------------------


_README = """\
# Demo models (trained)

Two small checkpoints trained on this machine from seed {seed} by `splitspec demo-models`
(`splitspec.demo.pair`, cache key `{key}`):

- `target/`: a Kimi-K2-format Hugging Face checkpoint (`model_type: kimi_k2`, architecture
  `DeepseekV3ForCausalLM`): {n_layers} layers of MLA attention with YaRN, the first dense and the rest
  Mixture-of-Experts ({n_experts} routed experts, {top_k} per token, one shared expert, `noaux_tc` sigmoid
  router whose `e_score_correction_bias` was trained with DeepSeek-V3's auxiliary-loss-free balancing rule);
  {target_params:,} parameters in bf16. Trained with transformers' `DeepseekV3ForCausalLM` for
  {target_steps} steps ({target_tokens:,} tokens) on the Python standard library's sources plus chat
  samples built from its docstrings, using the {vocab}-token BPE tokenizer and the Kimi-style chat template.
  Final training loss {target_loss:.3f} nats/token; held-out loss {heldout:.3f} nats/token
  ({n_heldout} held-out stdlib files).
- `drafter/`: an EAGLE-3 drafter (`LlamaForCausalLMEagle3`: one `midlayer`, `fc` over the target's inputs
  to layers {aux} (`aux_layer_id_convention: input`), {draft_vocab}-token draft vocabulary with `d2t`/`t2d`,
  no embedding; {drafter_params:,} parameters), distilled from the target's logits on {n_seqs} sequences
  (mostly the target's own greedy continuations) with EAGLE-3's training-time test over {ttt} steps,
  {drafter_steps} steps. Final loss {drafter_loss:.3f}.

Speculative decoding with the real engines on {n_prompts} held-out prompts, greedy, k = {k}:
mean acceptance length **{acc_len:.2f}** tokens per target forward; accepted by draft position
{per_pos}. Plots: `{loss_png}`, `{acc_png}`; full numbers: `{info}`.
"""


def train_pair(out_dir: Path, cfg: TrainConfig, progress: bool = True, measure: bool = True,
               key: str | None = None) -> dict[str, Any]:
    """Train the demo pair and write it to ``out_dir`` (built in a temporary sibling folder, then
    renamed into place; an existing ``out_dir`` is replaced only on success).

    Layout: ``target/`` and ``drafter/`` in the published formats (as :func:`splitspec.demo.checkpoints.make_demo_models`
    writes them), ``README.md``, :data:`TRAINING_INFO` (config, cache key, loss histories, held-out loss,
    acceptance, timings) and the PNGs :data:`LOSS_PNG` / :data:`ACCEPTANCE_PNG`.

    Args:
        out_dir: destination folder.
        cfg: what to train (:meth:`TrainConfig.preset` for the demo; small step counts for tests).
        progress: show tqdm bars and loss lines.
        measure: measure acceptance with the real engines on held-out prompts after training.
        key: cache key recorded in the report (default: :func:`cache_key` of ``cfg``).

    Returns:
        The report written to :data:`TRAINING_INFO`.

    Raises:
        ConfigError: an invalid configuration or an unavailable device.
    """
    from splitspec.files import default_permissions

    _check_config(cfg)
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"trained demo models output {out_dir} exists and is not a folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        with deterministic_mode(cfg):
            report = _train_into(tmp, cfg, progress, measure, key)
        default_permissions(tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _train_into(root: Path, cfg: TrainConfig, progress: bool, measure: bool, key: str | None) -> dict[str, Any]:
    """Body of :func:`train_pair`, writing into the (temporary) folder ``root``."""
    from splitspec.demo.checkpoints import VOCAB_SIZE, write_drafter_checkpoint, write_target_checkpoint
    from splitspec.runtime.tokenizer import (BOS_TOKEN, EOS_TOKEN, IM_END_TOKEN, PAD_TOKEN, ChatTokenizer,
                                     select_draft_vocab, train_tokenizer)

    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    timings: dict[str, float] = {}
    target_dir, drafter_dir = root / "target", root / "drafter"
    target_dir.mkdir()
    drafter_dir.mkdir()

    # ---- data
    t = time.perf_counter()
    _log(f"training byte-level BPE tokenizer ({VOCAB_SIZE} tokens) on the Python standard library sources")
    train_tokenizer(target_dir, vocab_size=VOCAB_SIZE)
    tok = ChatTokenizer.from_dir(target_dir)
    bos, eos, pad, im_end = (tok.token_to_id(x) for x in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_END_TOKEN))
    stop_ids = [eos, im_end]
    split = corpus_split(cfg.heldout_every, cfg.max_corpus_files)
    key = key or cache_key(cfg, split)
    stream, chat_prompts = build_token_stream(tok, split, cfg)
    timings["data_s"] = time.perf_counter() - t
    _log(f"corpus: {len(split.train)} training files + chat samples = {len(stream):,} tokens; "
         f"{len(split.heldout)} held-out files ({timings['data_s']:.1f} s)")

    # ---- target
    tcfg = trained_target_config(cfg, bos, eos, pad)
    model = build_target(tcfg, cfg.seed, device)
    n_tok = cfg.target_steps * cfg.target_batch_size * cfg.target_seq_len
    _log(f"training the target (transformers DeepseekV3ForCausalLM, {tcfg['num_hidden_layers']} layers, "
         f"{tcfg['n_routed_experts']} experts, {sum(p.numel() for p in model.parameters()):,} parameters) on {cfg.device}: "
         f"{cfg.target_steps} steps × {cfg.target_batch_size} × {cfg.target_seq_len} tokens = {n_tok:,} tokens")
    thist = train_target(model, WindowSampler(stream, cfg.target_seq_len, cfg.target_batch_size, cfg.seed), cfg, progress)
    timings["target_s"] = thist["seconds"]
    round_to_published(model)
    target_params = write_target_checkpoint(target_dir, tcfg, target_published_tensors(model), stop_ids)
    t = time.perf_counter()
    heldout = target_heldout_loss(model, tok, [x for _, x in split.heldout], cfg.target_seq_len)
    biases = [layer.mlp.gate.e_score_correction_bias.detach().cpu() for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    timings["heldout_s"] = time.perf_counter() - t
    _log(f"target: final training loss {np.mean(thist['loss'][-cfg.log_every:]):.3f}, held-out loss {heldout:.3f} "
         f"nats/token; correction bias range [{min(float(b.min()) for b in biases):+.3f}, "
         f"{max(float(b.max()) for b in biases):+.3f}] ({thist['seconds']:.0f} s)")

    # ---- draft vocabulary and self-distillation data
    t = time.perf_counter()
    counts = np.bincount(stream, minlength=tok.vocab_size)
    draft_ids = torch.from_numpy(select_draft_vocab(counts, cfg.draft_vocab_size, always_include=stop_ids))
    coverage = float(counts[draft_ids.numpy()].sum() / counts.sum())
    rng = np.random.default_rng([cfg.seed, 4])
    P = cfg.distill_prompt_tokens
    starts = rng.integers(0, len(stream) - P - 1, size=cfg.distill_code_prompts)
    prompts = [stream[s:s + P].tolist() for s in starts]
    prompts += [p for p in chat_prompts if len(p) <= 4 * P][: cfg.distill_chat_prompts]
    _log(f"self-distillation: greedy continuations ({cfg.distill_new_tokens} tokens) of {len(prompts)} prompts")
    sequences = greedy_continuations(model, prompts, cfg.distill_new_tokens, stop_ids, pad, cfg.generate_batch_size, progress)
    starts = rng.integers(0, len(stream) - P - cfg.distill_new_tokens, size=cfg.distill_corpus_windows)
    sequences += [stream[s:s + P + cfg.distill_new_tokens].tolist() for s in starts]
    timings["distill_data_s"] = time.perf_counter() - t
    _log(f"draft vocabulary: {cfg.draft_vocab_size} most frequent tokens cover {coverage:.1%} of the corpus; "
         f"{len(sequences)} drafter training sequences ({timings['distill_data_s']:.0f} s)")

    # ---- drafter
    dcfg = trained_drafter_config(cfg, bos, eos)
    drafter = Eagle3Trainable(dcfg, model.model.embed_tokens.weight.detach().cpu(), cfg.seed + 1,
                              lm_head_init=model.lm_head.weight.detach().cpu()[draft_ids]).to(device)
    _log(f"training the EAGLE-3 drafter (aux = inputs to target layers {list(cfg.aux_layer_ids)}, "
         f"training-time test over {cfg.ttt_steps} steps): {cfg.drafter_steps} steps × {cfg.drafter_batch_size} sequences")
    for p in model.parameters():
        p.requires_grad_(False)
    t = time.perf_counter()
    teacher = compute_teacher(model, sequences, tuple(cfg.aux_layer_ids), draft_ids, cfg.generate_batch_size // 4 or 1,
                              pad, progress)
    timings["teacher_s"] = time.perf_counter() - t
    dhist = train_drafter(drafter, teacher, draft_ids, cfg, progress)
    del teacher
    timings["drafter_s"] = dhist["seconds"]
    drafter_params = write_drafter_checkpoint(drafter_dir, dcfg, drafter.published_tensors(), draft_ids)

    report: dict[str, Any] = {
        "format": "splitspec-demo-training-v1", "key": key, "config": cfg.to_dict(),
        "versions": _versions(),
        "target": {"params": target_params, "tokens": n_tok, "loss": thist["loss"], "imbalance": thist["imbalance"],
                   "final_loss": float(np.mean(thist["loss"][-cfg.log_every:])), "heldout_loss": heldout,
                   "heldout_files": [r for r, _ in split.heldout],
                   "correction_bias": [[float(x) for x in b] for b in biases]},
        "drafter": {"params": drafter_params, "sequences": len(sequences), "loss": dhist["loss"],
                    "step_loss": dhist["step_loss"], "step_acc": dhist["step_acc"],
                    "final_loss": float(np.mean(dhist["loss"][-cfg.log_every:])),
                    "final_step_acc": [float(a) for a in np.mean(dhist["step_acc"][-cfg.log_every:], axis=0)],
                    "draft_vocab_coverage": coverage},
        "acceptance": None, "timings": timings,
    }

    # ---- acceptance with the real engines
    if measure:
        t = time.perf_counter()
        eval_prompts = heldout_prompts(tok, split, cfg.eval_prompts, cfg.distill_prompt_tokens)
        with tempfile.TemporaryDirectory(prefix="splitspec-engines-") as eng_tmp:
            engines = build_demo_engines(root, Path(eng_tmp))
            dev_ids = [device.index or 0] if device.type == "cuda" else None
            acc = speculative_acceptance(engines, eval_prompts, cfg.eval_new_tokens, cfg.eval_draft_tokens, stop_ids,
                                         dev_ids, check_lossless=True, progress=progress)
        acc["samples"] = [{"prompt": tok.decode(p, skip_special_tokens=False), "output": tok.decode(o, skip_special_tokens=False)}
                          for p, o in list(zip(eval_prompts, acc.pop("outputs")))[:3]]
        acc["prompts"] = len(eval_prompts)
        report["acceptance"] = acc
        timings["acceptance_s"] = time.perf_counter() - t
    timings["total_s"] = time.perf_counter() - t_start

    # ---- report
    (root / TRAINING_INFO).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    pngs = save_plots(report, root)
    acc = report["acceptance"] or {"k": cfg.eval_draft_tokens, "acceptance_length": float("nan"), "per_position": [], "prompts": 0}
    (root / "README.md").write_text(_README.format(
        seed=cfg.seed, key=key, n_layers=tcfg["num_hidden_layers"], n_experts=tcfg["n_routed_experts"],
        top_k=tcfg["num_experts_per_tok"], target_params=target_params, target_steps=cfg.target_steps,
        target_tokens=n_tok, vocab=VOCAB_SIZE, target_loss=report["target"]["final_loss"], heldout=heldout,
        n_heldout=len(split.heldout), aux=list(cfg.aux_layer_ids), draft_vocab=cfg.draft_vocab_size,
        drafter_params=drafter_params, n_seqs=len(sequences), ttt=cfg.ttt_steps, drafter_steps=cfg.drafter_steps,
        drafter_loss=report["drafter"]["final_loss"], n_prompts=acc["prompts"], k=acc["k"],
        acc_len=acc["acceptance_length"], per_pos=", ".join(f"{i + 1}: {a:.2f}" for i, a in enumerate(acc["per_position"])),
        loss_png=LOSS_PNG if LOSS_PNG in pngs else "(matplotlib missing)",
        acc_png=ACCEPTANCE_PNG if ACCEPTANCE_PNG in pngs else "(not measured)", info=TRAINING_INFO), encoding="utf-8")
    print_summary(report)
    return report


def print_summary(report: dict[str, Any]) -> None:
    """Print the loss curves (text sparklines), held-out loss, acceptance and timings of a report."""
    t, d, acc = report["target"], report["drafter"], report.get("acceptance")
    _log("loss curves (nats/token, first → last):")
    print(text_curve(t["loss"], label="target"), flush=True)
    print(text_curve(d["loss"], label="drafter (TTT)"), flush=True)
    sl = np.asarray(d["step_loss"])
    for s in range(sl.shape[1] if sl.ndim == 2 else 0):
        print(text_curve(list(sl[:, s]), label=f"  draft step {s + 1}"), flush=True)
    _log(f"target: final loss {t['final_loss']:.3f}, held-out loss {t['heldout_loss']:.3f}; drafter: final loss "
         f"{d['final_loss']:.3f}, training accuracy by draft step " + " ".join(f"{a:.2f}" for a in d["final_step_acc"]))
    if acc:
        _log(f"speculative decoding on {acc['prompts']} held-out prompts, k={acc['k']}: mean acceptance length "
             f"{acc['acceptance_length']:.2f}; accepted by position " + " ".join(f"{a:.2f}" for a in acc["per_position"]))
    _log("timings: " + ", ".join(f"{k[:-2]} {v:.0f} s" for k, v in report["timings"].items()))


def _versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "numpy": np.__version__}


# --------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$SPLITSPEC_CACHE`` if set, else ``~/.cache/splitspec``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "splitspec"


def cache_key(cfg: TrainConfig, split: CorpusSplit | None = None) -> str:
    """Content hash of everything that determines the trained pair: the training code
    (:data:`_CODE_FILES`), ``cfg`` (seed included), the corpus files and contents, and the versions of
    Python, torch, transformers, tokenizers and numpy. 16 hex digits."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parents[1]
    for name in _CODE_FILES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    h.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    split = split or corpus_split(cfg.heldout_every, cfg.max_corpus_files)
    h.update(corpus_fingerprint(split).encode())
    h.update(json.dumps(_versions(), sort_keys=True).encode())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (so two processes do not train the same entry at once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_trained_pair(cfg: TrainConfig, cache_dir: Path | None = None, retrain: bool = False,
                        progress: bool = True) -> Path:
    """Return the cache folder ``demo-<key>`` holding the pair trained with ``cfg``, training it first
    when it is missing (or when ``retrain``).

    Args:
        cfg: the training configuration.
        cache_dir: cache root (default :func:`cache_root`).
        retrain: train again even when the entry exists.
        progress: show progress while training.

    Raises:
        ConfigError: invalid configuration or unavailable device.
    """
    _check_config(cfg)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    key = cache_key(cfg)
    entry = root / f"demo-{key}"
    with _file_lock(root / f".demo-{key}.lock"):
        if (entry / TRAINING_INFO).is_file() and not retrain:
            _log(f"using the trained demo pair cached in {entry}")
            return entry
        _log(f"training the demo pair (cache key {key}) into {entry}")
        train_pair(entry, cfg, progress=progress, key=key)
    return entry


def install_trained_pair(entry: Path, out_dir: Path) -> bool:
    """Copy a cached pair (``entry``) to ``out_dir`` (atomically). Returns False when ``out_dir``
    already holds the same pair (same cache key), True when it was copied."""
    from splitspec.files import default_permissions

    entry, out_dir = Path(entry), Path(out_dir).absolute()
    want = json.loads((entry / TRAINING_INFO).read_text())["key"]
    try:
        have = json.loads((out_dir / TRAINING_INFO).read_text()).get("key")
    except (OSError, ValueError):
        have = None
    if have == want and (out_dir / "target" / "config.json").is_file() and (out_dir / "drafter" / "config.json").is_file():
        return False
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"demo models output {out_dir} exists and is not a folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.rmdir(tmp)
        shutil.copytree(entry, tmp)
        default_permissions(tmp)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True
