"""A target worker rank (ranks 1..N−1, started by :class:`splitspec.engine.group.Group`): :func:`worker_loop` joins
the group, loads this rank's shards and executes cycle plans until the shutdown plan. Entry point:
``python -m splitspec.engine.worker --engines DIR --rank R --world N --store-port P [--device cuda:R] [--draft-tp 1,N]``.

The leader's :class:`splitspec.settings.ServeConfig` switches arrive as options (``--no-compile``,
``--no-cuda-graphs``, ``--skinny-gemm``, ``--pdl``, ``--collective-timeout-s``); a worker reads no ``SPLITSPEC_*`` variable."""

import signal

# Ctrl-C in a terminal reaches every process of the group: rank 0 handles it and stops this rank (shutdown plan,
# or a kill if it is stuck in a collective). Ignored before the imports below, which take seconds (torch): a
# Ctrl-C during them would otherwise end this rank with a KeyboardInterrupt traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)

import argparse  # noqa: E402
import datetime  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from splitspec.models.batch import bucket  # noqa: E402
from splitspec.engine.group import LOOPBACK  # noqa: E402
from splitspec.engine.plan import IDLE_TIMEOUT, CyclePlan  # noqa: E402
from splitspec.engine.rank import RankRunner, threads_per_rank  # noqa: E402
from splitspec.models.layers import TPComm  # noqa: E402


def worker_loop(engines_dir: Path, rank: int, world: int, store_port: int, device: str, placements: tuple[int, ...],
                kv_tokens: int | None = None, compile: bool = True, cuda_graphs: bool = True,
                collective_timeout_s: int = 300, skinny_gemm: bool = False, pdl: bool = False) -> None:
    """Body of a worker rank: join the group, load its shards, execute plans until shutdown. The switches are
    the leader's :class:`ServeConfig`'s, passed on the worker's command line."""
    torch.set_num_threads(threads_per_rank(world))
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    store = dist.TCPStore(LOOPBACK, store_port, world, is_master=False, timeout=timeout)
    store.set(f"up/{rank}", "1")
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    runner = RankRunner(engines_dir, rank, world, TPComm(rank, world), device, placements, kv_tokens=kv_tokens,
                        compile=compile, cuda_graphs=cuda_graphs, skinny_gemm=skinny_gemm, pdl=pdl)
    store.set(f"ready/{rank}", "1")
    with torch.inference_mode():
        while True:
            box = [None]
            dist.broadcast_object_list(box, 0, group=control)
            plan: CyclePlan = box[0]
            if plan.shutdown:
                runner.graphs.clear()
                break
            if plan.placement_switch:
                runner.switch_placement(plan.draft_tp, plan.work)
                continue
            if plan.padded_k is not None:
                drafts = None
                if runner.draft_tp == 1 and plan.padded_k:
                    drafts = torch.empty(bucket(len(plan.work)), plan.padded_k, dtype=torch.int64, device=device)
                    dist.broadcast(drafts, 0)
                for sid in plan.finished:
                    runner.aux.pop(sid, None)
                runner.execute_padded(plan, drafts)
            else:
                runner.execute(plan)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--engines", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--draft-tp", default="1", help="comma list: the drafter placements loaded (1 and/or N)")
    p.add_argument("--kv-tokens", type=int, default=0, help="KV token budget (0: the engine's default)")
    p.add_argument("--no-compile", action="store_true", help="do not torch.compile the target's layers")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run steady cycles eagerly, without CUDA graphs")
    p.add_argument("--skinny-gemm", action="store_true", help="the target's bf16 linears of ≤ 8 tokens through the skinny-GEMM kernel")
    p.add_argument("--pdl", action="store_true", help="compiled parts' Triton kernels with programmatic dependent launch")
    p.add_argument("--collective-timeout-s", type=int, default=300, help="how long a collective may wait, seconds")
    a = p.parse_args()
    try:
        worker_loop(Path(a.engines), a.rank, a.world, a.store_port, a.device, tuple(int(x) for x in a.draft_tp.split(",")),
                    a.kv_tokens or None, compile=not a.no_compile, cuda_graphs=not a.no_cuda_graphs,
                    collective_timeout_s=a.collective_timeout_s, skinny_gemm=a.skinny_gemm, pdl=a.pdl)
    except RuntimeError as e:
        if "Connection closed by peer" not in str(e):
            raise
        # rank 0 went away without a shutdown plan (killed): its own failure is what gets reported
        sys.exit(f"splitspec worker rank {a.rank}: rank 0 closed the group's connection; exiting")


if __name__ == "__main__":
    main()
