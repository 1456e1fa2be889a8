"""The host side of :class:`splitspec.engine.graphs.GraphCache` (CPU: eager runs): one staging buffer per graph key,
its fields laid out back to back and reused call after call, shapes fixed per key; no shared buffers off the GPU.
The GPU side (the copy up inside the graph, shared buffers read in place): tests/gpu/test_gpu_graphs.py."""

from __future__ import annotations

import pytest
import torch

from splitspec.engine.graphs import GraphCache


def test_one_staging_buffer_per_key_reused_and_fields_back_to_back():
    cache = GraphCache("cpu")
    flat, (a, b) = cache.staging(("draft", 1), ((2, 3), (4,)))
    a[:] = 7
    b[:] = [1, 2, 3, 4]
    assert flat.tolist() == [7] * 6 + [1, 2, 3, 4]
    again, (a2, _) = cache.staging(("draft", 1), ((2, 3), (4,)))
    assert again.data_ptr() == flat.data_ptr() and a2.ctypes.data == a.ctypes.data
    other, _ = cache.staging(("verify", 1), ((2, 3), (4,)))
    assert other.data_ptr() != flat.data_ptr(), "each key its own buffer (a graph reads its own from its capture on)"
    with pytest.raises(ValueError, match=r"\('draft', 1\).*differ from its first call"):
        cache.staging(("draft", 1), ((2, 4), (4,)))
    with pytest.raises(ValueError, match="differ from its first call"):  # the same size, other fields
        cache.staging(("draft", 1), ((3, 2), (4,)))
    for bad in (((2, -3), (4,)), ((2.0, 3),), (("2", 3),), ((True, 3),)):
        with pytest.raises(ValueError, match=r"graph \('draft', 2\): staging shapes .*, expected tuples of integers ≥ 0"):
            cache.staging(("draft", 2), bad)


def test_eager_run_moves_inputs_and_no_shared_buffers_off_the_gpu():
    cache = GraphCache("cpu")
    assert cache.shared("aux", (2, 2), torch.float32) is None
    flat, (f,) = cache.staging("k", ((3,),))
    f[:] = [1, 2, 3]
    assert cache.run("k", lambda x: x * 2, flat).tolist() == [2, 4, 6]


def test_a_shared_buffer_keeps_its_shape_and_dtype():
    cache = GraphCache("cpu")
    cache.on = True  # what a GPU cache with graphs does; the buffer's device does not matter here
    a = cache.shared("x", (2, 2), torch.float32)
    assert cache.shared("x", (2, 2), torch.float32) is a
    with pytest.raises(ValueError, match=r"shared buffer x: \(3,\) torch.int64 differs from its first call's \(2, 2\)"):
        cache.shared("x", (3,), torch.int64)
