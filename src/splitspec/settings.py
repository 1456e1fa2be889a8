"""``ServeConfig``: the deployment settings, made once at the edge and passed down unchanged.

One frozen, validated object carries what a deployment chooses — where the target and drafter run, how
many draft tokens, batch and KV limits, the engine switches — from whoever creates it (the CLI, the
``spec_decode`` Triton model's ``initialize``, a benchmark) to the engine group, the scheduler and the
engine process. It is never mutated: :meth:`ServeConfig.replace` returns a changed copy.

``SPLITSPEC_*`` environment variables are read here and nowhere else (:meth:`ServeConfig.from_env`).
The model repository stores the same settings as string parameters of ``spec_decode/config.pbtxt``;
:meth:`ServeConfig.to_parameters` writes them and :meth:`ServeConfig.from_parameters` reads them back,
so ``splitspec repo`` and the Triton model share one schema.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from splitspec.errors import ConfigError

#: The variable by which a started tritonserver names its private run folder to its processes (``run_dir``).
RUN_DIR_ENV = "SPLITSPEC_RUN_DIR"
#: Environment variables read by :meth:`ServeConfig.from_env`, with the field each sets.
ENV_FIELDS = {
    "SPLITSPEC_PADDED": "padded",
    "SPLITSPEC_COMPILE": "compile",
    "SPLITSPEC_CUDA_GRAPHS": "cuda_graphs",
    "SPLITSPEC_SKINNY_GEMM": "skinny_gemm",
    "SPLITSPEC_PDL": "pdl",
    "SPLITSPEC_DRAFT_AHEAD": "draft_ahead",
    "SPLITSPEC_COLLECTIVE_TIMEOUT_S": "collective_timeout_s",
    RUN_DIR_ENV: "run_dir",
}
#: Fields stored as ``spec_decode/config.pbtxt`` parameters (same names there).
PARAMETER_FIELDS = ("engines_dir", "target_device_ids", "draft_device_id", "draft_tp", "num_draft_tokens",
                    "max_batch_size", "kv_tokens", "max_prefill_tokens", "synthetic_acceptance", "trust_remote_code",
                    "max_prompt_bytes", "max_queue_len", "max_queue_s", "request_timeout_s")
_WHERE = "spec_decode/config.pbtxt"
#: Prompt bytes allowed per token of the engine's max_seq_len when max_prompt_bytes is not given. English text and
#: code run at 3–5 UTF-8 bytes per token with the usual BPE vocabularies, CJK at 2–4: a prompt this long (6× or more
#: typical) cannot fit the engine and is refused before the tokenizer spends time on it.
PROMPT_BYTES_PER_TOKEN = 32
#: Seconds a served request may wait for a batch slot when max_queue_s is not given.
MAX_QUEUE_S = 60.0


def parse_ids(text: str, what: str) -> tuple[int, ...]:
    """``"0,1"`` → ``(0, 1)``; ``""`` → ``()``. Raises ConfigError naming ``what`` on anything else."""
    text = (text or "").strip()
    if not text:
        return ()
    try:
        ids = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{what} = {text!r}: expected GPU ids like '0,1'") from None
    if any(i < 0 for i in ids):
        raise ConfigError(f"{what} = {text!r}: GPU ids are ≥ 0")
    return ids


def parse_id(text: str, what: str) -> int | None:
    """``"3"`` → 3; ``""`` → None. Raises ConfigError naming ``what`` on anything else (two ids too)."""
    ids = parse_ids(text, what)
    if len(ids) > 1:
        raise ConfigError(f"{what} = {text!r}: expected one GPU id")
    return ids[0] if ids else None


def _flag(name: str, raw: str) -> bool:
    """An on/off value: 1, true, yes, on / 0, false, no, off or empty, in any case, spaces around ignored."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} = {raw!r}: expected 1 or 0 (or true/false, yes/no, on/off)")


