"""The benchmark's client: one gRPC stream per worker, one greedy streaming request at a time, every
response timestamped at the client (:class:`StreamWorker`), and what one request measured
(:class:`RequestRecord`: client times, the engine's ``return_stats`` and a hash of the output ids).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import time
from dataclasses import dataclass, field

from splitspec.errors import SplitspecError
from splitspec.measure.prompts import Prompt


@dataclass
class RequestRecord:
    """One measured request (times in ms; client times are measured from sending the request).

    Attributes:
        draft_tp, k, concurrency, prompt_id: the configuration and prompt.
        block: the index of the block of ``concurrency`` requests it was sent in.
        latency_ms: sent → final response (client).
        ttft_ms: sent → first response carrying tokens (client).
        token_times_ms: (ms since sent, tokens) of every response carrying tokens.
        num_output_tokens, acceptance_length, accepted_per_position, draft_ms, verify_ms,
        engine_ttft_ms, engine_e2e_ms, queue_ms, finish_reason: from ``return_stats`` (num_output_tokens: the sum
        of every response's count of the tokens it adds).
        output_sha: SHA-1 of the output token ids (greedy outputs are compared across k).
        request_id: the id it was sent with; sent_ns: when (``time.perf_counter_ns()``: ``CLOCK_MONOTONIC`` on
            Linux, the clock of Triton's trace timestamps, bench/lab/triton_trace.py); "" and 0 when not known.
    """

    draft_tp: int
    k: int
    concurrency: int
    prompt_id: str
    block: int
    latency_ms: float
    ttft_ms: float | None
    token_times_ms: list[tuple[float, int]]
    num_output_tokens: int
    acceptance_length: float
    accepted_per_position: list[int]
    draft_ms: float
    verify_ms: float
    engine_ttft_ms: float | None
    engine_e2e_ms: float | None
    queue_ms: float | None
    finish_reason: str | None
    output_sha: str
    request_id: str = ""
    sent_ns: int = 0

    @property
    def cycles(self) -> int:
        """Verify cycles of the request: (n_output − 1) / acceptance length (the first token comes
        from prefill)."""
        if self.num_output_tokens <= 1 or self.acceptance_length <= 0:
            return 0
        return max(1, round((self.num_output_tokens - 1) / self.acceptance_length))

    @property
    def tokens_per_s(self) -> float:
        """Output tokens / client latency (tokens/s)."""
        return self.num_output_tokens / (self.latency_ms / 1e3) if self.latency_ms > 0 else 0.0

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: (t_last − t_first) / (n − 1) (ms)."""
        if len(self.token_times_ms) < 2 or self.num_output_tokens < 2:
            return None
        return (self.token_times_ms[-1][0] - self.token_times_ms[0][0]) / (self.num_output_tokens - 1)


class StreamWorker:
    """A gRPC client with one open stream, sending one request at a time and timing its responses."""

    def __init__(self, address: str, timeout_s: float = 300.0):
        import tritonclient.grpc as grpcclient

        self.address, self.timeout_s = address, timeout_s
        self._answers: queue.Queue = queue.Queue()
        self._ids = iter(range(1 << 62))
        self.client = grpcclient.InferenceServerClient(address)
        self.client.start_stream(callback=lambda result, error: self._answers.put((time.perf_counter(), result, error)))

    def close(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=True)
        except Exception:
            pass
        self.client.close()

    def run(self, prompt: Prompt, max_tokens: int, k: int, *, draft_tp: int, concurrency: int, block: int) -> RequestRecord:
        """Send one greedy streaming request and wait for its final response.

        Raises:
            SplitspecError: the server answered with an error or nothing arrived within ``timeout_s``.
        """
        from splitspec.serving.client import grpc_inputs

        inputs = grpc_inputs(prompt.text, max_tokens, num_draft_tokens=k, stream=True, return_stats=True,
                             return_token_ids=True, apply_chat_template=True if prompt.chat else None)
        rid = f"{os.getpid()}-{next(self._ids)}"
        times: list[tuple[float, int]] = []
        ids: list[int] = []
        final: dict = {}
        sent_ns = time.perf_counter_ns()
        t0 = sent_ns / 1e9
        self.client.async_stream_infer("ensemble", inputs, request_id=rid, enable_empty_final_response=True)
        while True:
            try:
                t, result, error = self._answers.get(timeout=self.timeout_s)
            except queue.Empty:
                raise SplitspecError(f"grpc {self.address}: no response within {self.timeout_s:.0f} s "
                                     f"(prompt {prompt.id}, k={k})") from None
            if error is not None:
                msg = error.message() if hasattr(error, "message") else str(error)
                raise SplitspecError(f"grpc {self.address}: prompt {prompt.id}, k={k}: {msg}")
            resp = result.get_response()
            if resp.id != rid:  # a late answer of an earlier request on this stream
                continue
            out = result.as_numpy("output_ids")
            if out is not None and out.size:
                times.append(((t - t0) * 1e3, int(out.size)))
                ids += [int(x) for x in out.reshape(-1)]
            n = result.as_numpy("num_output_tokens")  # the tokens this response adds
            if n is not None:
                final["num_output_tokens"] = final.get("num_output_tokens", 0) + int(n.reshape(-1)[0])
            for name in ("acceptance_length", "accepted_per_position", "draft_ms", "verify_ms",
                         "ttft_ms", "e2e_ms", "queue_ms", "finish_reason"):
                a = result.as_numpy(name)
                if a is not None:
                    vals = [v.decode() if isinstance(v, bytes) else v.item() for v in a.reshape(-1)]
                    final[name] = vals if name == "accepted_per_position" else (vals[0] if vals else None)
            p = resp.parameters
            if "triton_final_response" in p and p["triton_final_response"].bool_param:
                latency = (t - t0) * 1e3
                break
        if "acceptance_length" not in final:
            raise SplitspecError(f"grpc {self.address}: the final response carries no statistics (return_stats)")
        return RequestRecord(
            draft_tp=draft_tp, k=k, concurrency=concurrency, prompt_id=prompt.id, block=block, latency_ms=latency,
            ttft_ms=times[0][0] if times else None, token_times_ms=times,
            num_output_tokens=int(final.get("num_output_tokens", len(ids))),
            acceptance_length=float(final["acceptance_length"]),
            accepted_per_position=[int(x) for x in final.get("accepted_per_position") or []],
            draft_ms=float(final.get("draft_ms", 0.0)), verify_ms=float(final.get("verify_ms", 0.0)),
            engine_ttft_ms=final.get("ttft_ms"), engine_e2e_ms=final.get("e2e_ms"), queue_ms=final.get("queue_ms"),
            finish_reason=final.get("finish_reason"),
            output_sha=hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:16], request_id=rid, sent_ns=sent_ns)


@dataclass
class PlacementRun:
    """What one server (one draft placement) produced."""

    draft_tp: int
    ks: list[int]
    records: list[RequestRecord] = field(default_factory=list)
    #: (k, concurrency) → summed wall seconds of its blocks.
    wall_s: dict = field(default_factory=dict)
    metrics_delta: dict = field(default_factory=dict)
    startup_s: float | None = None
    tritonserver: str | None = None
