"""Static shapes for steady cycles: batch buckets, the CUDA graphs captured per bucket and the pinned host buffers
their int64 inputs are staged in."""

from __future__ import annotations

import math

import numpy as np
import torch

from splitspec.models.batch import field_views
from splitspec.models.fused_moe import device_index

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}  # (device, raw CUDA stream) -> its torch Stream object


def current_stream(index: int) -> torch.cuda.Stream:
    """``torch.cuda.current_stream`` of device ``index`` without building a Stream object per call: the raw stream is
    looked up (one C call) and its Stream object kept (torch's streams live as long as the process)."""
    key = (index, torch._C._cuda_getCurrentRawStream(index))  # the default stream is 0 on every device
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


def bucket(batch: int) -> int:
    """The smallest batch bucket holding ``batch`` sequences (padded sequences write scratch rows)."""
    return next(b for b in BATCH_BUCKETS if b >= batch) if batch <= BATCH_BUCKETS[-1] else batch


class GraphCache:
    """CUDA graphs of static-shape functions on one device, captured on first use per key (eager on CPU or when
    not ``enabled``: ``ServeConfig.cuda_graphs``). Inputs are copied into the graph's static buffers before each replay
    (host inputs, staged by :meth:`staging`, go up in that copy); outputs are the graph's static output tensors (valid
    until the next replay of the same key). Capture and replay run with ``device`` current, whatever the calling
    thread's current device, and capture on a stream
    of this device: ``torch.cuda.graph``'s default capture stream is one per process, made on the device
    current at the first capture, and a graph captured on another device's stream records none of this
    device's kernels (its replays then return the capture-time outputs)."""

    def __init__(self, device: str, enabled: bool = True):
        self.cuda = device.startswith("cuda")
        self.on = self.cuda and enabled
        self.device = torch.device(device)
        self.graphs: dict = {}
        self.host: dict = {}  # name -> (staging buffer, {shapes: (its head, field views)}, event after its last copy)
        self.staged: list = []  # the events of the buffers handed out since the last run
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

    def staging(self, name: str, shapes: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, list[np.ndarray]]:
        """A host buffer for int64 input fields of ``shapes`` laid out back to back
        (:func:`~splitspec.models.batch.field_views`): the flat tensor to pass to the next :meth:`run` and one numpy view
        per field, to fill in place. One buffer per ``name`` (a phase), reused from call to call and grown when a call
        needs more; pinned on CUDA, so its copy up does not wait for the device. Before handing it out again the host
        waits for the copy out of it that :meth:`run` queued last (long complete in a steady loop, whose host waits for
        the GPU once a cycle)."""
        flat, layouts, event = self.host.get(name, (None, None, None))
        if event is not None:
            event.synchronize()
        laid = layouts.get(shapes) if layouts is not None else None  # the usual case: these shapes had it before
        if laid is None:
            size = sum(math.prod(s) for s in shapes)
            if flat is None or flat.numel() < size:
                flat = torch.empty(size, dtype=torch.int64, pin_memory=self.cuda)
                flat, layouts, event = self.host[name] = (flat, {}, torch.cuda.Event() if self.cuda else None)
            laid = layouts[shapes] = (flat[:size], field_views(flat.numpy(), shapes))
        if event is not None:
            self.staged.append(event)
        return laid

    def _sent(self) -> None:
        """Mark the copies out of the staged buffers queued (on the device's current stream)."""
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

    def _run(self, key, fn, *inputs):
        entry = self.graphs.get(key)
        if entry is None:
            static = [x.to(self.device, copy=True) for x in inputs]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(*static)  # warm-up outside the graph (allocator, lazy init)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                outputs = fn(*static)
            entry = self.graphs[key] = (graph, static, outputs)
        graph, static, outputs = entry
        for buf, x in zip(static, inputs):
            buf.copy_(x, non_blocking=True)
        self._sent()
        graph.replay()
        return outputs
