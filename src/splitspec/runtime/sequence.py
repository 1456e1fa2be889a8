"""One request inside the scheduler: its tokens, KV blocks, sampling generator, detokenizer and statistics, and
how tokens a cycle produced for it are emitted (up to a stop token, a stop string or max_tokens)."""

from __future__ import annotations

import time

import torch

from splitspec.runtime.types import Request, RequestOutput, RequestStats


class Sequence:
    """A request being served. ``tokens``: prompt + generated (every known token); ``output``: the emitted ones;
    ``extend_start`` / ``keep_aux``: where the drafter extends next cycle and the aux rows still valid."""

    def __init__(self, sid: int, req: Request, k: int, stops: set[int], detok):
        self.id, self.req, self.k = sid, req, k
        self.stops = stops
        self.tokens = list(req.prompt_ids)
        self.prefilled = 0
        self.blocks: list[int] = []
        self.output: list[int] = []
        self.extend_start, self.keep_aux = 0, None
        self.gen = torch.Generator()
        if req.sampling.seed is not None:
            self.gen.manual_seed(req.sampling.seed)
        else:
            self.gen.seed()
        self.detok = detok
        self.stats = RequestStats(num_prompt_tokens=len(req.prompt_ids), accepted_per_position=[0] * k)
        self.t_submit = time.perf_counter()
        self.emitted_in_cycles = 0
        self.text = ""
        self.finish_reason: str | None = None
        self.cancelled = False
        self.cancel_reason = "cancelled"  # the finish reason of a cancelled sequence
        self.deadline = None if req.timeout_s is None else self.t_submit + req.timeout_s  # time.perf_counter()

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.req.prompt_ids)

    def need_tokens(self) -> int:
        return len(self.req.prompt_ids) + self.req.max_tokens + self.k + 1

    def emit(self, new: list[int], accepted: int | None) -> tuple[list[RequestOutput], str | None]:
        """Append ``new`` tokens up to a stop or max_tokens (``accepted``: drafts accepted this cycle, None for a
        prefill's first token). Returns the delta event (if any) and why the request ends ("stop", "length"),
        or None."""
        take, reason = [], None
        for t in new:
            take.append(t)
            if t in self.stops:
                reason = "stop"
                break
            if len(self.output) + len(take) >= self.req.max_tokens:
                reason = "length"
                break
        text = ""
        if self.detok is not None:
            text = self.detok.add(take)
            if self.detok.stopped:
                take = take[: self.detok.tokens_to_stop - len(self.output)]
                reason = "stop_string"
        self.output += take
        self.text += text
        if not self.stats.ttft_ms and take:
            self.stats.ttft_ms = (time.perf_counter() - self.t_submit) * 1e3
        if accepted is not None:
            self.emitted_in_cycles += len(take)
            for i in range(min(accepted, len(take))):
                self.stats.accepted_per_position[i] += 1
        events = [RequestOutput(self.id, take, text)] if take or text else []
        return events, ("stop" if reason == "stop_string" else reason)

    def finish(self, reason: str, error: str | None = None) -> RequestOutput:
        """Close the statistics and the detokenizer (its held-back text, unless ``error``); the final event."""
        self.finish_reason = reason
        s = self.stats
        s.e2e_ms = (time.perf_counter() - self.t_submit) * 1e3
        s.num_output_tokens = len(self.output)
        s.acceptance_length = self.emitted_in_cycles / s.num_cycles if s.num_cycles else 1.0
        tail = self.detok.add([], final=True) if (self.detok and not error and reason != "stop_string") else ""
        self.text += tail
        return RequestOutput(self.id, [], tail, True, reason, s, error)
