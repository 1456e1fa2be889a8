"""serving.responses on its own (no Triton): the outputs of spec_decode's responses, their names, dtypes and shapes
(a leading batch dimension of 1), what a stream holds between responses and the final response's statistics."""

from __future__ import annotations

import numpy as np
import pytest

from splitspec.runtime.types import RequestOutput, RequestStats
from splitspec.serving.repo import CANCEL_POLL_S
from splitspec.serving.requests import StreamOptions
from splitspec.serving.responses import STATS_OUTPUTS, Stream


def outputs(stream: Stream, final: RequestOutput | None = None) -> dict[str, np.ndarray]:
    out = stream.take_outputs(final)
    names = [n for n, _ in out]
    assert len(names) == len(set(names)), names
    return dict(out)


def test_a_streamed_delta_carries_text_ids_and_counts():
    st = Stream(7, None, StreamOptions(stream=True, return_token_ids=True, return_num_input_tokens=True,
                                       return_num_output_tokens=True), num_input=5)
    assert not st.has_delta()
    st.add(RequestOutput(7, [11, 12], "hé"))
    st.add(RequestOutput(7, [13], ""))
    assert st.has_delta()
    out = outputs(st)
    assert list(out) == ["output_text", "stream_id", "batch_index", "sequence_index", "output_ids", "num_input_tokens",
                         "num_output_tokens"]
    assert out["output_text"].dtype == np.object_ and out["output_text"].tolist() == [["hé".encode()]]
    assert out["stream_id"].dtype == np.int64 and out["stream_id"].tolist() == [[7]]
    assert out["output_ids"].dtype == np.int32 and out["output_ids"].tolist() == [[11, 12, 13]]
    assert out["num_input_tokens"].tolist() == [[5]] and out["num_output_tokens"].tolist() == [[3]]
    assert all(a.shape[0] == 1 and a.ndim == 2 for a in out.values())
    assert not st.has_delta() and outputs(st)["output_ids"].shape == (1, 0)  # nothing is held after a response


def test_ids_alone_are_a_delta_only_when_asked_for_and_only_when_streaming():
    for options, delta in ((StreamOptions(stream=True), False), (StreamOptions(stream=True, return_token_ids=True), True),
                           (StreamOptions(return_token_ids=True), False)):
        st = Stream(1, None, options, 1)
        st.add(RequestOutput(1, [4], ""))  # a token that completes no character yet
        assert st.has_delta() is delta, options
        assert ("output_ids" in outputs(st)) is options.return_token_ids


def test_final_response_has_the_reason_and_the_statistics():
    stats = RequestStats(num_prompt_tokens=3, accepted_per_position=[4, 2, 1], drafted_tokens=14, acceptance_length=2.5,
                         queue_ms=1.5, ttft_ms=2.0, e2e_ms=9.0, draft_ms=3.0, verify_ms=4.0)
    st = Stream(2, None, StreamOptions(return_stats=True, echo="Q: "), 3)
    final = RequestOutput(2, [7], "c", True, "length", stats)
    for ev in (RequestOutput(2, [5, 6], "ab"), final):  # as spec_decode does: every event added, the last one also ends
        st.add(ev)
    out = outputs(st, final)
    assert out["output_text"].tolist() == [["Q: abc".encode()]]  # the echoed prompt leads
    assert out["finish_reason"].tolist() == [[b"length"]]
    assert out["accepted_per_position"].dtype == np.int32 and out["accepted_per_position"].tolist() == [[4, 2, 1]]
    assert out["total_accepted_draft_tokens"].tolist() == [[7]]
    assert out["acceptance_rate"].dtype == np.float32 and out["acceptance_rate"][0, 0] == pytest.approx(0.5)
    for name, field, dtype in STATS_OUTPUTS:
        assert out[name].dtype == dtype and out[name][0, 0] == pytest.approx(getattr(stats, field)), name
    plain = outputs(Stream(3, None, StreamOptions(), 1), RequestOutput(3, [], "", True, None, RequestStats()))
    assert plain["finish_reason"].tolist() == [[b"stop"]] and "acceptance_rate" not in plain


def test_no_drafts_means_acceptance_rate_zero():
    st = Stream(4, None, StreamOptions(return_stats=True), 1)
    out = outputs(st, RequestOutput(4, [], "", True, "stop", RequestStats(accepted_per_position=[])))
    assert out["acceptance_rate"].tolist() == [[0.0]] and out["accepted_per_position"].shape == (1, 0)


def test_cancel_polls_are_spaced():
    st = Stream(5, None, StreamOptions(), 1)
    t = st.next_poll
    assert not st.poll_due(t - CANCEL_POLL_S / 2)
    assert st.poll_due(t) and st.next_poll == pytest.approx(t + CANCEL_POLL_S)
    assert not st.poll_due(t + CANCEL_POLL_S / 2)
