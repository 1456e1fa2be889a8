"""Triton Python model ``spec_decode`` (decoupled): speculative decoding with an EAGLE-3 drafter.

A thin adapter over ``splitspec.runtime.SpeculativeEngine``, which this model instance hosts:
the instance is the leader (rank 0 of the target's tensor-parallel group) and the engine starts
the other ranks as worker processes; :meth:`TritonPythonModel.finalize` stops them.

Inputs: ``input_ids`` (int32 [-1]), ``max_tokens`` (int32 [1], 1..max_tokens_limit), optional
``temperature`` (fp32 [1]; only 0 = greedy in this version), optional ``num_draft_tokens``
(int32 [1], default: the model parameter; 0 = target-only decoding). Outputs: ``output_ids``
(int32 [-1], generated tokens only), ``acceptance_length`` (fp32 [1], tokens emitted per target forward).

Parameters (rendered by ``splitspec repo``): ``engines_dir``, ``num_draft_tokens``,
``target_device_ids`` (comma-separated GPU ids, empty: CPU), ``draft_device_id``, ``draft_tp``,
``max_tokens_limit``.

This version generates each request to completion, then sends one response flagged
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. A request the engine cannot serve gets an error
response (INVALID_ARG) naming the input; execute never raises.
"""

import json
import math
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from splitspec.errors import ConfigError, SplitspecError
from splitspec.runtime import SpeculativeEngine
from splitspec.tokenizer import ChatTokenizer


def _error_response(message):
    """An InferenceResponse carrying ``message`` as an INVALID_ARG error (HTTP 400)."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    err = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def _one_value(request, name):
    """The single element of input ``name``, or None when the request lacks it."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    a = t.as_numpy()
    if a.size != 1:
        raise ConfigError(f"{name}: expected one value, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


def _parse_ids(value, what):
    value = (value or "").strip()
    if not value:
        return []
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise ConfigError(f"spec_decode/config.pbtxt: parameter '{what}' = {value!r}, "
                          "expected GPU ids like '0,1'") from None


class TritonPythonModel:
    """Hosts the speculative engine (target leader + drafter) and serves generation requests."""

    def initialize(self, args):
        """Load the tokenizer, start the engines (target group + drafter); raises to fail the model load."""
        cfg = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()}

        def param_int(name, default):
            raw = params.get(name, "").strip()
            try:
                return int(raw) if raw else default
            except ValueError:
                raise ConfigError(f"spec_decode/config.pbtxt: parameter '{name}' = {raw!r}, "
                                  "expected an integer") from None

        engines_dir = params.get("engines_dir", "")
        if not engines_dir:
            raise ConfigError("spec_decode/config.pbtxt: parameter 'engines_dir' is empty")
        self.engines_dir = Path(engines_dir)
        self.default_k = param_int("num_draft_tokens", 4)
        self.max_tokens_limit = param_int("max_tokens_limit", 4096)
        target_ids = _parse_ids(params.get("target_device_ids"), "target_device_ids")
        draft_ids = _parse_ids(params.get("draft_device_id"), "draft_device_id")
        self.tokenizer = ChatTokenizer.from_dir(self.engines_dir / "target")
        self.stop_token_ids = set(self.tokenizer.stop_token_ids)
        self.vocab_size = self.tokenizer.vocab_size
        self.engine = None
        self.engine = SpeculativeEngine.load(
            self.engines_dir,
            target_device_ids=target_ids or None,
            draft_device_id=draft_ids[0] if draft_ids else None,
            draft_tp=param_int("draft_tp", 1),
            num_draft_tokens=self.default_k,
        )
        pb_utils.Logger.log_info(
            f"spec_decode: engines {self.engines_dir} loaded (k={self.default_k}, target devices "
            f"{target_ids or 'cpu'}, draft device {draft_ids or 'rank 0'}, draft_tp {param_int('draft_tp', 1)})")

    def execute(self, requests):
        """Generate each request to completion and send one final response (or an error); never raises."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                response = self._generate(request)
            except SplitspecError as e:
                response = _error_response(f"spec_decode: {e}")
            except Exception as e:  # never let a request take the model down
                pb_utils.Logger.log_error(f"spec_decode: {traceback.format_exc()}")
                response = _error_response(f"spec_decode: internal error: {type(e).__name__}: {e}")
            try:
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # the client went away; nothing left to answer
                pb_utils.Logger.log_warn(f"spec_decode: could not send a response: {traceback.format_exc()}")
        return None

    def _generate(self, request):
        ids_t = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids_t is None:
            raise ConfigError("input_ids: missing")
        prompt = ids_t.as_numpy().reshape(-1)
        if prompt.size == 0:
            raise ConfigError("input_ids: empty prompt")
        if int(prompt.min()) < 0 or int(prompt.max()) >= self.vocab_size:
            raise ConfigError(f"input_ids: ids must lie in [0, {self.vocab_size}), got "
                              f"min {int(prompt.min())}, max {int(prompt.max())}")

        max_tokens = _one_value(request, "max_tokens")
        if max_tokens is None:
            raise ConfigError("max_tokens: missing")
        max_tokens = int(max_tokens)
        if not 1 <= max_tokens <= self.max_tokens_limit:
            raise ConfigError(f"max_tokens = {max_tokens}: expected 1..{self.max_tokens_limit}")

        temperature = _one_value(request, "temperature")
        if temperature is not None:
            temperature = float(temperature)
            if math.isnan(temperature) or temperature < 0:
                raise ConfigError(f"temperature = {temperature}: expected 0 (greedy)")
            if temperature != 0.0:
                raise ConfigError(f"temperature = {temperature}: temperature must be 0 (greedy) in this version")

        k = _one_value(request, "num_draft_tokens")
        k = self.default_k if k is None else int(k)
        if k < 0:
            raise ConfigError(f"num_draft_tokens = {k}: expected an integer >= 0 (0: target-only decoding)")

        result = self.engine.generate([int(i) for i in prompt], max_tokens, num_draft_tokens=k,
                                      stop_token_ids=self.stop_token_ids)
        out_ids = pb_utils.Tensor("output_ids", np.asarray(result.token_ids, dtype=np.int32))
        acc = pb_utils.Tensor("acceptance_length", np.asarray([result.acceptance_length], dtype=np.float32))
        return pb_utils.InferenceResponse(output_tensors=[out_ids, acc])

    def finalize(self):
        """Stop the engine: the target's worker processes exit (engine.close())."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.close()
