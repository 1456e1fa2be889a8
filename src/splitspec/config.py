"""Model and parallel-mapping configurations, read from Hugging Face ``config.json`` files.

Field names follow the DeepSeek-V3 / Kimi-K2 config (``DeepseekV3Config``) and the EAGLE-3 drafter
configs (``LlamaForCausalLMEagle3``, ``Eagle3DeepseekV2ForCausalLM``); see docs/formats.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from splitspec.errors import CheckpointError, ConfigError

TARGET_MODEL_TYPES = ("kimi_k2", "deepseek_v3", "kimi_k25")
TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")  # model_type of a kimi_k25 checkpoint's text_config

# Keys that ModelOpt (NVIDIA TensorRT Model Optimizer) writes into an exported EAGLE-3 drafter's
# ``eagle_config``. ModelOpt trains against TensorRT-LLM, which captures the *output* of target layer i
# (its default ids are {1, N//2 - 1, N - 4}), so their presence marks the output-of-layer convention.
MODELOPT_EAGLE_KEYS = ("use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm", "next_layer_regular")

# Published EAGLE-3 drafter architectures → the attention of their single layer: "llama" (GQA, q/k/v_proj) or
# "mla" (DeepSeek-V3 multi-head latent attention over the 2·H input). The MLA names are those vLLM
# (models/deepseek_eagle3.py), SGLang (models/kimi_k25_eagle3.py) and TensorRT-LLM (modeling_speculative.py) register.
DRAFTER_ARCHITECTURES = {"LlamaForCausalLMEagle3": "llama", "Eagle3LlamaForCausalLM": "llama", "LlamaForCausalLMEagle": "llama",
                         "Eagle3DeepseekV2ForCausalLM": "mla", "Eagle3DeepseekV3ForCausalLM": "mla",
                         "Eagle3DeepSeekV3ForCausalLM": "mla"}
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _require(cfg: dict, key: str, where: str, kind=(int,)):
    if key not in cfg:
        raise CheckpointError(f"{where}: field '{key}' is missing")
    v = cfg[key]
    if not isinstance(v, kind) or isinstance(v, bool):
        raise CheckpointError(f"{where}: field '{key}' = {v!r}, expected {' or '.join(k.__name__ for k in kind)}")
    return v


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
        theta = float(cfg.get("rope_theta", 10000.0))
        rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if not isinstance(rs, dict):
            raise CheckpointError(f"{where}: field 'rope_scaling' = {rs!r}, expected an object (e.g. {{\"type\": \"yarn\", ...}}) or null")
        kind = rs.get("type", rs.get("rope_type", "default")) if rs else "default"
        if kind in (None, "default"):
            return RopeConfig(theta=theta, dim=dim, interleaved=interleaved)
        if kind != "yarn":
            raise CheckpointError(f"{where}: rope_scaling type '{kind}' is not supported (expected 'yarn' or none)")
        return RopeConfig(
            theta=theta, dim=dim, factor=float(rs["factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
            mscale=float(rs.get("mscale") or 1.0), mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0),
            interleaved=interleaved,
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
        vals = {k: _require(cfg, k, where) for k in ints}
        for k in ints:
            if vals[k] <= 0 and k not in ("first_k_dense_replace", "n_shared_experts"):
                raise CheckpointError(f"{where}: field '{k}' = {vals[k]}, expected a positive integer")
        if cfg.get("num_key_value_heads", vals["num_attention_heads"]) != vals["num_attention_heads"]:
            raise CheckpointError(f"{where}: num_key_value_heads must equal num_attention_heads for MLA")
        return TargetConfig(
            **vals,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(cfg, vals["qk_rope_head_dim"], bool(cfg.get("rope_interleave", True)), where),
            n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
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
class DrafterConfig(MLAHeads):
    """An EAGLE-3 drafter: one decoder layer over fused aux states, its attention either Llama's
    (``LlamaForCausalLMEagle3``: GQA over q/k/v_proj) or DeepSeek-V3's MLA (``Eagle3DeepseekV2ForCausalLM``,
    ``attention == "mla"``: q_lora_rank … v_head_dim as in the target's config; ``head_dim`` is then
    qk_nope + qk_rope and ``num_key_value_heads`` the head count).

    ``aux_layer_ids`` are as published; ``aux_convention`` says how to read them:
    ``"input"`` = input to target layer i (EAGLE, vLLM, SGLang), ``"output"`` = output of layer i
    (TensorRT-LLM, SpecForge). :meth:`capture_points` normalises to the input-to-layer reading.
    ``aux_convention_source`` says where the convention came from (config, origin marker, command line).

    ``norm_before_fc``: one RMSNorm over the concatenated aux states [3·target_hidden] before ``fc``
    (tensor ``input_norm.weight``; the config key used by vLLM and TensorRT-LLM, at the top level or in
    ``eagle_config``). ``fc_norm``: one RMSNorm per aux state [target_hidden] before ``fc`` (tensors
    ``fc_norm.{0,1,2}.weight``; vLLM's key, SGLang's older ``use_aux_norm``). ``norm_output``: the state fed
    to the next draft step is the final norm's output instead of its input (EAGLE-3.1; vLLM/SGLang
    ``norm_output``, TensorRT-LLM ``eagle_config.return_hidden_post_norm``).
    """

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope: RopeConfig
    aux_layer_ids: tuple[int, ...]
    aux_convention: str | None = None
    aux_convention_source: str | None = None
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    architecture: str = "LlamaForCausalLMEagle3"
    attention: str = "llama"
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"


    def capture_points(self) -> tuple[int, ...]:
        """Aux ids as input-to-layer indices i ∈ [0, num_target_layers]; i = N is after the last block, before the final norm."""
        if self.aux_convention not in ("input", "output"):
            raise ConfigError("drafter aux_convention is unknown: declare it in eagle_config.aux_layer_id_convention "
                              "or pass --aux-convention input|output")
        shift = 1 if self.aux_convention == "output" else 0
        return tuple(i + shift for i in self.aux_layer_ids)

    @staticmethod
    def _aux_convention(eagle: dict, where: str, aux_convention: str | None) -> tuple[str | None, str | None]:
        """(convention, where it came from): declared, given, inferred from ModelOpt export keys, or (None, None)."""
        declared = eagle.get("aux_layer_id_convention")
        if declared is not None and declared not in ("input", "output"):
            raise CheckpointError(f"{where}: eagle_config.aux_layer_id_convention = {declared!r}, expected 'input' or 'output'")
        if declared and aux_convention and declared != aux_convention:
            raise ConfigError(f"{where}: declares aux_layer_id_convention '{declared}' but '{aux_convention}' was requested")
        if aux_convention is not None and aux_convention not in ("input", "output"):
            raise ConfigError(f"aux convention {aux_convention!r}: expected 'input' or 'output'")
        markers = [k for k in MODELOPT_EAGLE_KEYS if k in eagle]
        inferred = "output" if markers else None
        if declared:
            return declared, "declared in eagle_config.aux_layer_id_convention"
        if aux_convention:
            source = "given on the command line"
            if inferred and inferred != aux_convention:
                source += f" (overrides '{inferred}', inferred from ModelOpt export keys eagle_config.{markers[0]})"
            return aux_convention, source
        if inferred:
            return inferred, (f"inferred from its origin: ModelOpt/TensorRT-LLM export (eagle_config.{', '.join(markers)}); "
                              "TensorRT-LLM captures layer outputs")
        return None, None

    @staticmethod
    def _attention_fields(cfg: dict, where: str, attention: str) -> dict:
        """The fields of the layer's attention: Llama GQA heads × head_dim, or the MLA dimensions."""
        heads = _require(cfg, "num_attention_heads", where)
        if attention == "llama":
            hd = int(cfg.get("head_dim") or _require(cfg, "hidden_size", where) // heads)
            return {"num_attention_heads": heads, "num_key_value_heads": int(cfg.get("num_key_value_heads") or heads), "head_dim": hd,
                    "rope": RopeConfig.from_hf(cfg, hd, interleaved=False, where=where)}
        if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
            raise CheckpointError(f"{where}: field 'q_lora_rank' is null: an MLA drafter with a full-rank q_proj is a variant "
                                  "this engine does not run (published Kimi MLA drafters use q_lora_rank 1536)")
        mla = {k: _require(cfg, k, where) for k in MLA_FIELDS}
        for k, v in mla.items():
            if v <= 0:
                raise CheckpointError(f"{where}: field '{k}' = {v}, expected a positive integer")
        if cfg.get("num_key_value_heads", heads) != heads:
            raise CheckpointError(f"{where}: num_key_value_heads = {cfg['num_key_value_heads']} must equal num_attention_heads "
                                  f"= {heads} for MLA")
        return {"num_attention_heads": heads, "num_key_value_heads": heads, **mla,
                "head_dim": mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
                "rope": RopeConfig.from_hf(cfg, mla["qk_rope_head_dim"], bool(cfg.get("rope_interleave", True)), where)}

    @staticmethod
    def from_hf(cfg: dict, where: str = "config.json", aux_convention: str | None = None) -> "DrafterConfig":
        """Parse an EAGLE-3 drafter ``config.json`` dict (an architecture of :data:`DRAFTER_ARCHITECTURES`).

        The aux-id convention comes from, in order: ``eagle_config.aux_layer_id_convention`` (declared);
        ``aux_convention`` (the command line); a known origin marker (ModelOpt's export keys in
        ``eagle_config`` → "output"). Otherwise it stays None and :meth:`capture_points` refuses to guess.

        Args:
            aux_convention: declares the aux-id convention ("input" or "output") when the config does not.
        Raises:
            CheckpointError: wrong architecture or missing fields; a drafter variant this engine does not run.
            ConfigError: ``aux_convention`` contradicts the config's declaration.
        """
        arch = (cfg.get("architectures") or [None])[0]
        if arch not in DRAFTER_ARCHITECTURES:
            raise CheckpointError(f"{where}: architectures[0] = '{arch}', expected an EAGLE-3 drafter: {', '.join(DRAFTER_ARCHITECTURES)}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise CheckpointError(f"{where}: num_hidden_layers = {cfg.get('num_hidden_layers')}, expected 1 for an EAGLE-3 drafter")
        hs = _require(cfg, "hidden_size", where)
        eagle = cfg.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"))
        if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids = {ids!r}, expected three non-negative layer ids")
        convention, source = DrafterConfig._aux_convention(eagle, where, aux_convention)
        if eagle.get("use_aux_hidden_state") is False:
            raise CheckpointError(f"{where}: eagle_config.use_aux_hidden_state = false: not an EAGLE-3 drafter over aux hidden states")
        for key, what in (("norm_before_residual", "residual taken after hidden_norm"),
                          ("eh_proj_before_attn", "an eh_proj over [embedding, hidden] before attention")):
            if eagle.get(key, cfg.get(key)):
                raise CheckpointError(f"{where}: {key} = true is a drafter variant this engine does not run ({what})")
        vocab = _require(cfg, "vocab_size", where)
        flag = lambda *keys: any(bool(eagle.get(k, cfg.get(k, False))) for k in keys)  # noqa: E731
        return DrafterConfig(
            hidden_size=hs, intermediate_size=_require(cfg, "intermediate_size", where), vocab_size=vocab,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or vocab), target_hidden_size=int(cfg.get("target_hidden_size") or hs),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), aux_layer_ids=tuple(ids), aux_convention=convention,
            aux_convention_source=source, norm_before_fc=flag("norm_before_fc"), fc_norm=flag("fc_norm", "use_aux_norm"),
            norm_output=flag("norm_output", "return_hidden_post_norm"), architecture=arch, attention=DRAFTER_ARCHITECTURES[arch],
            **DrafterConfig._attention_fields(cfg, where, DRAFTER_ARCHITECTURES[arch]),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["aux_layer_ids"] = list(self.aux_layer_ids)
        return d

    @staticmethod
    def from_dict(d: dict) -> "DrafterConfig":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        d["aux_layer_ids"] = tuple(d["aux_layer_ids"])
        return DrafterConfig(**d)

    def describe_attention(self) -> str:
        """The layer's attention in one phrase, e.g. ``64 heads, MLA (q_lora 1536, kv_lora 512, nope 128 / rope 64 / v 128)``."""
        if self.is_mla:
            return (f"{self.num_attention_heads} heads, MLA (q_lora {self.q_lora_rank}, kv_lora {self.kv_lora_rank}, "
                    f"nope {self.qk_nope_head_dim} / rope {self.qk_rope_head_dim} / v {self.v_head_dim})")
        return f"{self.num_attention_heads}/{self.num_key_value_heads} heads × {self.head_dim}"

    def describe_capture(self, num_target_layers: int | None = None) -> str:
        """One line per aux id: which target state feeds the drafter, e.g. ``30 → input to layer 31 (= output of layer 30)``."""
        if self.aux_convention not in ("input", "output"):
            return f"aux ids {list(self.aux_layer_ids)}: convention unknown (declare it or pass --aux-convention input|output)"
        parts = []
        for i, p in zip(self.aux_layer_ids, self.capture_points()):
            if num_target_layers is not None and p == num_target_layers:
                parts.append(f"{i} → after the last layer (output of layer {p - 1}), before the final norm")
            elif p == 0:
                parts.append(f"{i} → input to layer 0 (the embeddings)")
            else:
                parts.append(f"{i} → input to layer {p} (= output of layer {p - 1})")
        return "; ".join(parts)


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
