"""Static shapes for steady cycles: the CUDA graphs captured per batch bucket (:func:`splitspec.models.batch.bucket`)
and the pinned host buffers their int64 inputs are staged in."""

from __future__ import annotations

import math

import numpy as np
import torch

from splitspec.models.batch import field_views
from splitspec.models.fused_moe import device_index



_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw CUDA stream) -> its torch Stream object


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream`` of device ``index`` without building a Stream object per call: the raw stream is
    looked up (one C call) and its Stream object kept (torch's streams live as long as the process)."""
    key = (index, torch._C._cuda_getCurrentRawStream(index))  # the default stream is 0 on every device
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


class GraphCache:
    """CUDA graphs of static-shape functions on one device, captured on first use per key (eager on CPU or when
    not ``enabled``: ``ServeConfig.cuda_graphs``). Outputs are the graph's static output tensors, valid until the next
    replay of any graph of this cache: the graphs share one memory pool, and a graph captured later may hold its
    outputs in memory an earlier one uses for its intermediates (a replay of that one overwrites them). Inputs, per
    kind:

    - a host buffer from :meth:`staging` (pinned, one per key, the same at every call): its copy up is captured in
      the graph, so a replay is one launch with no copy queued by the host before it;
    - a buffer from :meth:`shared` (a device tensor other graphs of this cache write): read in place (another
      tensor given in its place at a later call is copied into it);
    - any other device tensor: copied by the host into the graph's static buffer before the replay.

    Capture and replay run with ``device`` current, whatever the calling thread's current device, and capture on a
    stream of this device: ``torch.cuda.graph``'s default capture stream is one per process, made on the device
    current at the first capture, and a graph captured on another device's stream records none of this
    device's kernels (its replays then return the capture-time outputs)."""

    def __init__(self, device: str, enabled: bool = True):
        self.cuda = device.startswith("cuda")
        self.on = self.cuda and enabled
        self.device = torch.device(device)
        self.graphs: dict = {}
        self.host: dict = {}  # key -> (staging buffer, its field views, event after the last call that read it, shapes)
        self.staged: list = []  # the events of the buffers handed out since the last run
        self.buffers: dict = {}  # name -> a shared device buffer (:meth:`shared`)
        self.pool = self.capture_stream = self.index = None
        if self.cuda:
            self.index = device_index(self.device)
        if self.on:
            with torch.cuda.device(self.index):
                self.pool = torch.cuda.graph_pool_handle()
                self.capture_stream = torch.cuda.Stream()

    def clear(self) -> None:
        """Drop every graph (before the process group they captured collectives of is destroyed)."""
        if self.on:
            torch.cuda.synchronize(self.device)
        self.graphs.clear()

    def staging(self, key, shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, list[np.ndarray]]:
        """The host buffer of graph ``key`` for int64 input fields of ``shapes`` laid out back to back
        (:func:`~splitspec.models.batch.field_views`): the flat tensor to pass to :meth:`run` and one numpy view per
        field, to fill in place. One buffer per key (a key's shapes are fixed), made at its first call and pinned on
        CUDA: the graph's capture records its copy up from that address (so pinned host memory grows with the keys in
        use, as the graphs do). Before handing it out again the host waits
        for the last call that read it (long complete in a steady loop, whose host waits for the GPU once a
        cycle)."""
        entry = self.host.get(key)
        if entry is None:
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for shape in shapes for d in shape):
                raise ValueError(f"graph {key}: staging shapes {shapes}, expected tuples of integers ≥ 0")
            flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=torch.int64, pin_memory=self.cuda)
            entry = self.host[key] = (flat, field_views(flat.numpy(), shapes), torch.cuda.Event() if self.cuda else None,
                                      tuple(map(tuple, shapes)))
        elif entry[3] != tuple(map(tuple, shapes)):
            raise ValueError(f"graph {key}: staging shapes {shapes} differ from its first call's {entry[3]}")
        flat, views, event, _ = entry
        if event is not None:
            event.synchronize()
            self.staged.append(event)
        return flat, views

    def shared(self, name, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A device buffer of ``shape`` kept under ``name`` (made at the first call, zeros), for graphs (or the host) to
        write and other graphs to read in place; None when graphs are off (eager runs pass tensors as they are)."""
        return self._buffer(name, shape, dtype) if self.on else None

    def _buffer(self, name, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None:
            buf = self.buffers[name] = torch.zeros(shape, dtype=dtype, device=self.device)
        elif tuple(buf.shape) != tuple(shape) or buf.dtype != dtype:
            raise ValueError(f"shared buffer {name}: {tuple(shape)} {dtype} differs from its first call's "
                             f"{tuple(buf.shape)} {buf.dtype}")
        return buf

    def _sent(self) -> None:
        """Mark the staged buffers read once the work queued so far (on the device's current stream) has run."""
        if self.staged:
            stream = current_stream(self.index)
            for event in self.staged:
                event.record(stream)
            self.staged.clear()

    def run(self, key, fn, *inputs):
        if not self.on:
            inputs = [x.to(self.device, non_blocking=True) for x in inputs]
            self._sent()
            return fn(*inputs)
        if torch.cuda.current_device() == self.index:  # the usual case: no device switch around the replay
            return self._run(key, fn, *inputs)
        with torch.cuda.device(self.index):
            return self._run(key, fn, *inputs)

    def _in_place(self, x: torch.Tensor) -> bool:
        return x.is_cuda and any(x is b for b in self.buffers.values())

    def _run(self, key, fn, *inputs):
        entry = self.graphs.get(key)
        if entry is None:
            static = [x if self._in_place(x) else x.to(self.device, copy=True) for x in inputs]
            host = [(buf, x) for buf, x in zip(static, inputs) if not x.is_cuda]  # staging buffers: copied in the graph
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*static)  # warm-up outside the graph (allocator, lazy init)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                for buf, x in host:
                    buf.copy_(x, non_blocking=True)
                outputs = fn(*static)
            entry = self.graphs[key] = (graph, static, [None if x.is_cuda else x for x in inputs], outputs)
        graph, static, captured, outputs = entry
        for buf, x, was in zip(static, inputs, captured):
            if was is not None:
                if x is not was:
                    raise ValueError(f"graph {key}: a host input other than the staging buffer it was captured with")
            elif x is not buf:  # a device input, unless it is the shared buffer the graph reads in place
                buf.copy_(x, non_blocking=True)
        graph.replay()
        self._sent()
        return outputs
