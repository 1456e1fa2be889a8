"""The Triton Python backend's side of the three models in ``triton_repo/``: errors, inputs, tensors.

The only library module that uses ``triton_python_backend_utils`` (``pb_utils``), which exists only inside
the Python backend's stub: it is imported when a function here first needs it, so importing this module
anywhere else is harmless. Request checking itself is Triton-free (:mod:`splitspec.serving.requests`); these
functions turn a Triton request into the plain values it takes and plain values back into Triton responses.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import numpy as np

#: Triton error codes an error response may carry, with the HTTP status each becomes at ``/infer``. Triton 2.51's
#: generate endpoints answer every error response of a model with 400, and its gRPC streams carry the message only
#: (measured: tests/serving/test_faults_admission.py).
ERROR_CODES = {"INVALID_ARG": 400, "UNAVAILABLE": 503, "INTERNAL": 500}


def _pb():
    import triton_python_backend_utils as pb_utils  # only inside the stub

    return pb_utils


def error_response(message: str, code: str = "INVALID_ARG"):
    """An ``InferenceResponse`` carrying ``message`` as a Triton error with ``code`` (INVALID_ARG → HTTP 400,
    UNAVAILABLE → 503, INTERNAL → 500; a code this backend does not know is left out)."""
    pb = _pb()
    c = getattr(pb.TritonError, code, None)
    err = pb.TritonError(message, c) if c is not None else pb.TritonError(message)
    return pb.InferenceResponse(output_tensors=[], error=err)


def read_inputs(request, names: Iterable[str]) -> dict[str, np.ndarray]:
    """``{name: array}`` of the inputs ``names`` the request carries (absent ones left out), the mapping
    :mod:`splitspec.serving.requests` reads."""
    pb = _pb()
    out = {}
    for name in names:
        t = pb.get_input_tensor_by_name(request, name)
        if t is not None:
            out[name] = t.as_numpy()
    return out


def tensor(name: str, values, dtype) -> object:
    """A ``pb_utils.Tensor`` named ``name`` holding ``values`` as a NumPy array of ``dtype``."""
    return _pb().Tensor(name, np.asarray(values, dtype=dtype))


def bytes_array(value: str | bytes, batched: bool = False) -> np.ndarray:
    """A one-element TYPE_STRING array (object dtype; str as UTF-8 bytes): shape [1], or [1, 1] when ``batched``
    (an output of a model with ``max_batch_size`` > 0 that goes on to another model of the ensemble)."""
    data = value.encode("utf-8") if isinstance(value, str) else value
    return np.array([[data]] if batched else [data], dtype=np.object_)


def bytes_tensor(name: str, value: str | bytes, batched: bool = False) -> object:
    """A one-element TYPE_STRING ``pb_utils.Tensor`` named ``name`` holding :func:`bytes_array` of ``value``."""
    return _pb().Tensor(name, bytes_array(value, batched))


def response(outputs: Iterable[tuple[str, np.ndarray]]) -> object:
    """A ``pb_utils.InferenceResponse`` whose output tensors are ``outputs`` ((name, array) pairs, in order)."""
    pb = _pb()
    return pb.InferenceResponse(output_tensors=[pb.Tensor(name, array) for name, array in outputs])


def model_config(args: Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """The model's name and its ``config.pbtxt`` string parameters, from ``initialize``'s ``args``."""
    cfg = json.loads(args["model_config"])
    name = args.get("model_name") or cfg.get("name", "")
    params = {k: (v or {}).get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
    return name, params
