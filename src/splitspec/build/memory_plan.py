"""The memory plan: bytes per GPU, by kind, of a deployment of a target (TP-N, routed experts EP-E) and its
EAGLE-3 drafter (TP1 on GPU 0, beside target rank 0, or sharded over the target's GPUs), checked against a
per-GPU budget. ``splitspec plan`` prints it; ``splitspec build`` refuses engines that do not fit.

Per GPU g (target rank g):

- **weights**: :mod:`splitspec.build.weight_bytes` (exact for engine formats; tested against built rank files).
- **KV cache** (exact; :mod:`splitspec.models.kv`, :class:`splitspec.engine.rank.RankRunner`): a token budget
  ``kv_tokens`` (default max_batch_size × max_seq_len) in blocks of 16, plus one scratch block: rows =
  (ceil(kv_tokens / 16) + 1) · 16. Target (:class:`splitspec.models.target.TargetKVCache`, every rank): layers ×
  rows × (kv_lora_rank + qk_rope_head_dim) × activation bytes — the MLA latent, replicated. Drafter
  (:class:`splitspec.models.drafter.DrafterKVCache`, on the GPU hosting it): 2 (K, V) × rows ×
  num_key_value_heads / draft_tp × head_dim × activation bytes.
- **CUDA-graph pool** (estimate; :class:`splitspec.engine.graphs.GraphCache`, one pool per device shared by its
  graphs, so it holds the largest graph's intermediates plus every graph's outputs): steady cycles at the batch
  bucket Bp ≥ max_batch_size, n = max_draft_len + 1 tokens per sequence (1 without a drafter) and the key window S = max_seq_len
  rounded to blocks. Target verify: window gather Bp·S·(kv_lora + rope), scores Bp·(heads/N)·n·S in float32
  (twice) and in the activation dtype, the MoE's grouped GEMM buffers T·top_k·(2H + 3·I_e/moe_tp) when T = Bp·n
  is above the fused kernels' 16 tokens (FP8- and INT4-kept experts on a GPU instead the W8A16 / W4A16 grouped
  kernels' T·top_k·(2·I_e/moe_tp + 4H) + 8·T·H; on a CPU FP8 adds its per-call dequantisation, 12 bytes per element
  of the stacked w13, and INT4 the per-call dequantisation of the chosen experts, up to min(E_local, T·top_k), 16 at
  a time: one chunk's weights in the activation dtype and float32 work), residual stream 6·T·H, captured aux 2·T·3H
  and the gathered logits 2·T·V float32.
  Drafter: its K and V window gathers 2·Bp·S·(kv_heads/draft_tp)·head_dim, scores Bp·(heads/draft_tp)·n·S (an FP8
  drafter's linears run in FP8 there, :mod:`splitspec.models.fp8_linear`: no dequantised copy).
  Outputs kept per graph: logits b·n·V float32 and aux b·n·3H for each bucket b ≤ Bp, window (powers of two
  from 256 up to S) and k ≤ max_draft_len (n = k + 1: a steady batch of every sequence at one k captures graphs of
  its own, whichever k the requests ask for); on a GPU that drafts, one more b·n·3H per bucket and k where the
  verify leaves its aux states for the draft (:meth:`splitspec.engine.rank.RankRunner.handoff`). With draft-ahead
  (``Deployment.draft_ahead``, a TP1 drafter; :mod:`splitspec.engine.draft_ahead`) its graphs' own pool on GPU 0:
  one more draft's intermediates (they read the verify's aux states in place, the drafter beside target rank 0;
  their other inputs and outputs are a few int64 per sequence).
- **activations** (estimate; eager forwards, memory the caching allocator keeps): the larger of a prefill forward
  (max_prefill_tokens chunk + max_batch_size·n decode tokens: per-sequence attention over max_seq_len keys with
  float32 scores, :func:`splitspec.models.layers.attend`, and the MoE buffers as above) and the drafter's first
  extend after a prefill, which runs over the whole prompt at once: scores heads/draft_tp × L × L float32, twice
  (:meth:`splitspec.models.drafter.DrafterModel._attend_segments`; an FP8 drafter in a CPU engine: plus its largest
  linear dequantised per call), plus the aux states kept for it:
  (2·L + max_batch_size·n) · 3H on each GPU that drafts. On GPU 0 at least the leader's sampled decisions'
  temporaries (:data:`splitspec.models.batch.SAMPLING_BYTES`: their logits are filtered in bounded chunks
  after a steady verify, when no eager forward runs, so in the same cached memory).
- **headroom**: CUDA context, cuBLAS and NCCL workspaces (``headroom_bytes``, default 2 GiB) plus 5 % of the rest
  for the caching allocator's fragmentation.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from splitspec import quant
from splitspec.config import Mapping, TargetConfig
from splitspec.drafter_config import DrafterConfig
from splitspec.errors import ConfigError
from splitspec.models.batch import SAMPLING_BYTES, bucket, buckets_upto
from splitspec.models.drafters import drafter_cache
from splitspec.build.weight_bytes import (DRAFTER_KINDS, FLOAT_BYTES, KINDS, Storage, WeightFormat, drafter_bytes,
                                          drafter_rank_weights, target_rank_bytes)

GIB = 2 ** 30
BLOCK_SIZE = 16  # splitspec.models.kv.BLOCK_SIZE, checked equal in the tests
FUSED_MOE_MAX_TOKENS = 16  # splitspec.models.fused_moe.MAX_TOKENS, likewise
#: Largest deployment limits planned and built (splitspec build refuses beyond them too).
LIMITS = {"max_batch_size": 1 << 16, "max_seq_len": 1 << 30, "max_draft_len": 64}
INT4_CHUNK = 16  # splitspec.models.int4_routed.CHUNK, likewise
FRAGMENTATION = 0.05
FP8_DEQUANT_BYTES = 12  # per element of an FP8 linear while quant.linear dequantises it (float32 weight, scales, product): CPU engines
GROUPS = ("weights", "drafter", "kv", "graphs", "activations", "headroom")


class MemoryPlanError(ConfigError):
    """A deployment does not fit its GPUs' memory."""


