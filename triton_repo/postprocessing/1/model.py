"""Triton Python model ``postprocessing``: generated token ids → text.

Input: ``output_ids`` (int32 [-1], generated tokens only). Output: ``text_output``
(string [1], UTF-8, special tokens skipped). Ids outside the vocabulary get an error response.
"""

import json
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from splitspec.errors import SplitspecError
from splitspec.tokenizer import ChatTokenizer


def _error_response(message):
    """An InferenceResponse carrying ``message`` as an INVALID_ARG error (HTTP 400)."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    err = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


class TritonPythonModel:
    """Detokenises generated ids (one response per request)."""

    def initialize(self, args):
        """Load the tokenizer named by the config parameter tokenizer_dir; raises to fail the model load."""
        cfg = json.loads(args["model_config"])
        tok_dir = cfg.get("parameters", {}).get("tokenizer_dir", {}).get("string_value", "")
        if not tok_dir:
            raise SplitspecError("postprocessing/config.pbtxt: parameter 'tokenizer_dir' is empty")
        self.tokenizer = ChatTokenizer.from_dir(Path(tok_dir))

    def execute(self, requests):
        """Answer every request (an error response for a bad one); never raises."""
        responses = []
        for request in requests:
            try:
                t = pb_utils.get_input_tensor_by_name(request, "output_ids")
                if t is None:
                    raise SplitspecError("output_ids: missing")
                ids = t.as_numpy().reshape(-1).tolist()
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                out = pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))
                responses.append(pb_utils.InferenceResponse(output_tensors=[out]))
            except SplitspecError as e:
                responses.append(_error_response(f"postprocessing: {e}"))
            except Exception as e:  # never let a request take the model down
                pb_utils.Logger.log_error(f"postprocessing: {traceback.format_exc()}")
                responses.append(_error_response(f"postprocessing: internal error: {type(e).__name__}: {e}"))
        return responses

    def finalize(self):
        """Release what initialize loaded."""
        self.tokenizer = None
