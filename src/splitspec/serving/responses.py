"""Response assembly for the ``spec_decode`` Triton model: what one open request (a *stream*) still has to send, and
the outputs of its next response (docs/serving.md, "Request and response").

Triton-free: a response is a list of ``(output name, NumPy array)`` pairs, which
:func:`splitspec.serving.triton.response` turns into a ``pb_utils.InferenceResponse``. Every array has a leading
batch dimension of 1 (the model is batched with ``max_batch_size`` 1, the TensorRT-LLM backend's convention):

- always: ``output_text`` bytes [1, 1] (UTF-8, the text since the last response), ``stream_id`` int64 [1, 1],
  ``batch_index`` and ``sequence_index`` int32 [1, 1] (0);
- ``return_token_ids``: ``output_ids`` int32 [1, n] (the tokens since the last response);
- ``return_num_input_tokens`` / ``return_num_output_tokens``: int32 [1, 1], the prompt's tokens / the tokens this
  response adds;
- the final response: ``finish_reason`` bytes [1, 1]; with ``return_stats``, ``accepted_per_position`` int32 [1, k],
  ``total_accepted_draft_tokens`` int32 [1, 1], ``acceptance_rate`` float32 [1, 1] (accepted / drafted, 0 when
  nothing was drafted) and the :data:`STATS_OUTPUTS`.
"""

from __future__ import annotations

import time

import numpy as np

from splitspec.runtime.types import RequestOutput
from splitspec.serving.repo import CANCEL_POLL_S
from splitspec.serving.requests import StreamOptions
from splitspec.serving.triton import bytes_array

#: Outputs of the final response with ``return_stats`` / ``return_perf_metrics``: (output, RequestStats field, dtype).
STATS_OUTPUTS = (("acceptance_length", "acceptance_length", np.float32), ("queue_ms", "queue_ms", np.float32),
                 ("ttft_ms", "ttft_ms", np.float32), ("e2e_ms", "e2e_ms", np.float32),
                 ("draft_ms", "draft_ms", np.float32), ("verify_ms", "verify_ms", np.float32),
                 ("total_draft_tokens", "drafted_tokens", np.int32))

Outputs = list[tuple[str, np.ndarray]]


class Stream:
    """One open request: where its responses go (``sender``, opaque here) and what is still to be sent.

    ``sid``: the request's id in the model and in the engine process; ``num_input``: its prompt tokens. With
    ``options.echo`` the prompt text leads the (single) response.
    """

    __slots__ = ("sid", "sender", "stream", "want_ids", "options", "num_input", "ids", "text", "done", "cancelled",
                 "cancel_cycle", "next_poll")

    def __init__(self, sid: int, sender, options: StreamOptions, num_input: int):
        self.sid, self.sender = sid, sender
        self.stream, self.want_ids, self.options = options.stream, options.return_token_ids, options
        self.num_input = num_input
        self.ids: list[int] = []  # not yet sent (also when not asked for, to count them)
        self.text: list[str] = []
        if options.echo:
            self.text.append(options.echo)
        self.done = False  # the final response (or an error) was sent
        self.cancelled = False
        self.cancel_cycle: int | None = None  # engine cycles run when the cancellation reached the model
        self.next_poll = time.monotonic() + CANCEL_POLL_S  # of the next is_cancelled() poll

    def add(self, ev: RequestOutput) -> None:
        """Hold ``ev``'s tokens and text for the next response."""
        self.ids += ev.token_ids
        if ev.text:
            self.text.append(ev.text)

    def has_delta(self) -> bool:
        """Whether a streaming request has something to send now: text, or token ids when it asked for them (a
        cycle whose tokens complete no character yet sends nothing otherwise)."""
        return self.stream and bool(self.text or (self.want_ids and self.ids))

    def poll_due(self, now: float) -> bool:
        """Whether ``is_cancelled()`` is due at ``now`` (``time.monotonic()``): at most every ``CANCEL_POLL_S``;
        a True answer starts the next interval."""
        if now < self.next_poll:
            return False
        self.next_poll = now + CANCEL_POLL_S
        return True

    def take_outputs(self, final: RequestOutput | None = None) -> Outputs:
        """The outputs of the next response, from what is held (then nothing is held); ``final``: the engine's
        finish event, making it the final response (see the module docstring)."""
        o = self.options
        out: Outputs = [("output_text", bytes_array("".join(self.text), batched=True)),
                        ("stream_id", np.asarray([[self.sid]], np.int64)),
                        ("batch_index", np.asarray([[0]], np.int32)), ("sequence_index", np.asarray([[0]], np.int32))]
        if self.want_ids:
            out.append(("output_ids", np.asarray([self.ids], np.int32)))
        if o.return_num_input_tokens:
            out.append(("num_input_tokens", np.asarray([[self.num_input]], np.int32)))
        if o.return_num_output_tokens:
            out.append(("num_output_tokens", np.asarray([[len(self.ids)]], np.int32)))
        self.ids, self.text = [], []
        if final is None:
            return out
        out.append(("finish_reason", bytes_array(final.finish_reason or "stop", batched=True)))
        s = final.stats
        if o.return_stats and s is not None:
            accepted = sum(s.accepted_per_position)
            out += [("accepted_per_position", np.asarray([s.accepted_per_position], np.int32)),
                    ("total_accepted_draft_tokens", np.asarray([[accepted]], np.int32)),
                    ("acceptance_rate", np.asarray([[accepted / s.drafted_tokens if s.drafted_tokens else 0.0]], np.float32))]
            out += [(name, np.asarray([[getattr(s, field)]], dtype)) for name, field, dtype in STATS_OUTPUTS]
        return out
