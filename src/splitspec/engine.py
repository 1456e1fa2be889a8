"""Loading built engines and running the target's tensor-parallel group.

The leader (rank 0) lives in the caller's process (the Triton ``spec_decode`` model or the CLI) and
starts ranks 1..N−1 as worker processes (``python -m splitspec.worker``). All ranks join one
``torch.distributed`` group (gloo on CPU; NCCL for GPU tensors with gloo for the control plane),
rendezvous through a ``TCPStore`` the leader opens on a free loopback port. The leader broadcasts
each forward's inputs; every rank runs the same forward; only the leader decides tokens, so ranks
can never diverge on near-tied logits.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from splitspec.config import DrafterConfig, Mapping, TargetConfig
from splitspec.errors import CheckpointError, SplitspecError
from splitspec.io import read_json
from splitspec.layers import TPComm
from splitspec.models.batch import ForwardBatch
from splitspec.models.drafter import DrafterKVCache, DrafterModel
from splitspec.models.target import TargetKVCache, TargetModel

OP_SHUTDOWN, OP_TARGET_FORWARD = 0, 1
HEADER = 8  # int64 slots: op, T, segments, logits rows
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("SPLITSPEC_COLLECTIVE_TIMEOUT_S", "300")))


class EngineError(SplitspecError):
    """The engine cannot serve: a worker process died or the group broke."""


def read_engine_meta(folder: Path, kind: str) -> dict:
    """Read and check ``engine.json`` of a built ``kind`` ('target' or 'drafter') engine."""
    meta = read_json(Path(folder) / "engine.json")
    if meta.get("kind") != kind:
        raise CheckpointError(f"{folder}/engine.json: kind {meta.get('kind')!r}, expected {kind!r}")
    return meta


def load_rank_weights(folder: Path, rank: int, device: str) -> dict[str, torch.Tensor]:
    path = Path(folder) / f"rank{rank}.safetensors"
    if not path.exists():
        raise CheckpointError(f"{path}: engine weights missing")
    return load_file(str(path), device=device)


class TargetRank:
    """One rank of the target engine: its model shard and its KV cache."""

    def __init__(self, folder: Path, rank: int, comm: TPComm, device: str = "cpu"):
        meta = read_engine_meta(folder, "target")
        self.cfg = TargetConfig.from_dict(meta["config"])
        self.mapping = Mapping.from_dict(meta["mapping"])
        self.limits = meta["limits"]
        weights = load_rank_weights(folder, rank, device)
        self.model = TargetModel(self.cfg, self.mapping, rank, weights, comm)
        dtype = weights["embed_tokens"].dtype
        self.cache = TargetKVCache(self.cfg, self.limits["max_batch_size"], self.limits["max_seq_len"], dtype, device)
        self.device = device

    def forward(self, batch: ForwardBatch, capture: tuple[int, ...] = ()):
        return self.model.forward(batch, self.cache, capture)


def _send_batch(batch: ForwardBatch, group) -> None:
    hdr = torch.tensor([OP_TARGET_FORWARD, batch.input_ids.numel(), len(batch.segments), batch.logits_rows.numel()] + [0] * (HEADER - 4), dtype=torch.int64)
    dist.broadcast(hdr, 0, group=group)
    dist.broadcast(batch.input_ids.cpu(), 0, group=group)
    dist.broadcast(batch.positions.cpu(), 0, group=group)
    dist.broadcast(torch.tensor(batch.segments, dtype=torch.int64).view(-1, 3), 0, group=group)
    dist.broadcast(batch.logits_rows.cpu(), 0, group=group)


def _recv_batch(group, device: str) -> ForwardBatch | None:
    hdr = torch.empty(HEADER, dtype=torch.int64)
    dist.broadcast(hdr, 0, group=group)
    op, t, nseg, nrows = hdr[:4].tolist()
    if op == OP_SHUTDOWN:
        return None
    ids, pos = torch.empty(t, dtype=torch.int64), torch.empty(t, dtype=torch.int64)
    segs, rows = torch.empty(nseg, 3, dtype=torch.int64), torch.empty(nrows, dtype=torch.int64)
    for x in (ids, pos, segs, rows):
        dist.broadcast(x, 0, group=group)
    return ForwardBatch(ids.to(device), pos.to(device), [tuple(s) for s in segs.tolist()], rows.to(device))


def worker_loop(folder: Path, rank: int, world: int, store_port: int, device: str) -> None:
    """Body of a worker rank: join the group, load the shard, run forwards until shutdown."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo") if device.startswith("cuda") else None
    target = TargetRank(folder, rank, TPComm(rank, world), device)
    store.set(f"ready/{rank}", "1")
    with torch.inference_mode():
        while (batch := _recv_batch(control, device)) is not None:
            target.forward(batch)
    dist.destroy_process_group()


