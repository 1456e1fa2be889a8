"""Model and parallel-mapping configurations, read from Hugging Face ``config.json`` files.

Field names follow the DeepSeek-V3 / Kimi-K2 config (``DeepseekV3Config``) and the EAGLE-3 drafter
configs (in :mod:`splitspec.drafter_config`); see docs/formats.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from splitspec.errors import CheckpointError, ConfigError

TARGET_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "kimi_k25")
TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")  # model_type of a kimi_k25 checkpoint's text_config



#: Largest size field read (hidden sizes, vocabularies, experts, …): far above any published model, and below what
#: would overflow a tensor shape or make a memory plan loop for minutes.
SIZE_LIMIT = 1 << 24
NUMBER = (int, float)


def require_field(cfg: dict, key: str, where: str, kind=(int,), lo: float | None = None, hi: float | None = None):
    """``cfg[key]``, checked to be of ``kind`` (not bool), finite and within [lo, hi] where given. Raises
    CheckpointError naming ``where`` and the field."""
    if key not in cfg:
        raise CheckpointError(f"{where}: field '{key}' is missing")
    v = cfg[key]
    bad = not isinstance(v, kind) or isinstance(v, bool)
    if not bad and ((isinstance(v, float) and not math.isfinite(v)) or (lo is not None and v < lo) or (hi is not None and v > hi)):
        bad = True
    if bad:
        span = (f" in {lo}..{hi}" if hi is not None else f" ≥ {lo}") if lo is not None else ""
        what = "a number" if float in kind else " or ".join(k.__name__ for k in kind)
        raise CheckpointError(f"{where}: field '{key}' = {v!r}, expected {what}{span}")
    return v


def architecture(cfg: dict, where: str) -> str | None:
    """The config's architecture name: ``architectures[0]`` (a bare string taken as the name), None when absent.
    Raises CheckpointError for any other value."""
    a = cfg.get("architectures")
    if a is None or a == []:
        return None
    if isinstance(a, str):
        return a
    if isinstance(a, list) and isinstance(a[0], str):
        return a[0]
    raise CheckpointError(f"{where}: field 'architectures' = {a!r:.80}, expected a list of names")


def optional_field(cfg: dict, key: str, where: str, default, kind=(int,), lo: float | None = None, hi: float | None = None):
    """:func:`require_field`, or ``default`` when the field is missing or null."""
    return default if cfg.get(key) is None else require_field(cfg, key, where, kind, lo, hi)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding with optional YaRN scaling (Peng et al. 2023, arXiv:2309.00071; DeepSeek-V3 form).

    ``factor == 1`` means plain RoPE. ``interleaved`` = rotary dims stored as pairs (x0, x1), (x2, x3)…
    (DeepSeek-V3 / Kimi-K2 checkpoints); otherwise half split (Llama).
    """

    theta: float
    dim: int
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleaved: bool = True

    @staticmethod
    def from_hf(cfg: dict, dim: int, interleaved: bool, where: str) -> "RopeConfig":
        theta = float(optional_field(cfg, "rope_theta", where, 10000.0, NUMBER, lo=1e-9))
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if not isinstance(rs, dict):
            raise CheckpointError(f"{where}: field 'rope_scaling' = {rs!r}, expected an object (e.g. {{\"type\": \"yarn\", ...}}) or null")
        kind = rs.get("type", rs.get("rope_type", "default")) if rs else "default"
        if kind in (None, "default"):
            return RopeConfig(theta=theta, dim=dim, interleaved=interleaved)
        if kind != "yarn":
            raise CheckpointError(f"{where}: rope_scaling type '{kind}' is not supported (expected 'yarn' or none)")
        at = f"{where}: rope_scaling"
        num = lambda key, default: float(optional_field(rs, key, at, default, NUMBER, lo=0) or default)  # noqa: E731
        return RopeConfig(
            theta=theta, dim=dim, factor=float(require_field(rs, "factor", at, NUMBER, lo=1e-9)),
            original_max_position_embeddings=require_field(rs, "original_max_position_embeddings", at, lo=1, hi=1 << 30),
            beta_fast=num("beta_fast", 32.0), beta_slow=num("beta_slow", 1.0), mscale=num("mscale", 1.0),
            mscale_all_dim=num("mscale_all_dim", 0.0), interleaved=interleaved,
        )

    @staticmethod
    def yarn_mscale(factor: float, mscale: float) -> float:
        """YaRN attention temperature: 0.1·mscale·ln(factor) + 1 for factor > 1, else 1."""
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def cos_sin_scale(self) -> float:
        """Factor applied to cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        if self.factor <= 1:
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return self.yarn_mscale(self.factor, self.mscale) / self.yarn_mscale(self.factor, self.mscale_all_dim)
        return self.yarn_mscale(self.factor, 1.0)

    def mla_softmax_scale(self, qk_head_dim: int) -> float:
        """MLA's attention scale: qk_head_dim^-0.5 × mscale(factor, mscale_all_dim)² (DeepSeek-V3 with YaRN)."""
        s = qk_head_dim ** -0.5
        if self.factor > 1 and self.mscale_all_dim:
            s *= self.yarn_mscale(self.factor, self.mscale_all_dim) ** 2
        return s


