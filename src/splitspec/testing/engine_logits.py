"""A built target engine's logits in one process: every rank in a thread of its own, summed in rank order, for
tests that compare engine numerics (against transformers, against another engine) without worker processes."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from splitspec.config import Mapping, TargetConfig
from splitspec.files import read_json
from splitspec.models.batch import ForwardBatch
from splitspec.models.kv import BLOCK_SIZE
from splitspec.models.layers import TPComm
from splitspec.models.target import TargetKVCache, TargetModel


class _ThreadGroup:
    def __init__(self, n: int):
        self.n, self.barrier, self.buf = n, threading.Barrier(n, timeout=120), [None] * n


class ThreadComm:
    """TPComm over threads of one process: all ranks of a target engine in one test, summed in rank order."""

    def __init__(self, rank: int, group: _ThreadGroup):
        self.rank, self.size, self.g = rank, group.n, group

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.g.buf[self.rank] = x.clone()
        self.g.barrier.wait()
        parts = list(self.g.buf)
        self.g.barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._gather(x)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return x.copy_(total)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._gather(x), -1)


def engine_logits(engines: Path, ids: list[int], capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full-vocabulary logits [T, V] (and captured aux states) of a built target engine over ``ids``, every rank in a thread."""
    meta = read_json(engines / "target" / "engine.json")
    cfg, mapping = TargetConfig.from_dict(meta["config"]), Mapping.from_dict(meta["mapping"])
    n = mapping.tp_size
    group, results, errors = _ThreadGroup(n), [None] * n, []

    def run(rank: int) -> None:
        try:
            w = load_file(str(engines / "target" / f"rank{rank}.safetensors"))
            comm = ThreadComm(rank, group) if n > 1 else TPComm()
            model = TargetModel(cfg, mapping, rank, w, comm)
            blocks = list(range(-(-len(ids) // BLOCK_SIZE)))
            cache = TargetKVCache(cfg, len(blocks) * BLOCK_SIZE, w["embed_tokens"].dtype, "cpu")
            with torch.inference_mode():
                results[rank] = model.forward(ForwardBatch.build([(blocks, 0, ids)], "all"), cache, capture)
        except BaseException as e:  # surfaced below
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results[0]


def assert_bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16-activation engines summing in a different order: close on average; a max is meaningless here because
    a near-tied router score in this random toy MoE can flip one token's expert choice."""
    assert (a - b).abs().mean() < 0.05 and (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