class TargetGroup:
    """The leader's handle on the target's TP group: rank 0 in this process, workers started here.

    Args:
        folder: built target engine folder.
        device_ids: GPU ids of ranks 0..N−1 (None: CPU).
    Raises:
        EngineError: a worker fails to start or dies.
    """

    def __init__(self, folder: Path, device_ids: list[int] | None = None, start_timeout_s: float = 300.0):
        self.folder = Path(folder)
        meta = read_engine_meta(self.folder, "target")
        self.world = int(meta["mapping"]["tp_size"])
        if device_ids and len(device_ids) != self.world:
            raise EngineError(f"target engine {folder} is TP{self.world} but {len(device_ids)} target device ids were given")
        self.devices = [f"cuda:{i}" for i in device_ids] if device_ids else ["cpu"] * self.world
        self.procs: list[subprocess.Popen] = []
        self.control = None
        if self.world > 1:
            store = dist.TCPStore("127.0.0.1", 0, self.world, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            for r in range(1, self.world):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "splitspec.worker", "--engine", str(self.folder), "--rank", str(r),
                     "--world", str(self.world), "--store-port", str(store.port), "--device", self.devices[r]], env=env))
            backend = "cpu:gloo,cuda:nccl" if self.devices[0].startswith("cuda") else "gloo"
            if dist.is_initialized():
                raise EngineError("a torch.distributed group already exists in this process; one target group per process")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))
            dist.init_process_group(backend, store=store, rank=0, world_size=self.world, timeout=COLLECTIVE_TIMEOUT)
            self.control = dist.new_group(backend="gloo") if self.devices[0].startswith("cuda") else None
            self.store = store
        self.rank0 = TargetRank(self.folder, 0, TPComm(0, self.world), self.devices[0])
        deadline = time.monotonic() + start_timeout_s
        for r in range(1, self.world):
            while True:
                self.check_workers()
                try:
                    self.store.wait([f"ready/{r}"], datetime.timedelta(seconds=1))
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        self.close()
                        raise EngineError(f"target worker rank {r} did not become ready in {start_timeout_s:.0f} s")

    @property
    def cfg(self) -> TargetConfig:
        return self.rank0.cfg

    @property
    def limits(self) -> dict:
        return self.rank0.limits

    def check_workers(self) -> None:
        """Raise EngineError if any worker process has exited."""
        for r, p in enumerate(self.procs, start=1):
            if p.poll() is not None:
                raise EngineError(f"target worker rank {r} (pid {p.pid}) exited with status {p.returncode}")

    def forward(self, batch: ForwardBatch, capture: tuple[int, ...] = ()):
        """Broadcast ``batch`` to the workers and run rank 0's forward (see TargetModel.forward)."""
        if self.world > 1:
            self.check_workers()
            _send_batch(batch, self.control)
        return self.rank0.forward(batch, capture)

    def close(self) -> None:
        """Stop the workers (shutdown command, then terminate stragglers) and leave the group."""
        if self.world > 1 and dist.is_initialized():
            try:
                self.check_workers()
                dist.broadcast(torch.tensor([OP_SHUTDOWN] + [0] * (HEADER - 1), dtype=torch.int64), 0, group=self.control)
            except Exception:
                pass
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            dist.destroy_process_group()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        self.procs = []


class Drafter:
    """The TP1 drafter engine on its own device, with its KV cache."""

    def __init__(self, folder: Path, device: str = "cpu"):
        meta = read_engine_meta(folder, "drafter")
        self.cfg = DrafterConfig.from_dict(meta["config"])
        self.capture_points = tuple(meta["capture_points"])
        self.limits = meta["limits"]
        weights = load_rank_weights(folder, 0, device)
        self.model = DrafterModel(self.cfg, weights)
        self.cache = DrafterKVCache(self.cfg, self.limits["max_batch_size"], self.limits["max_seq_len"], weights["fc"].dtype, device)
        self.device = device
