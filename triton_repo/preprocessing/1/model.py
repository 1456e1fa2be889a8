"""Triton Python model ``preprocessing``: prompt text → token ids.

Inputs: ``text_input`` (string [1]); optional ``apply_chat_template`` (bool [1], default false:
the raw prompt is completed; true: the prompt becomes one user message in the tokenizer's chat
template). Output: ``input_ids`` (int32 [-1]). The tokenizer is ``splitspec.runtime.tokenizer.ChatTokenizer``
loaded from the parameter ``tokenizer_dir`` (the target engine's folder). A bad request gets an
error response naming the input; the model keeps serving.
"""

import json
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from splitspec.errors import SplitspecError
from splitspec.runtime.tokenizer import ChatTokenizer


def _error_response(message):
    """An InferenceResponse carrying ``message`` as an INVALID_ARG error (HTTP 400)."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    err = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def _one_value(request, name):
    """The single element of optional input ``name``, or None when the request lacks it."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    if a.size != 1:
        raise SplitspecError(f"{name}: expected one value, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


class TritonPythonModel:
    """Tokenises prompts (one response per request)."""

    def initialize(self, args):
        """Load the tokenizer named by the config parameter tokenizer_dir; raises to fail the model load."""
        cfg = json.loads(args["model_config"])
        tok_dir = cfg.get("parameters", {}).get("tokenizer_dir", {}).get("string_value", "")
        if not tok_dir:
            raise SplitspecError("preprocessing/config.pbtxt: parameter 'tokenizer_dir' is empty")
        self.tokenizer = ChatTokenizer.from_dir(Path(tok_dir))

    def execute(self, requests):
        """Answer every request (an error response for a bad one); never raises."""
        responses = []
        for request in requests:
            try:
                responses.append(self._execute_one(request))
            except SplitspecError as e:
                responses.append(_error_response(f"preprocessing: {e}"))
            except Exception as e:  # never let a request take the model down
                pb_utils.Logger.log_error(f"preprocessing: {traceback.format_exc()}")
                responses.append(_error_response(f"preprocessing: internal error: {type(e).__name__}: {e}"))
        return responses

    def _execute_one(self, request):
        raw = _one_value(request, "text_input")
        if raw is None:
            raise SplitspecError("text_input: missing")
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise SplitspecError("text_input: not valid UTF-8") from None
        else:
            text = str(raw)
        if not text:
            raise SplitspecError("text_input: empty prompt")
        chat = _one_value(request, "apply_chat_template")
        if chat is not None and bool(chat):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True)
        ids = self.tokenizer.encode(text)
        if not ids:
            raise SplitspecError("text_input: the prompt encodes to no tokens")
        out = pb_utils.Tensor("input_ids", np.asarray(ids, dtype=np.int32))
        return pb_utils.InferenceResponse(output_tensors=[out])

    def finalize(self):
        """Release what initialize loaded."""
        self.tokenizer = None