def parameter_flag(params: Mapping[str, str], name: str, where: str) -> bool:
    """A 1/0 ``config.pbtxt`` parameter (absent or empty: False). Raises ConfigError naming ``where`` and ``name``."""
    return _flag(f"{where}: parameter '{name}'", params.get(name) or "")


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """How one deployment runs its engines.

    Attributes:
        engines_dir: folder holding the built ``target/`` and ``drafter/`` engines.
        target_device_ids: GPU ids of target ranks 0..N−1, one per rank; ``()``: CPU.
        draft_device_id: GPU of a TP1 drafter; None: target rank 0's device.
        draft_tp: drafter tensor-parallel size, 1 (split placement) or the target's TP size (sharded);
            None: ``tuning.json``'s placement per batch bucket, else 1.
        num_draft_tokens: default draft tokens per cycle k (0: no speculation); None: ``tuning.json``'s k per
            batch bucket, else 4.
        max_batch_size: sequences decoded together; None: the engine's limit.
        kv_tokens: KV-cache budget in tokens shared by all sequences; None: max_batch_size × max_seq_len.
        max_prefill_tokens: prompt tokens prefilled per cycle (chunked prefill).
        synthetic_acceptance: BENCHMARK ONLY — per-position probabilities with which a draft token is accepted
            regardless of its value (outputs are then not the target's); None: real verification.
        padded: run steady decode cycles in the static-shape form on the CPU too (always on GPUs).
        compile: ``torch.compile`` the target's layers and the drafter's parts on GPUs.
        cuda_graphs: replay steady cycles from CUDA graphs on GPUs.
        skinny_gemm: the target's bf16 linears of at most 8 tokens through the Triton skinny-GEMM kernel
            (:mod:`splitspec.models.skinny_gemm`; where a shape's configuration multiplies by multiply-adds, the norms,
            residual adds and silu · up folded into the products they feed) instead of cuBLAS and separate kernels,
            one configuration per shape for every token count so that a verify rounds a token as a decode does; the
            MoE layer's shared expert then stays out of the fused expert kernels. Off by default: invariant, the layers
            measured no faster with it than with cuBLAS (docs/architecture.md).
        pdl: programmatic dependent launch (Hopper and later) for the compiled parts' Triton kernels (inductor's
            ``triton.enable_pdl``): each kernel may start while the one before it drains, and waits inside the GPU
            for that kernel's writes before its first read, so a CUDA graph's kernel boundaries cost less. Off by
            default (measured: docs/performance.md); no effect without ``compile`` and ``cuda_graphs`` (the parts are
            compiled for the CUDA-graph path only), on the CPU or on older GPUs. This switch decides for the engine's
            parts, whatever torch's own ``TORCHINDUCTOR_ENABLE_PDL`` says.
        draft_ahead: a steady cycle's draft phase launched behind the cycle before's verify, its acceptance decided
            on the device (greedy, sampled or synthetic), where the drafter is the TP1 one: the GPU then drafts while
            the host accepts, emits and plans (:mod:`splitspec.engine.draft_ahead`; the drafts of a cycle whose batch
            changed are dropped). Steady cycles in the padded form only: on the CPU with ``padded`` too. Off by
            default: measured on one H100 so far (docs/performance.md).
        collective_timeout_s: how long a rank waits in a collective before giving up, seconds.
        trust_remote_code: a tokenizer folder whose tokenizer exists only as Python code (``auto_map`` in
            ``tokenizer_config.json``) is loaded with transformers' ``AutoTokenizer``, running that code; off (the
            default), a model folder is read as data and such a folder is refused.
        max_prompt_bytes: the largest prompt (UTF-8 bytes of ``text_input``) preprocessing tokenises; a longer one
            is refused before tokenising. None: the target's max_seq_len × :data:`PROMPT_BYTES_PER_TOKEN`
            (filled in by ``render_repo``).
        max_queue_len: requests that may wait for a batch slot beyond the ``max_batch_size`` decoding; one more
            is refused at once as "server busy" (UNAVAILABLE, HTTP 503). None: ``max_batch_size`` (the engine's
            when that is None too), so at most twice max_batch_size requests are open.
        max_queue_s: seconds a request may wait for a batch slot before it is refused as "server busy"; None: no
            limit (offline runs; ``render_repo`` writes :data:`MAX_QUEUE_S` for serving).
        request_timeout_s: the longest a served request may run, seconds, and its deadline when it gives none
            (input ``timeout_ms``, capped by this): the only end of a request whose client left unseen
            (non-streaming HTTP). The engine then ends it with ``finish_reason`` ``"timeout"``.
        run_dir: the serving tritonserver's private folder (mode 0700, made for each start of the server and named
            to its processes as ``SPLITSPEC_RUN_DIR``), where the engine process keeps its heartbeat file
            (:mod:`splitspec.serving.heartbeat`); None: no heartbeat (offline runs, tests).
    """

    engines_dir: Path
    target_device_ids: tuple[int, ...] = ()
    draft_device_id: int | None = None
    draft_tp: int | None = None
    num_draft_tokens: int | None = None
    max_batch_size: int | None = None
    kv_tokens: int | None = None
    max_prefill_tokens: int = 512
    synthetic_acceptance: tuple[float, ...] | None = None
    padded: bool = False
    compile: bool = True
    cuda_graphs: bool = True
    skinny_gemm: bool = False
    pdl: bool = False
    draft_ahead: bool = False
    collective_timeout_s: int = 300
    trust_remote_code: bool = False
    max_prompt_bytes: int | None = None
    max_queue_len: int | None = None
    max_queue_s: float | None = None
    request_timeout_s: float = 600.0
    run_dir: Path | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        set_(self, "engines_dir", Path(self.engines_dir))
        if self.run_dir is not None:
            set_(self, "run_dir", Path(self.run_dir))
        set_(self, "target_device_ids", tuple(int(i) for i in self.target_device_ids or ()))
        if self.synthetic_acceptance is not None:
            set_(self, "synthetic_acceptance", tuple(float(p) for p in self.synthetic_acceptance))
        if len(set(self.target_device_ids)) != len(self.target_device_ids) or any(i < 0 for i in self.target_device_ids):
            raise ConfigError(f"target_device_ids {list(self.target_device_ids)}: expected distinct GPU ids ≥ 0")
        if self.draft_device_id is not None:
            if self.draft_device_id < 0:
                raise ConfigError(f"draft_device_id = {self.draft_device_id}: expected a GPU id ≥ 0")
            if not self.target_device_ids:
                raise ConfigError("draft_device_id is set but the target runs on the CPU (no target_device_ids)")
        for name in ("draft_tp", "max_batch_size", "kv_tokens", "max_prompt_bytes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name} = {v}: expected ≥ 1")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise ConfigError(f"num_draft_tokens = {self.num_draft_tokens}: expected ≥ 0")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ConfigError(f"max_queue_len = {self.max_queue_len}: expected ≥ 0")
        if self.max_queue_s is not None and not self.max_queue_s > 0:
            raise ConfigError(f"max_queue_s = {self.max_queue_s}: expected seconds > 0")
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"max_prefill_tokens = {self.max_prefill_tokens}: expected ≥ 1")
        if self.collective_timeout_s < 1:
            raise ConfigError(f"collective_timeout_s = {self.collective_timeout_s}: expected ≥ 1 second")
        if not self.request_timeout_s > 0:
            raise ConfigError(f"request_timeout_s = {self.request_timeout_s}: expected seconds > 0")
        if self.synthetic_acceptance is not None and not self.synthetic_acceptance:
            raise ConfigError("synthetic_acceptance is empty: expected one acceptance probability per draft position "
                              "(the last one serves the positions past it)")
        if self.synthetic_acceptance is not None and not all(0.0 <= p <= 1.0 for p in self.synthetic_acceptance):
            raise ConfigError(f"synthetic_acceptance {list(self.synthetic_acceptance)}: expected probabilities in [0, 1]")

    def replace(self, **changes) -> "ServeConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def on_gpu(self) -> bool:
        return bool(self.target_device_ids)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **fields) -> "ServeConfig":
        """``fields`` plus the engine switches from ``SPLITSPEC_*`` variables of ``env`` (default: this
        process's environment): ``SPLITSPEC_PADDED=1``, ``SPLITSPEC_COMPILE=0``, ``SPLITSPEC_CUDA_GRAPHS=0``,
        ``SPLITSPEC_SKINNY_GEMM=1``, ``SPLITSPEC_PDL=1``, ``SPLITSPEC_DRAFT_AHEAD=1``, ``SPLITSPEC_COLLECTIVE_TIMEOUT_S=N``, ``SPLITSPEC_RUN_DIR=PATH`` (empty: None). A field given explicitly wins
        over the environment."""
        env = os.environ if env is None else env
        for var, name in ENV_FIELDS.items():
            if name in fields or var not in env:
                continue
            raw = env[var]
            if name == "run_dir":
                fields[name] = Path(raw) if raw.strip() else None
            elif name == "collective_timeout_s":
                try:
                    fields[name] = int(raw)
                except ValueError:
                    raise ConfigError(f"{var} = {raw!r}: expected whole seconds") from None
            else:
                fields[name] = _flag(var, raw)
        return cls(**fields)

    def to_parameters(self) -> dict[str, str]:
        """The :data:`PARAMETER_FIELDS` as ``config.pbtxt`` string parameters (``""`` for None)."""
        out = {}
        for name in PARAMETER_FIELDS:
            v = getattr(self, name)
            if v is None:
                out[name] = ""
            elif isinstance(v, bool):
                out[name] = "1" if v else "0"
            elif isinstance(v, tuple):
                out[name] = ",".join(str(x) for x in v)
            else:
                out[name] = str(v)
        return out

    @classmethod
    def from_parameters(cls, params: Mapping[str, str], env: Mapping[str, str] | None = None) -> "ServeConfig":
        """Read :meth:`to_parameters`' output back (plus :meth:`from_env`'s switches). Raises ConfigError naming
        the parameter that does not parse."""

        def text(name: str) -> str:
            return (params.get(name) or "").strip()

        def number(name: str, cast=int):
            raw = text(name)
            if not raw:
                return None
            try:
                return cast(raw)
            except ValueError:
                kind = "an integer" if cast is int else "a number"
                raise ConfigError(f"{_WHERE}: parameter '{name}' = {raw!r}, expected {kind}") from None

        if not text("engines_dir"):
            raise ConfigError(f"{_WHERE}: parameter 'engines_dir' is empty")
        synthetic = text("synthetic_acceptance")
        try:
            probs = tuple(float(v) for v in synthetic.split(",")) if synthetic else None
        except ValueError:
            raise ConfigError(f"{_WHERE}: parameter 'synthetic_acceptance' = {synthetic!r}, "
                              "expected comma-separated probabilities") from None
        fields = dict(
            engines_dir=Path(text("engines_dir")),
            target_device_ids=parse_ids(text("target_device_ids"), f"{_WHERE}: parameter 'target_device_ids'"),
            draft_device_id=parse_id(text("draft_device_id"), f"{_WHERE}: parameter 'draft_device_id'"),
            draft_tp=number("draft_tp"), num_draft_tokens=number("num_draft_tokens"),
            max_batch_size=number("max_batch_size"), kv_tokens=number("kv_tokens"),
            max_prompt_bytes=number("max_prompt_bytes"), max_queue_len=number("max_queue_len"),
            max_queue_s=number("max_queue_s", float),
            synthetic_acceptance=probs, trust_remote_code=parameter_flag(params, "trust_remote_code", _WHERE),
        )
        prefill = number("max_prefill_tokens")
        if prefill is not None:
            fields["max_prefill_tokens"] = prefill
        timeout = number("request_timeout_s", float)
        if timeout is not None:
            fields["request_timeout_s"] = timeout
        return cls.from_env(env, **fields)
