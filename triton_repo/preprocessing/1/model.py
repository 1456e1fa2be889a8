"""Triton Python model ``preprocessing``: prompt text → token ids.

Inputs: ``text_input`` (string [1, 1], required, at most the parameter ``max_prompt_bytes`` UTF-8 bytes: a longer
prompt is refused before it is tokenised); optional ``apply_chat_template`` (bool [1, 1], default false:
the raw prompt is completed; true: the prompt becomes one user message in the tokenizer's chat
template). Output: ``input_ids`` (int32 [1, n]). Batched like the ensemble (``max_batch_size`` 1: one prompt
per request). The tokenizer is ``splitspec.runtime.tokenizer.ChatTokenizer`` loaded from the parameter
``tokenizer_dir`` (the target engine's folder: ``tokenizer.json`` or Kimi's ``tiktoken.model``; Python code there
only with the parameter ``trust_remote_code`` = 1). A bad request gets an
error response naming the input; the model keeps serving.
"""

import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from splitspec.errors import SplitspecError
from splitspec.runtime.tokenizer import ChatTokenizer
from splitspec.serving.access import make_stub_region_private
from splitspec.serving.requests import prompt_text, scalar
from splitspec.serving.triton import error_response, model_config, read_inputs, tensor
from splitspec.settings import parameter_flag

INPUTS = ("text_input", "apply_chat_template")


class TritonPythonModel:
    """Tokenises prompts (one response per request)."""

    def initialize(self, args):
        """Load the tokenizer named by the config parameter tokenizer_dir; raises to fail the model load."""
        make_stub_region_private()  # before the first request (no-op where the seccomp filter kept it 0600)
        params = model_config(args)[1]
        tok_dir = params.get("tokenizer_dir", "")
        if not tok_dir:
            raise SplitspecError("preprocessing/config.pbtxt: parameter 'tokenizer_dir' is empty")
        remote = parameter_flag(params, "trust_remote_code", "preprocessing/config.pbtxt")
        raw = params.get("max_prompt_bytes", "").strip()
        if not raw.isdigit() or int(raw) < 1:
            raise SplitspecError(f"preprocessing/config.pbtxt: parameter 'max_prompt_bytes' = {raw!r}, expected "
                                 "bytes ≥ 1")
        self.max_prompt_bytes = int(raw)
        self.tokenizer = ChatTokenizer.from_dir(Path(tok_dir), trust_remote_code=remote)

    def execute(self, requests):
        """Answer every request (an error response for a bad one); never raises."""
        responses = []
        for request in requests:
            try:
                responses.append(self._execute_one(request))
            except SplitspecError as e:
                responses.append(error_response(f"preprocessing: {e}"))
            except Exception as e:  # never let a request take the model down
                pb_utils.Logger.log_error(f"preprocessing: {traceback.format_exc()}")
                responses.append(error_response(f"preprocessing: internal error: {type(e).__name__}: {e}"))
        return responses

    def _execute_one(self, request):
        inputs = read_inputs(request, INPUTS)
        text = prompt_text(inputs, self.max_prompt_bytes)  # the byte limit is checked before anything else
        chat = scalar(inputs, "apply_chat_template")
        if chat is not None and bool(chat):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                      add_generation_prompt=True)
        ids = self.tokenizer.encode(text)
        if not ids:
            raise SplitspecError("text_input: the prompt encodes to no tokens")
        return pb_utils.InferenceResponse(output_tensors=[tensor("input_ids", [ids], np.int32)])

    def finalize(self):
        """Release what initialize loaded."""
        self.tokenizer = None
