"""Moving a drafter cache's rows between its two placements when the drafting placement changes
(:meth:`splitspec.engine.rank.RankRunner.switch_placement`): the TP1 drafter's copy on rank 0 and the group's shards,
through the group's collectives (every rank calls with the same rows)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def move_rows(local: torch.Tensor, full: torch.Tensor | None, rows: torch.Tensor, dim: int | None, to_shards: bool,
              rank: int, world: int, device: str) -> None:
    """Move ``rows`` (int64 row indices [R]) of one drafter cache tensor between the TP1 copy ``full`` (rank 0 only;
    None elsewhere) and this rank's shard ``local`` on ``device``, split along ``dim`` over ``world`` ranks (None: every
    rank holds it whole), towards the shards when ``to_shards`` else towards the TP1 copy.

    Split: TP1 → shards is a scatter from rank 0 (rank r receives its 1/world of ``dim`` only), shards → TP1 a gather
    to rank 0, which concatenates them along ``dim`` in rank order. Whole: TP1 → shards is a broadcast from rank 0,
    shards → TP1 a copy on rank 0."""
    full_rows = rows.to(full.device) if full is not None else None
    if dim is None:
        if to_shards:
            mine = full[full_rows].to(device) if rank == 0 else local.new_empty((len(rows), *local.shape[1:]))
            dist.broadcast(mine, src=0)
            local[rows] = mine
        elif rank == 0:
            full[full_rows] = local[rows].to(full.device)
        return
    mine = local.new_empty((len(rows), *local.shape[1:]))
    if to_shards:  # rank 0 cuts its TP1 rows along dim and sends each rank its own part only
        parts = [c.contiguous() for c in full[full_rows].to(device).chunk(world, dim)] if rank == 0 else None
        dist.scatter(mine, parts, src=0)
        local[rows] = mine
    else:  # every shard's rows to rank 0 only, which concatenates them along dim
        mine.copy_(local[rows])
        parts = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
        dist.gather(mine, parts, dst=0)
        if rank == 0:
            full[full_rows] = torch.cat(parts, dim).to(full.device)
