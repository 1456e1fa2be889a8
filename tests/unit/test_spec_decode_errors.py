"""spec_decode's error responses for requests that end with an error event (triton_repo/spec_decode/1/model.py,
``_deliver``), against the stand-in ``triton_python_backend_utils`` and without an engine process: a request that
failed alone while the engine serves on is an internal error (INTERNAL, and 500 ``server_error`` at the OpenAI
front), one ended because the engine stopped serving or is stopping stays UNAVAILABLE (503)."""

from __future__ import annotations

import importlib.util
import threading
import types
from pathlib import Path

import pytest
from test_triton_adapter import _TritonError, pb  # noqa: F401  (the stand-in pb_utils fixture)

from splitspec.runtime.types import RequestOutput
from splitspec.serving import openai_errors
from splitspec.serving.metrics import MetricsCollector
from splitspec.serving.requests import StreamOptions
from splitspec.serving.responses import Stream

MODEL = Path(__file__).resolve().parents[2] / "triton_repo" / "spec_decode" / "1" / "model.py"
NAN_SAMPLED = "sampling: draw: weights sum to 0, NaN or inf, expected a finite sum > 0 (NaN or inf in the logits?)"
NAN_GREEDY = "sampling: greedy: the target's logits at verified row 0 are NaN or inf, expected finite values"
DEAD = "target worker rank 1 (pid 1234) exited with status -9"


class _Sender:
    def __init__(self):
        self.sent = []

    def send(self, response=None, flags=0):
        self.sent.append((response, flags))


@pytest.fixture
def spec_decode(pb):  # noqa: F811
    """spec_decode's model module, loaded over the stand-in pb_utils."""
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    pb.Logger = types.SimpleNamespace(log_info=print, log_warn=print, log_error=print, log_verbose=print)
    spec = importlib.util.spec_from_file_location("spec_decode_model_under_test", MODEL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(mod, failure=None, engine_error=None, stopping=False):
    """A model as ``initialize`` leaves it, but with a stand-in for the engine process (its ``error`` only)."""
    m = mod.TritonPythonModel.__new__(mod.TritonPythonModel)
    m.failure, m.engine = failure, types.SimpleNamespace(error=engine_error)
    m.stopping = threading.Event()
    if stopping:
        m.stopping.set()
    m.lock, m.send_lock, m.streams, m.collector = threading.Lock(), threading.RLock(), {}, MetricsCollector()
    return m


def _answer(m, ev):
    """Deliver ``ev`` to a fresh open stream of ``m``; the one error response it got."""
    sender = _Sender()
    st = Stream(7, sender, StreamOptions(), 3)
    m.streams[st.sid] = st
    m._deliver(st, ev, False)
    assert st.done and st.sid not in m.streams and len(sender.sent) == 1
    response, flags = sender.sent[0]
    assert flags == 1 and response.output_tensors == []
    return response.error


@pytest.mark.parametrize("why", [NAN_SAMPLED, NAN_GREEDY])
def test_a_request_that_fails_alone_is_an_internal_error(spec_decode, why):
    """NaN or inf logits end one request while the engine serves on: INTERNAL (500), not UNAVAILABLE (503, "the
    server is unavailable"), and the OpenAI front end answers 500 server_error; the message says the engine goes on."""
    err = _answer(_model(spec_decode), RequestOutput(4, [], "", True, "error", None, why))
    assert err.code == _TritonError.INTERNAL
    assert err.message == f"spec_decode: internal error in this request (the engine serves on): {why}"
    assert "generation failed" not in err.message and spec_decode.RECOVERY_HINT not in err.message
    api = openai_errors.ensemble_error(f"in ensemble 'ensemble', {err.message}")  # as the gRPC stream carries it
    assert (api.status, api.type, api.code) == (500, "server_error", "internal_error")


@pytest.mark.parametrize("state", [{"failure": DEAD}, {"engine_error": DEAD}])
def test_requests_ended_by_a_dead_engine_stay_unavailable(spec_decode, state):
    """The engine stopped serving (a worker died): every open request is UNAVAILABLE with the recovery hint, 503 at
    the OpenAI front end."""
    err = _answer(_model(spec_decode, **state), RequestOutput(4, [], "", True, "error", None, DEAD))
    assert err.code == _TritonError.UNAVAILABLE
    assert err.message == f"spec_decode: generation failed: {DEAD}{spec_decode.RECOVERY_HINT}"
    api = openai_errors.ensemble_error(f"in ensemble 'ensemble', {err.message}")
    assert (api.status, api.type, api.code) == (503, "service_unavailable", "service_unavailable")


@pytest.mark.parametrize("m_state,ev_id,why", [
    ({}, -1, "the server is shutting down: not admitting new requests"),  # a submit refused: the engine stops
    ({}, -1, f"engine is not ready: {DEAD}"),  # refused before the "failed" message reached the model
    ({"stopping": True}, 4, "the model is being unloaded"),  # finalize
])
def test_requests_refused_or_ended_by_a_stopping_engine_stay_unavailable(spec_decode, m_state, ev_id, why):
    err = _answer(_model(spec_decode, **m_state), RequestOutput(ev_id, [], "", True, "error", None, why))
    assert err.code == _TritonError.UNAVAILABLE and err.message == f"spec_decode: generation failed: {why}"
    assert openai_errors.ensemble_error(err.message).status == 503
