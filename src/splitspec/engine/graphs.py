"""Static shapes for steady cycles: batch buckets and the CUDA graphs captured per bucket."""

from __future__ import annotations

import torch

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(batch: int) -> int:
    """The smallest batch bucket holding ``batch`` sequences (padded sequences write scratch rows)."""
    return next(b for b in BATCH_BUCKETS if b >= batch) if batch <= BATCH_BUCKETS[-1] else batch


class GraphCache:
    """CUDA graphs of static-shape functions on one device, captured on first use per key (eager on CPU or when
    not ``enabled``: ``ServeConfig.cuda_graphs``). Inputs are copied into the graph's static buffers before each replay;
    outputs are the graph's static output tensors (valid until the next replay of the same key). Capture and
    replay run with ``device`` current, whatever the calling thread's current device, and capture on a stream
    of this device: ``torch.cuda.graph``'s default capture stream is one per process, made on the device
    current at the first capture, and a graph captured on another device's stream records none of this
    device's kernels (its replays then return the capture-time outputs)."""

    def __init__(self, device: str, enabled: bool = True):
        self.on = device.startswith("cuda") and enabled
        self.device = torch.device(device)
        self.graphs: dict = {}
        self.pool = self.capture_stream = None
        if self.on:
            with torch.cuda.device(self.device):
                self.pool = torch.cuda.graph_pool_handle()
                self.capture_stream = torch.cuda.Stream()

    def clear(self) -> None:
        """Drop every graph (before the process group they captured collectives of is destroyed)."""
        if self.on:
            torch.cuda.synchronize(self.device)
        self.graphs.clear()

    def run(self, key, fn, *inputs):
        if not self.on:
            return fn(*inputs)
        with torch.cuda.device(self.device):
            return self._run(key, fn, *inputs)

    def _run(self, key, fn, *inputs):
        entry = self.graphs.get(key)
        if entry is None:
            static = [x.clone() for x in inputs]
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
        graph.replay()
        return outputs
