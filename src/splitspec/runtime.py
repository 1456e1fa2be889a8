"""Speculative decoding over the target group and the TP1 drafter (greedy, one sequence at a time).

A *cycle* (see DESIGN.md, "Speculation, in numbers"): the drafter extends over the tokens accepted
last cycle and proposes k draft tokens; the target verifies k+1 positions in one forward; the longest
prefix of drafts equal to the target's own greedy tokens is accepted, plus one target token. Greedy
output is therefore token-for-token identical to target-only greedy decoding (Leviathan et al. 2023,
arXiv:2211.17192; EAGLE-3, arXiv:2503.01840).

Indexing: with n known tokens x_0..x_{n−1}, the target's KV cache and aux states cover positions
0..n−2; drafter row j pairs aux(j) with token x_{j+1} at rotary position j.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from splitspec.engine import Drafter, TargetGroup
from splitspec.errors import ConfigError
from splitspec.models.batch import ForwardBatch


@dataclass
class GenerationResult:
    """Outcome of one request.

    Attributes:
        token_ids: generated target ids (prompt excluded), stop token included if one ended it.
        num_cycles: target verify forwards after prefill (decode steps when k = 0).
        acceptance_length: tokens emitted per target verify forward (1.0 without speculation).
        accepted_per_position: accepted_per_position[i] = cycles whose draft i+1 was accepted.
        draft_ms, verify_ms, prefill_ms: wall time in the drafter / target verify / prefill.
        finish_reason: "stop" (a stop token) or "length" (max_tokens).
    """

    token_ids: list[int]
    num_cycles: int = 0
    acceptance_length: float = 1.0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    prefill_ms: float = 0.0
    finish_reason: str = "length"


class SpeculativeEngine:
    """Target TP group + TP1 drafter, decoding with EAGLE-3 speculation.

    Use :meth:`load`; call :meth:`close` to stop the target's worker processes.
    """

    def __init__(self, target: TargetGroup, drafter: Drafter, num_draft_tokens: int = 4):
        self.target, self.drafter = target, drafter
        self.num_draft_tokens = num_draft_tokens
        self.max_seq_len = target.limits["max_seq_len"]
        self.max_draft_len = target.limits["max_draft_len"]
        n = target.cfg.num_hidden_layers
        if any(p > n for p in drafter.capture_points):
            raise ConfigError(f"drafter capture points {drafter.capture_points} exceed the target's {n} layers")

    @classmethod
    def load(cls, engines_dir: Path, target_device_ids: list[int] | None = None, draft_device_id: int | None = None,
             draft_tp: int = 1, num_draft_tokens: int = 4) -> "SpeculativeEngine":
        """Start the target group (``engines_dir/target``) and load the drafter (``engines_dir/drafter``).

        Args:
            target_device_ids: GPU ids of target ranks 0..N−1 (None: CPU).
            draft_device_id: GPU of the drafter (None: target rank 0's device).
            draft_tp: drafter tensor-parallel size; only 1 is built by this version.
        Raises:
            ConfigError: unsupported placement. EngineError / CheckpointError: engines that do not load.
        """
        if draft_tp != 1:
            raise ConfigError(f"draft_tp = {draft_tp}: this version runs the drafter at TP1 only")
        engines_dir = Path(engines_dir)
        target = TargetGroup(engines_dir / "target", target_device_ids)
        try:
            device = f"cuda:{draft_device_id}" if draft_device_id is not None else target.devices[0]
            drafter = Drafter(engines_dir / "drafter", device)
            return cls(target, drafter, num_draft_tokens)
        except BaseException:
            target.close()
            raise

    def close(self) -> None:
        self.target.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_request(self, prompt_ids: list[int], max_tokens: int, k: int) -> None:
        vocab = self.target.cfg.vocab_size
        if not prompt_ids:
            raise ConfigError("prompt is empty: at least one token is needed")
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ConfigError(f"prompt holds token ids outside the vocabulary [0, {vocab})")
        if max_tokens < 1:
            raise ConfigError(f"max_tokens = {max_tokens}, expected ≥ 1")
        if not 0 <= k <= self.max_draft_len:
            raise ConfigError(f"num_draft_tokens = {k}, expected 0..{self.max_draft_len} (engine max_draft_len)")
        need = len(prompt_ids) + max_tokens + k + 1
        if need > self.max_seq_len:
            raise ConfigError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) + draft length ({k}) + 1 = {need} "
                              f"exceeds the engine's max_seq_len = {self.max_seq_len}")

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_tokens: int, num_draft_tokens: int | None = None,
                 stop_token_ids: set[int] | None = None, on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Greedy generation with speculation; ``num_draft_tokens`` = 0 decodes target-only.

        Args:
            prompt_ids: prompt token ids.
            max_tokens: at most this many tokens are generated.
            num_draft_tokens: draft tokens per cycle (k); None = the engine default.
            stop_token_ids: generation ends after emitting one of these (it is included).
            on_tokens: called with each cycle's newly emitted tokens (streaming).
        Raises:
            ConfigError: an empty/out-of-vocabulary prompt, or a request longer than the engine's limits.
            EngineError: a worker died.
        """
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        self._check_request(prompt_ids, max_tokens, k)
        stops = stop_token_ids or set()
        slot, dev = 0, self.target.devices[0]
        capture = self.drafter.capture_points if k > 0 else ()
        res = GenerationResult(token_ids=[], accepted_per_position=[0] * k)

        t0 = time.perf_counter()
        logits, aux = self.target.forward(ForwardBatch.build([(slot, 0, prompt_ids)], "last", dev), capture)
        res.prefill_ms = (time.perf_counter() - t0) * 1e3
        tokens = list(prompt_ids) + [int(logits[-1].argmax())]
        emitted = [tokens[-1]]
        extend_start = 0  # first drafter row still to extend

        def emit(new: list[int]) -> bool:
            """Append tokens up to a stop or max_tokens; return True when generation is finished."""
            for t in new:
                res.token_ids.append(t)
                if t in stops:
                    res.finish_reason = "stop"
                    return True
                if len(res.token_ids) >= max_tokens:
                    return True
            return False

        done = emit(emitted)
        if on_tokens:
            on_tokens(list(res.token_ids))
        emitted_in_cycles = 0
        while not done:
            n = len(tokens)
            drafts: list[int] = []
            if k > 0:
                t0 = time.perf_counter()
                model, cache = self.drafter.model, self.drafter.cache
                ext = ForwardBatch.build([(slot, extend_start, tokens[extend_start + 1:n])], "last", self.drafter.device)
                dlogits, dh = model.forward(ext, model.fuse(aux.to(self.drafter.device)), cache)
                drafts.append(int(model.propose(dlogits)[-1]))
                h = dh[-1:]
                for i in range(1, k):
                    step = ForwardBatch.build([(slot, n - 2 + i, [drafts[-1]])], "last", self.drafter.device)
                    dlogits, h = model.forward(step, h, cache)
                    drafts.append(int(model.propose(dlogits)[-1]))
                res.draft_ms += (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            logits, aux = self.target.forward(ForwardBatch.build([(slot, n - 1, [tokens[-1]] + drafts)], "all", dev), capture)
            res.verify_ms += (time.perf_counter() - t0) * 1e3
            target_tokens = logits.argmax(-1).tolist()
            a = 0
            while a < k and drafts[a] == target_tokens[a]:
                a += 1
            new = drafts[:a] + [target_tokens[a]]
            res.num_cycles += 1
            before = len(res.token_ids)
            done = emit(new)
            got = len(res.token_ids) - before
            emitted_in_cycles += got
            for i in range(min(a, got)):
                res.accepted_per_position[i] += 1
            tokens += new
            if aux is not None:
                aux = aux[: a + 1]
            extend_start = n - 1
            if on_tokens and got:
                on_tokens(res.token_ids[before:])
        res.acceptance_length = emitted_in_cycles / res.num_cycles if res.num_cycles else 1.0
        return res