class MLAHeads:
    """The MLA head dimensions both configs derive (fields qk_nope_head_dim, qk_rope_head_dim and rope)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 × mscale(factor, mscale_all_dim)² (DeepSeek-V3 MLA with YaRN, :meth:`RopeConfig.mla_softmax_scale`)."""
        return self.rope.mla_softmax_scale(self.qk_head_dim)


@dataclass(frozen=True)
class TargetConfig(MLAHeads):
    """A Kimi-K2 / DeepSeek-V3 target (architecture ``DeepseekV3ForCausalLM``)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    n_group: int = 1
    topk_group: int = 1
    bos_token_id: int | None = None
    eos_token_id: int | list | None = None
    model_type: str = "kimi_k2"

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @staticmethod
    def text_config(cfg: dict, where: str = "config.json") -> tuple[dict, str, bool]:
        """The DeepSeek-V3 fields of a target config: (fields, where to name them, nested?).

        ``kimi_k25`` checkpoints nest the text model under ``text_config`` (its own
        ``quantization_config`` inside); ``kimi_k2`` / ``deepseek_v3`` keep the fields at the top.
        Raises:
            CheckpointError: an unknown ``model_type``, or a kimi_k25 config without a usable ``text_config``.
        """
        mt = cfg.get("model_type")
        if mt not in TARGET_MODEL_TYPES:
            raise CheckpointError(f"{where}: model_type '{mt}' is not a supported target (expected one of {', '.join(TARGET_MODEL_TYPES)})")
        if mt != "kimi_k25":
            return cfg, where, False
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(f"{where}: model_type 'kimi_k25' but field 'text_config' is {'missing' if text is None else repr(text)}")
        tmt = text.get("model_type", "deepseek_v3")
        if tmt not in TEXT_MODEL_TYPES:
            raise CheckpointError(f"{where}: text_config.model_type '{tmt}' is not supported (expected one of {', '.join(TEXT_MODEL_TYPES)})")
        return text, f"{where}: text_config", True

    @staticmethod
    def from_hf(cfg: dict, where: str = "config.json") -> "TargetConfig":
        """Parse a DeepSeek-V3-family ``config.json`` dict (``kimi_k2``, ``deepseek_v3``, or ``kimi_k25`` with the
        text model under ``text_config``).

        Raises:
            CheckpointError: wrong ``model_type``, a missing field, or a router this engine does not run.
        """
        mt = cfg.get("model_type")
        top = cfg
        cfg, where, _ = TargetConfig.text_config(cfg, where)
        if cfg.get("topk_method", "noaux_tc") != "noaux_tc" or cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"{where}: router topk_method='{cfg.get('topk_method')}', scoring_func='{cfg.get('scoring_func')}'; expected noaux_tc with sigmoid scores")
        ints = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "first_k_dense_replace", "num_attention_heads", "n_routed_experts", "num_experts_per_tok",
                "n_shared_experts", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
        vals = {k: require_field(cfg, k, where, lo=0 if k in ("first_k_dense_replace", "n_shared_experts") else 1,
                                 hi=4096 if k == "num_hidden_layers" else SIZE_LIMIT) for k in ints}
        if vals["first_k_dense_replace"] > vals["num_hidden_layers"]:
            raise CheckpointError(f"{where}: field 'first_k_dense_replace' = {vals['first_k_dense_replace']}, expected at "
                                  f"most num_hidden_layers ({vals['num_hidden_layers']})")
        if vals["num_experts_per_tok"] > vals["n_routed_experts"]:
            raise CheckpointError(f"{where}: field 'num_experts_per_tok' = {vals['num_experts_per_tok']}, expected at most "
                                  f"n_routed_experts ({vals['n_routed_experts']})")
        if cfg.get("num_key_value_heads", vals["num_attention_heads"]) != vals["num_attention_heads"]:
            raise CheckpointError(f"{where}: num_key_value_heads must equal num_attention_heads for MLA")
        return TargetConfig(
            **vals,
            routed_scaling_factor=float(optional_field(cfg, "routed_scaling_factor", where, 1.0, NUMBER, lo=0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            rms_norm_eps=float(optional_field(cfg, "rms_norm_eps", where, 1e-6, NUMBER, lo=0)),
            max_position_embeddings=optional_field(cfg, "max_position_embeddings", where, 4096, lo=1, hi=1 << 30),
            rope=RopeConfig.from_hf(cfg, vals["qk_rope_head_dim"], bool(cfg.get("rope_interleave", True)), where),
            n_group=optional_field(cfg, "n_group", where, 1, lo=0, hi=SIZE_LIMIT) or 1,
            topk_group=optional_field(cfg, "topk_group", where, 1, lo=0, hi=SIZE_LIMIT) or 1,
            bos_token_id=cfg.get("bos_token_id", top.get("bos_token_id")),
            eos_token_id=cfg.get("eos_token_id", top.get("eos_token_id")), model_type=mt,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "TargetConfig":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        return TargetConfig(**d)


@dataclass(frozen=True)
class Mapping:
    """How the target is split over ``tp_size`` ranks.

    Attention heads, dense MLP, shared experts and the vocabulary are split ``tp_size`` ways.
    Routed experts are split expert-parallel ``ep_size`` ways and expert-TP ``moe_tp_size`` ways,
    with ``ep_size * moe_tp_size == tp_size`` (rank r holds expert group r // moe_tp_size and
    intermediate slice r % moe_tp_size).
    """

    tp_size: int = 1
    ep_size: int = 1

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    def ep_rank(self, rank: int) -> int:
        return rank // self.moe_tp_size

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp_size

    def check(self, cfg: TargetConfig, where: str = "mapping") -> None:
        """Raise ConfigError naming the field that ``tp_size``/``ep_size`` does not divide."""
        tp, ep = self.tp_size, self.ep_size
        if tp < 1 or ep < 1 or tp % ep:
            raise ConfigError(f"{where}: tp_size={tp}, ep_size={ep}: need positive sizes with ep_size dividing tp_size")
        checks = [("num_attention_heads", cfg.num_attention_heads, tp), ("vocab_size", cfg.vocab_size, tp),
                  ("intermediate_size", cfg.intermediate_size, tp),
                  ("moe_intermediate_size * n_shared_experts", cfg.moe_intermediate_size * max(cfg.n_shared_experts, 1), tp),
                  ("n_routed_experts", cfg.n_routed_experts, ep),
                  ("moe_intermediate_size", cfg.moe_intermediate_size, self.moe_tp_size)]
        for name, value, by in checks:
            if value % by:
                raise ConfigError(f"{where}: {name} = {value} is not divisible by {by} (tp_size={tp}, ep_size={ep})")

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"moe_tp_size": self.moe_tp_size}

    @staticmethod
    def from_dict(d: dict) -> "Mapping":
        return Mapping(tp_size=int(d["tp_size"]), ep_size=int(d.get("ep_size", 1)))
