"""What goes in and out of the scheduler: requests and their sampling parameters, their events and statistics, and
per-cycle statistics. Free of torch: the Triton stubs import it."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitspec.errors import ConfigError

MIN_TEMPERATURE = 1e-3  # below this, logits / temperature overflows float32: ask for greedy (0) instead


#: The largest request seed (a signed 64-bit generator seed: 0 ≤ seed < 2^63).
SEED_MAX = 2**63 - 1


@dataclass
class SamplingParams:
    """Per-request decoding parameters.

    temperature: 0 = greedy (token-for-token identical to target-only greedy decoding).
    top_k: keep the k most likely tokens (0 = all). top_p: nucleus mass in (0, 1].
    seed: seeds the request's generator (reproducible for a given deployment), None = random.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def check(self) -> None:
        """Raise ConfigError naming the field unless every value has the right type and range."""
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if not num(self.temperature) or not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= 100):
            raise ConfigError(f"temperature = {self.temperature!r}, expected 0 (greedy) or {MIN_TEMPERATURE}..100")
        if not num(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p = {self.top_p!r}, expected a number with 0 < top_p ≤ 1")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ConfigError(f"top_k = {self.top_k!r}, expected an integer ≥ 0 (0 = no limit)")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= SEED_MAX):
            raise ConfigError(f"seed = {self.seed!r}, expected an integer in [0, 2^63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Request:
    """A generation request.

    Attributes:
        prompt_ids: prompt token ids.
        max_tokens: at most this many tokens are generated (≥ 1).
        sampling: temperature / top-p / top-k / seed.
        num_draft_tokens: draft tokens per cycle (k); None = the deployment's default; 0 = no speculation.
        stop: stop strings (need a tokenizer); output ends right before the first one.
        stop_token_ids: ids that end generation (they are emitted); None = the tokenizer's EOS / <|im_end|>.
        timeout_s: seconds from submission after which the engine ends the request (``finish_reason``
            ``"timeout"``, with what it generated so far); None = no limit.
    """

    prompt_ids: list[int]
    max_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_draft_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: set[int] | None = None
    timeout_s: float | None = None

    def check(self) -> None:
        """Check the fields on their own (the engine checks them against its limits: vocabulary, k, max_seq_len,
        KV budget). Raises ConfigError naming the field: prompt_ids not integers or empty, num_draft_tokens not an
        integer, bad stop strings or stop_token_ids, sampling not a valid SamplingParams, max_tokens < 1."""
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
        if not isinstance(self.prompt_ids, (list, tuple)) or not all(is_int(t) for t in self.prompt_ids):
            raise ConfigError("prompt_ids must be a list of integer token ids")
        if self.num_draft_tokens is not None and not is_int(self.num_draft_tokens):
            raise ConfigError(f"num_draft_tokens = {self.num_draft_tokens!r}, expected an integer")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise ConfigError(f"stop = {self.stop!r}, expected a list of non-empty strings")
        if len(self.stop) > 16 or any(len(x) > 256 for x in self.stop):
            raise ConfigError("stop: at most 16 strings of at most 256 characters")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (set, frozenset, list, tuple))
                                                or not all(is_int(t) for t in self.stop_token_ids)):
            raise ConfigError(f"stop_token_ids = {self.stop_token_ids!r}, expected a set of integer token ids (or None)")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError("sampling must be a SamplingParams")
        if not self.prompt_ids:
            raise ConfigError("prompt is empty: at least one token is needed")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens = {self.max_tokens!r}, expected an integer ≥ 1")
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s = {self.timeout_s!r}, expected seconds > 0 (or None)")
        self.sampling.check()


@dataclass
class RequestStats:
    """Per-request speculation statistics (counting only emitted tokens).

    acceptance_length: emitted tokens per target verify forward (1.0 without speculation).
    accepted_per_position[i]: cycles whose draft i+1 was accepted and emitted.
    drafted_tokens: draft tokens proposed for it, over all its cycles (sum(accepted_per_position) of them accepted).
    draft_ms / verify_ms: summed wall time of the cycles this request took part in.
    ttft_ms: submit → first token; e2e_ms: submit → finish; queue_ms: submit → admission.
    """

    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cycles: int = 0
    acceptance_length: float = 1.0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    queue_ms: float = 0.0
    synthetic: bool = False
    drafted_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / (self.e2e_ms / 1e3) if self.e2e_ms else 0.0


@dataclass
class RequestOutput:
    """One event of a request: tokens (and text, with a tokenizer) emitted in one cycle, or the end.

    ``error`` is set (and ``finished`` True) when the request failed; ``stats`` is set when finished.
    ``finish_reason``: "stop", "length", "cancelled", "error", "busy" (queued longer than ``max_queue_s``: ``error``
    says so); "rejected" for a request the engine process refused
    (:mod:`splitspec.serving.engine_process`; ``error`` says why, no ``stats``).
    """

    request_id: int
    token_ids: list[int]
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None


@dataclass
class GenerationResult:
    """A finished request (see :meth:`SpeculativeEngine.generate`)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats

    # Shortcuts used by callers of the single-request API.
    @property
    def acceptance_length(self) -> float:
        return self.stats.acceptance_length

    @property
    def accepted_per_position(self) -> list[int]:
        return self.stats.accepted_per_position

    @property
    def num_cycles(self) -> int:
        return self.stats.num_cycles


@dataclass
class CycleStats:
    """One cycle: sequences decoding / prefilling, draft and verify time (ms), tokens emitted per decoding
    sequence, accepted drafts by position, KV blocks used/total, queued requests, the placement that drafted
    (``draft_tp``; 0: nothing drafted) and whether it took over from the other one this cycle (``switched``)."""

    decode_seqs: int
    prefill_tokens: int
    draft_ms: float
    verify_ms: float
    emitted: list[int]
    accepted_by_position: list[int]
    kv_used_blocks: int
    kv_total_blocks: int
    queued: int
    draft_tp: int = 0
    switched: bool = False
