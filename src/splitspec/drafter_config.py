"""The EAGLE-3 drafter's configuration, read from its Hugging Face ``config.json``: Llama-attention drafters
(``LlamaForCausalLMEagle3`` and aliases) and MLA drafters (``Eagle3DeepseekV2ForCausalLM``); see docs/formats.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from splitspec.config import NUMBER, SIZE_LIMIT, MLAHeads, RopeConfig, architecture, optional_field, require_field
from splitspec.errors import CheckpointError, ConfigError

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
        heads = require_field(cfg, "num_attention_heads", where, lo=1, hi=SIZE_LIMIT)
        if attention == "llama":
            hd = optional_field(cfg, "head_dim", where, 0, lo=0, hi=SIZE_LIMIT) or require_field(cfg, "hidden_size", where) // heads
            kv = optional_field(cfg, "num_key_value_heads", where, 0, lo=0, hi=heads) or heads
            return {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
                    "rope": RopeConfig.from_hf(cfg, hd, interleaved=False, where=where)}
        if "q_lora_rank" in cfg and cfg["q_lora_rank"] is None:
            raise CheckpointError(f"{where}: field 'q_lora_rank' is null: an MLA drafter with a full-rank q_proj is a variant "
                                  "this engine does not run (published Kimi MLA drafters use q_lora_rank 1536)")
        mla = {k: require_field(cfg, k, where, lo=1, hi=SIZE_LIMIT) for k in MLA_FIELDS}
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
        arch = architecture(cfg, where)
        if arch not in DRAFTER_ARCHITECTURES:
            raise CheckpointError(f"{where}: architectures[0] = '{arch}', expected an EAGLE-3 drafter: {', '.join(DRAFTER_ARCHITECTURES)}")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise CheckpointError(f"{where}: num_hidden_layers = {cfg.get('num_hidden_layers')}, expected 1 for an EAGLE-3 drafter")
        hs = require_field(cfg, "hidden_size", where, lo=1, hi=SIZE_LIMIT)
        eagle = cfg.get("eagle_config") or {}
        if not isinstance(eagle, dict):
            raise CheckpointError(f"{where}: field 'eagle_config' = {eagle!r:.80}, expected an object or null")
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
        vocab = require_field(cfg, "vocab_size", where, lo=1, hi=SIZE_LIMIT)
        flag = lambda *keys: any(bool(eagle.get(k, cfg.get(k, False))) for k in keys)  # noqa: E731
        return DrafterConfig(
            hidden_size=hs, intermediate_size=require_field(cfg, "intermediate_size", where, lo=1, hi=SIZE_LIMIT), vocab_size=vocab,
            draft_vocab_size=optional_field(cfg, "draft_vocab_size", where, 0, lo=0, hi=vocab) or vocab,
            target_hidden_size=optional_field(cfg, "target_hidden_size", where, 0, lo=0, hi=SIZE_LIMIT) or hs,
            rms_norm_eps=float(optional_field(cfg, "rms_norm_eps", where, 1e-6, NUMBER, lo=0)), aux_layer_ids=tuple(ids),
            aux_convention=convention,
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