@dataclass(frozen=True)
class Deployment:
    """What the plan is for. ``budget_bytes`` None: no check. ``draft_tp`` 1 (drafter on GPU 0) or ``tp``."""

    tp: int
    max_batch_size: int
    max_seq_len: int
    ep: int = 1
    draft_tp: int = 1
    max_draft_len: int = 8
    kv_tokens: int | None = None
    max_prefill_tokens: int = 512
    cuda_graphs: bool = True
    draft_ahead: bool = False
    budget_bytes: int | None = None
    headroom_bytes: int = 2 * GIB

    def check(self, cfg: TargetConfig) -> Mapping:
        """The mapping, after checking every field. Raises ConfigError naming the first bad one."""
        for name in ("tp", "ep", "max_batch_size", "max_seq_len", "max_draft_len", "max_prefill_tokens"):
            v = getattr(self, name)
            hi = LIMITS.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "max_draft_len" else 1) or (hi and v > hi):
                want = "an integer ≥ 0 (0: no speculation)" if name == "max_draft_len" else "a positive integer"
                raise ConfigError(f"{name.replace('_', '-')} = {v!r}, expected {want}" + (f", at most {hi}" if hi else ""))
        if self.draft_tp not in (1, self.tp):
            raise ConfigError(f"draft-tp = {self.draft_tp}: expected 1 (drafter on GPU 0) or the target's tp {self.tp}")
        if self.max_seq_len > cfg.max_position_embeddings:
            raise ConfigError(f"max-seq-len = {self.max_seq_len} exceeds the target's max_position_embeddings = "
                              f"{cfg.max_position_embeddings}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ConfigError(f"kv-tokens = {self.kv_tokens}, expected a positive token budget")
        if self.headroom_bytes < 0:
            raise ConfigError(f"headroom-gib = {self.headroom_bytes / GIB:g}, expected ≥ 0")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ConfigError(f"--gpu-memory-gib = {self.budget_bytes / GIB:g} (under a byte), expected a positive size")
        mapping = Mapping(self.tp, self.ep)
        mapping.check(cfg, "--tp/--ep")
        return mapping

    @property
    def kv_rows(self) -> int:
        tokens = self.kv_tokens or self.max_batch_size * self.max_seq_len
        return (-(-tokens // BLOCK_SIZE) + 1) * BLOCK_SIZE


@dataclass
class GpuPlan:
    """One GPU: bytes per item, each item in a group of :data:`GROUPS`."""

    gpu: int
    items: dict[str, tuple[str, int]] = field(default_factory=dict)  # label -> (group, bytes)

    def add(self, group: str, label: str, nbytes: int) -> None:
        if nbytes:
            self.items[label] = (group, int(nbytes))

    def group(self, group: str) -> int:
        return sum(b for g, b in self.items.values() if g == group)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.items.values())

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(((label, b) for label, (_, b) in self.items.items()), key=lambda x: -x[1])[:n]


def _act_bytes(fmt: WeightFormat) -> int:
    """Activation element size: the engine's float dtype (bf16 beside FP8 or INT4 weights)."""
    return fmt.float_bytes


def _moe_buffers(cfg: TargetConfig, mapping: Mapping, fmt: WeightFormat, tokens: int, act: int, on_gpu: bool) -> int:
    """Transient bytes of one MoE layer over ``tokens`` tokens (grouped GEMMs above the fused kernels' limit)."""
    if on_gpu and tokens <= FUSED_MOE_MAX_TOKENS:
        return 0
    ie = cfg.moe_intermediate_size // mapping.moe_tp_size
    buffers = tokens * cfg.num_experts_per_tok * (2 * cfg.hidden_size + 3 * ie) * act
    if fmt.name in ("int4", "fp8") and on_gpu:  # models.grouped_moe.int4_grouped_experts, models.fp8_grouped: bf16
        # activations [P, I_e], float32 per-pair outputs [P, H], x as bf16 [T, H], their sum [T, H] float32 and bf16
        # (P = T·top_k)
        pairs = tokens * cfg.num_experts_per_tok
        return pairs * (2 * ie + 4 * cfg.hidden_size) + 8 * tokens * cfg.hidden_size
    if fmt.name == "fp8":  # CPU engines: quant.dequantize_fp8 of the stacked w13: float32 weight, expanded scales, product
        buffers += 12 * (cfg.n_routed_experts // mapping.ep_size) * 2 * ie * cfg.hidden_size
    if fmt.name == "int4":  # models.int4_routed's dequantised path (CPU engines): one chunk of the chosen experts'
        # w13 and w2 in the activation dtype, plus the int32 nibbles, float32 values and scales of its w13
        chunk = min(cfg.n_routed_experts // mapping.ep_size, tokens * cfg.num_experts_per_tok, INT4_CHUNK)
        buffers += chunk * 3 * ie * cfg.hidden_size * act + chunk * 2 * ie * cfg.hidden_size * 12
    return buffers


def _target_forward(cfg: TargetConfig, mapping: Mapping, fmt: WeightFormat, tokens: int, logit_rows: int, attention: int,
                    act: int, on_gpu: bool) -> int:
    """Peak transient bytes of one target forward: the larger layer half plus what lives across layers."""
    H = cfg.hidden_size
    layer = max(attention, _moe_buffers(cfg, mapping, fmt, tokens, act, on_gpu) if cfg.n_routed_experts else 0)
    return layer + 6 * tokens * H * act + 2 * logit_rows * cfg.vocab_size * 4


def _tokens_per_sequence(dcfg, dep: Deployment) -> int:
    """Tokens a steady cycle verifies per sequence: max_draft_len + 1, or 1 without a drafter (no speculation)."""
    return dep.max_draft_len + 1 if dcfg is not None else 1


def _graph_pool(cfg, dcfg, mapping, fmt, dep: Deployment, drafts_here: bool) -> int:
    act, H, lat = _act_bytes(fmt), cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    bp, n = bucket(dep.max_batch_size), _tokens_per_sequence(dcfg, dep)
    S = -(-dep.max_seq_len // BLOCK_SIZE) * BLOCK_SIZE
    T, heads = bp * n, cfg.num_attention_heads // mapping.tp_size
    attention = bp * S * lat * act + bp * heads * n * S * (8 + act)
    peak = _target_forward(cfg, mapping, fmt, T, T, attention, act, True) + 2 * T * 3 * H * act
    windows = {S} | {w for w in (256 * 2 ** i for i in range(20)) if w < S}
    ns = n * (n + 1) // 2  # 1 + 2 + … + n: a steady batch of each k ≤ max_draft_len captures graphs of its own
    outputs = sum(b * ns * (cfg.vocab_size * 4 + 3 * H * act) for b in buckets_upto(bp)) * len(windows)
    if drafts_here and dcfg is not None and dep.max_draft_len:
        outputs += sum(b * ns * 3 * H * act for b in buckets_upto(bp))  # the verify → draft aux hand-off
        d = dep.draft_tp
        kv, nq = dcfg.num_key_value_heads // d, dcfg.num_attention_heads // d
        draft = 2 * bp * S * kv * dcfg.head_dim * act + bp * nq * n * S * (8 + act) + 2 * T * dcfg.draft_vocab_size * 4
        peak = max(peak, draft)
        if dep.draft_ahead and d == 1:  # draft-ahead's graphs: a pool of their own, holding a draft's intermediates
            outputs += draft
    return peak + outputs


def _eager(cfg, dcfg, mapping, fmt, dep: Deployment, drafts_here: bool, on_gpu: bool, dequant: int = 0) -> tuple[int, int]:
    """(eager forward peak, aux states kept for the drafter) on one GPU."""
    act, H, L = _act_bytes(fmt), cfg.hidden_size, dep.max_seq_len
    n, heads, c = _tokens_per_sequence(dcfg, dep), cfg.num_attention_heads // mapping.tp_size, min(dep.max_prefill_tokens, L)
    lat = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    T = dep.max_prefill_tokens + dep.max_batch_size * n
    attention = 2 * L * heads * lat * 4 + 2 * heads * c * L * 4
    peak = _target_forward(cfg, mapping, fmt, T, dep.max_batch_size * n + 1, attention, act, on_gpu)
    aux = 0
    if drafts_here and dcfg is not None and dep.max_draft_len:
        d = dep.draft_tp
        nq = dcfg.num_attention_heads // d
        extend = 2 * nq * L * L * 4 + 2 * L * nq * dcfg.head_dim * (act + 4) + L * 3 * dcfg.target_hidden_size * 4
        peak = max(peak, extend + dequant)
        aux = (2 * L + dep.max_batch_size * n) * 3 * H * act
    return peak, aux


@dataclass
class MemoryPlan:
    """Per-GPU plans of one deployment, with what they were computed from."""

    deployment: Deployment
    fmt: WeightFormat
    gpus: list[GpuPlan]
    source: str
    kv_tokens: int
    kv_bytes_per_token: dict[int, int]  # GPU -> KV bytes per token (target + drafter there)
    drafter_name: str | None = None
    drafter_block: tuple[int, int] | None = None  # an FP8 drafter's tile

    def over(self) -> list[GpuPlan]:
        b = self.deployment.budget_bytes
        return [] if b is None else [g for g in self.gpus if g.total > b]

    def kv_fit(self, gpu: GpuPlan) -> int | None:
        """KV tokens this GPU could hold within the budget, everything else as planned (None: no budget)."""
        b = self.deployment.budget_bytes
        if b is None:
            return None
        rest = gpu.total - gpu.group("kv") - gpu.group("headroom")  # what does not grow with the KV budget
        free = b - self.deployment.headroom_bytes - rest * (1 + FRAGMENTATION)
        per = self.kv_bytes_per_token[gpu.gpu] * (1 + FRAGMENTATION)
        return max(0, int(free // per) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE)

    def check(self) -> None:
        """Raise :class:`MemoryPlanError`, one line naming the first GPU over budget, the budget and its largest items."""
        over = self.over()
        if over:
            g = max(over, key=lambda p: p.total)
            items = ", ".join(f"{label} {b / GIB:.1f} GiB" for label, b in g.largest())
            raise MemoryPlanError(f"GPU {g.gpu} needs {g.total / GIB:.1f} GiB, over its {self.deployment.budget_bytes / GIB:.1f} "
                                  f"GiB budget ({self.fmt.name} weights, TP{self.deployment.tp}); largest: {items}")


def plan_memory(cfg: TargetConfig, fmt: WeightFormat, storage: Storage, dcfg: DrafterConfig | None, dep: Deployment,
                source: str = "config.json", on_gpu: bool = True, drafter_block: tuple[int, int] | None = None) -> MemoryPlan:
    """The plan of ``dep`` for target ``cfg`` with weights in ``fmt`` (stored as ``storage`` says) and drafter ``dcfg``
    (None: no drafter), an FP8 drafter in ``drafter_block`` tiles when given (``build --drafter-dtype fp8``; off the
    GPU its largest linear's per-call dequantisation, :data:`FP8_DEQUANT_BYTES` per element, counts in its forward's
    peak; GPUs run its linears in FP8).
    ``on_gpu`` False models a CPU engine (no CUDA graphs, no fused MoE kernels, no headroom).

    Raises:
        ConfigError: a bad deployment field, or a TP/EP size that does not divide the config.
    """
    mapping = dep.check(cfg)
    if dcfg is not None and dep.max_draft_len == 0:
        raise ConfigError("max-draft-len = 0 with a drafter: expected at least 1 (build refuses engines that cannot "
                          "draft; plan without --drafter for no speculation)")
    least = _tokens_per_sequence(dcfg, dep) + 2  # as build: a one-token prompt, one new token, a cycle's tokens
    if dep.max_seq_len < least:
        raise ConfigError(f"max-seq-len = {dep.max_seq_len}, expected ≥ {least} (a "
                          "one-token prompt, one new token and the tokens a cycle verifies; build refuses less)")
    act, rows = _act_bytes(fmt), dep.kv_rows
    target_kv = cfg.num_hidden_layers * rows * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act
    draft_here = [g == 0 or dep.draft_tp > 1 for g in range(dep.tp)] if dcfg is not None else [False] * dep.tp
    dweights = drafter_bytes(dcfg, fmt.float_bytes, dep.draft_tp, drafter_block) if dcfg is not None else Counter()
    dequant = 0
    if dcfg is not None and drafter_block is not None and not on_gpu:
        fp8 = [t.numel() for t in drafter_rank_weights(dcfg, fmt.float_bytes, dep.draft_tp, drafter_block).values()
               if t.dtype == quant.FP8_DTYPE]
        dequant = FP8_DEQUANT_BYTES * max(fp8, default=0)
    # the engine's own cache class on the meta device: K and V per head (Llama attention) or the latent row (MLA)
    dkv = (drafter_cache(dcfg, rows, {2: torch.bfloat16, 4: torch.float32}[act], "meta", dep.draft_tp).nbytes
           if dcfg is not None else 0)
    gpus, per_token, cache = [], {}, {}
    for g in range(dep.tp):
        p = GpuPlan(g)
        # ranks differ only in FP8 tile alignment (by slice index) and, read from headers, in their experts' storage
        key = g if fmt.name == "fp8" else mapping.ep_rank(g) if storage.reader is not None else 0
        w = cache.get(key) or cache.setdefault(key, target_rank_bytes(cfg, mapping, g, fmt, storage))
        for kind, label in KINDS.items():
            p.add("weights", label, w[kind])
        if draft_here[g]:
            for kind, label in DRAFTER_KINDS.items():
                p.add("drafter", label, dweights[kind])
        p.add("kv", "KV cache, target (MLA latent)", target_kv)
        p.add("kv", f"KV cache, drafter ({'TP1' if dep.draft_tp == 1 else 'shard'})", dkv if draft_here[g] else 0)
        if on_gpu and dep.cuda_graphs:
            p.add("graphs", "CUDA-graph pool", _graph_pool(cfg, dcfg, mapping, fmt, dep, draft_here[g]))
        peak, aux = _eager(cfg, dcfg, mapping, fmt, dep, draft_here[g], on_gpu, dequant)
        if g == 0:  # the leader's sampled decisions reuse the eager forwards' cached memory, in bounded chunks
            peak = max(peak, SAMPLING_BYTES)
        p.add("activations", "activations (eager peak)", peak)
        p.add("activations", "aux states for the drafter", aux)
        if on_gpu:
            p.add("headroom", "headroom (context, NCCL, fragmentation)", dep.headroom_bytes + math.ceil(p.total * FRAGMENTATION))
        per_token[g] = (target_kv + (dkv if draft_here[g] else 0)) // rows
        gpus.append(p)
    return MemoryPlan(dep, fmt, gpus, source, dep.kv_tokens or dep.max_batch_size * dep.max_seq_len, per_token,
                      drafter_block=drafter_block if dcfg is not None else None)


def device_budget(gpu_memory_gib: float | None) -> tuple[int | None, str]:
    """(per-GPU budget in bytes, where it came from): the given GiB; else this machine's free GPU memory
    (``torch.cuda.mem_get_info``); else None (a CPU machine: no check)."""
    if gpu_memory_gib is not None:
        return int(gpu_memory_gib * GIB), f"--gpu-memory-gib {gpu_memory_gib:g}"
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free, f"free memory of {torch.cuda.get_device_name()} (torch.cuda.mem_get_info)"
    return None, "no GPU here and no --gpu-memory-gib"


def check_build(cfg: TargetConfig, mapping: Mapping, dcfg: DrafterConfig, dtype: str, block: tuple[int, int] | None,
                limits: dict, gpu_memory_gib: float | None, float_bytes: int | None = None, group: int | None = None,
                drafter_block: tuple[int, int] | None = None) -> str:
    """The plan of engines ``splitspec build`` is about to write (drafter TP1 on GPU 0, the heavier placement; KV
    budget max_batch_size × max_seq_len), checked against :func:`device_budget`. Returns a one-line summary.

    ``float_bytes``: element size of what is not kept quantised (default: bf16 beside fp8 / int4); ``group``: the INT4
    group of a converted checkpoint, whose routed experts alone are INT4; ``drafter_block``: an FP8 drafter's tile.

    Raises:
        MemoryPlanError: the engines would not fit (nothing has been written yet).
    """
    float_bytes = float_bytes or FLOAT_BYTES.get(dtype, 2)
    fmt = WeightFormat(dtype, float_bytes, block if dtype == "fp8" else None, group if dtype == "int4" else None)
    if dtype == "int4":  # a converted checkpoint keeps only the routed experts INT4
        scheme = quant.QuantScheme("int4", group_size=group, ignore=(r"re:(?!.*\.experts\.)",))
    else:
        scheme = quant.QuantScheme("fp8", block=block) if block else quant.QuantScheme()
    budget, source = device_budget(gpu_memory_gib)
    dep = Deployment(tp=mapping.tp_size, ep=mapping.ep_size, max_batch_size=limits["max_batch_size"],
                     max_seq_len=limits["max_seq_len"], max_draft_len=limits["max_draft_len"], budget_bytes=budget)
    plan = plan_memory(cfg, fmt, Storage(scheme), dcfg, dep, "converted checkpoint", drafter_block=drafter_block)
    g = max(plan.gpus, key=lambda p: p.total)
    if budget is None:
        return f"memory plan: {g.total / GIB:.2f} GiB on the deployment's fullest GPU, its GPU {g.gpu} (not checked: {source})"
    try:
        plan.check()
    except MemoryPlanError as e:
        raise MemoryPlanError(f"refusing to build: {e} (budget: {source}; see 'splitspec plan')") from None
    return f"memory plan: {g.total / GIB:.2f} GiB of {budget / GIB:.2f} GiB on the deployment's fullest GPU, its GPU {g.gpu} ({source})"
