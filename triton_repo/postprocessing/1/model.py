"""Triton Python model ``postprocessing``: spec_decode's output → ``text_output``.

Inputs (all optional, at least one of the first two; each with a leading batch dimension of 1, the model being
batched like the ensemble): ``text`` (string [1, 1]: the UTF-8 text spec_decode produced — one cycle's delta when
streaming; it is already detokenised with incremental, stop-aware decoding, so it passes through unchanged),
``output_ids`` (int32 [1, n]: token ids to detokenise when no text is given, special tokens skipped; for direct
use), ``stream_id`` (int64 [1, 1]: spec_decode's id of the request). Output: ``text_output`` (string, shape [1]:
the TensorRT-LLM backend's postprocessing sends it so, and its clients read ``output[0]``).

Cancellation: when a client cancels an ensemble stream (gRPC cancel, or an HTTP
``generate_stream`` connection closed), Triton 2.51 marks the ensemble's *next* step requests
cancelled but not the spec_decode step already running. This model sees the cancelled request
first, so it tells spec_decode (a BLS request with ``cancel_stream_id``), which frees the
sequence's slot and KV blocks at its next cycle. Each stream is forwarded once. ``is_cancelled()``
is an IPC round trip to tritonserver, so a stream's requests are checked at most every
``CANCEL_POLL_S`` (:mod:`splitspec.serving.repo`), its first not at all, and requests without ``stream_id``
(nothing to forward) never.
"""

import collections
import time
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from splitspec.errors import SplitspecError
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.serving.access import make_stub_region_private
from splitspec.serving.repo import CANCEL_POLL_S
from splitspec.serving.triton import bytes_tensor, error_response, model_config, read_inputs, tensor
from splitspec.settings import parameter_flag

INPUTS = ("text", "output_ids", "stream_id")

#: How many stream ids are remembered: recently cancelled ones (each is forwarded once), and the time of
#: each recently seen stream's next cancellation check (more than any batch: spec_decode's streams at once).
RECENT_STREAMS = 1024


def _remember(recent, key, value):
    """Set ``recent[key] = value`` as the most recently seen of the ordered dict ``recent``, forgetting the least
    recently seen keys beyond :data:`RECENT_STREAMS`."""
    recent[key] = value
    recent.move_to_end(key)
    while len(recent) > RECENT_STREAMS:
        recent.popitem(last=False)


class TritonPythonModel:
    """Produces text_output (one response per request) and forwards cancellations."""

    def initialize(self, args):
        """Load the tokenizer named by the config parameter tokenizer_dir; raises to fail the model load."""
        make_stub_region_private()  # before the first request (no-op where the seccomp filter kept it 0600)
        params = model_config(args)[1]
        tok_dir = params.get("tokenizer_dir", "")
        if not tok_dir:
            raise SplitspecError("postprocessing/config.pbtxt: parameter 'tokenizer_dir' is empty")
        remote = parameter_flag(params, "trust_remote_code", "postprocessing/config.pbtxt")
        self.tokenizer = ChatTokenizer.from_dir(Path(tok_dir), trust_remote_code=remote)
        self.cancel_model = params.get("cancel_model", "spec_decode") or "spec_decode"
        self.cancelled = collections.OrderedDict()  # stream_id -> True, forwarded
        self.next_check = collections.OrderedDict()  # stream_id -> time.monotonic() of its next is_cancelled()

    def execute(self, requests):
        """Answer every request (an error response for a bad one); never raises."""
        responses = []
        for request in requests:
            try:
                inputs = read_inputs(request, INPUTS)
                sid = self._stream_id(inputs)
                if sid is not None and sid not in self.cancelled and self._check_due(sid) and request.is_cancelled():
                    # answered normally all the same: an error response here leaves the cancelled
                    # ensemble request waiting forever for spec_decode's last response (Triton 2.51),
                    # which blocks unloading the models
                    self._forward_cancel(sid)
                responses.append(self._execute_one(inputs))
            except SplitspecError as e:
                responses.append(error_response(f"postprocessing: {e}"))
            except Exception as e:  # never let a request take the model down
                pb_utils.Logger.log_error(f"postprocessing: {traceback.format_exc()}")
                responses.append(error_response(f"postprocessing: internal error: {type(e).__name__}: {e}", "INTERNAL"))
        return responses

    def _execute_one(self, inputs):
        if "text" in inputs:
            a = inputs["text"].reshape(-1)
            if a.size != 1:
                raise SplitspecError(f"text: expected one string, got {a.size}")
            text = a[0] if isinstance(a[0], bytes) else str(a[0]).encode("utf-8")
        else:
            if "output_ids" not in inputs:
                raise SplitspecError("text or output_ids: one of them is needed")
            text = self.tokenizer.decode(inputs["output_ids"].reshape(-1).tolist(), skip_special_tokens=True)
        return pb_utils.InferenceResponse(output_tensors=[bytes_tensor("text_output", text)])

    @staticmethod
    def _stream_id(inputs):
        """The request's ``stream_id`` input (spec_decode's id of the stream), or None without one."""
        if "stream_id" not in inputs:
            return None
        a = inputs["stream_id"].reshape(-1)
        if a.size != 1:
            raise SplitspecError(f"stream_id: expected one value, got {a.size}")
        return int(a[0])

    def _check_due(self, sid):
        """Whether stream ``sid``'s request is to be checked for cancellation now (not its first; then every
        ``CANCEL_POLL_S``)."""
        now = time.monotonic()
        due = self.next_check.get(sid)
        if due is not None and now < due:
            self.next_check.move_to_end(sid)  # least recently seen first: a live stream is never the one dropped
            return False
        _remember(self.next_check, sid, now + CANCEL_POLL_S)
        return due is not None

    def _forward_cancel(self, sid):
        """Ask spec_decode to cancel stream ``sid`` (its request here was cancelled); once per stream."""
        if sid in self.cancelled:
            return
        _remember(self.cancelled, sid, True)
        try:
            bls = pb_utils.InferenceRequest(
                model_name=self.cancel_model,
                inputs=[tensor("cancel_stream_id", [[sid]], np.int64)],
                requested_output_names=[])
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    pb_utils.Logger.log_warn(f"postprocessing: cancelling stream {sid}: {response.error().message()}")
        except Exception:
            pb_utils.Logger.log_warn(f"postprocessing: cancelling stream {sid} failed: {traceback.format_exc()}")

    def finalize(self):
        """Release what initialize loaded."""
        self.tokenizer = None
