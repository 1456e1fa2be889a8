"""Engines on their ranks: the target's tensor-parallel group and the drafter, driven by the leader.

The leader (rank 0) lives in the caller's process (the Triton ``spec_decode`` model or the CLI) and
starts ranks 1..N−1 as worker processes (``python -m splitspec.engine.worker``). All ranks join one
``torch.distributed`` group (gloo on CPU; NCCL for GPU tensors with a gloo group for the control plane),
meeting at a ``TCPStore`` the leader opens on a free loopback port (:func:`loopback_store`). Every rank runs on this
host, so their gloo sockets listen on the loopback interface too (:data:`GLOO_INTERFACE`).

Each cycle the leader broadcasts one cycle plan (:mod:`splitspec.engine.plan`); every rank executes it
(:class:`~splitspec.engine.rank.RankRunner`, eagerly or from CUDA graphs: :mod:`splitspec.engine.graphs`) from
the engine files it loaded (:mod:`splitspec.engine.engine_files`).

Draft placement: ``draft_tp=1`` — the drafter lives on the leader only (its own device, default target
rank 0's), it drafts before the plan is sent, and workers only verify. ``draft_tp=N`` — the drafter is
sharded over the target's group (the layout SGLang/vLLM/TensorRT-LLM use): every rank drafts with its
shard, paying the group's collectives on every draft step. Both can be loaded at once (per batch-size
bucket placement, ``splitspec tune``): each plan names the placement that drafts it, and a change of
placement first moves the decoding sequences' drafter K/V rows into the other layout
(:meth:`~splitspec.engine.rank.RankRunner.switch_placement`). The deployment's settings come as one
:class:`~splitspec.settings.ServeConfig`; worker ranks get the switches they need on their command line.

Benchmarks only (``fake_peers``): rank 0 of the group alone, in this process, with no workers; its collectives go
to torch.distributed's fake process group (:func:`join_fake_group`) and return at once. One GPU then runs one
rank of a TP-N engine at full size (``bench/full_depth_rank.py``); its outputs are meaningless (nothing is summed
over ranks), its compute is one rank's.
"""

from __future__ import annotations

import datetime
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from splitspec.config import TargetConfig
from splitspec.engine.engine_files import read_engine_meta
from splitspec.engine.plan import IDLE_TIMEOUT, CycleOutput, CyclePlan, EngineError
from splitspec.engine.rank import RankRunner, threads_per_rank
from splitspec.errors import ConfigError
from splitspec.models.layers import TPComm
from splitspec.settings import ServeConfig

#: Seconds close() waits for the workers to take the shutdown plan (an idle worker takes it at once; one
#: left inside a collective by an interrupted cycle never does) before it kills them.
SHUTDOWN_WAIT_S = 2.0
#: Address of the leader's TCPStore.
LOOPBACK = "127.0.0.1"
#: Network interface of the ranks' gloo sockets (``GLOO_SOCKET_IFNAME``, unless the environment names one): else
#: gloo listens on the address the host name resolves to, which may face the network.
GLOO_INTERFACE = "lo"


def join_fake_group(world: int, timeout: datetime.timedelta) -> None:
    """Make this process rank 0 of a ``world``-rank torch.distributed group whose other ranks do not exist: the fake
    process group (``torch.testing._internal.distributed.fake_pg``, backend "fake"), where every collective returns
    at once without communicating — an all-reduce leaves its tensor as it is; recent torch copies the local part into
    every slot of an all-gather. Benchmarks only. Raises EngineError when this torch has no fake process group."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    except ImportError as e:
        raise EngineError(f"fake_peers: this torch ({torch.__version__}) has no fake process group ({e})") from None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world, timeout=timeout)


def loopback_store(world: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The leader's ``TCPStore`` for ``world`` ranks, listening on a free port of 127.0.0.1 only.

    Given a port, torch's TCPStore binds it on every interface (``*:port``, whatever ``host_name`` says) and
    answers anyone unauthenticated; given a socket already listening (``master_listen_fd``), it serves that one.
    """
    listener = socket.create_server((LOOPBACK, 0))
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store owns the socket from here on
    try:
        return dist.TCPStore(LOOPBACK, port, world, is_master=True, wait_for_workers=False, timeout=timeout,
                             master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


class Group:
    """The leader's handle on the target's TP group (rank 0 here, workers started here) and the drafter.

    Args:
        cfg: the deployment: engines_dir, target_device_ids (``()``: CPU), draft_device_id (a TP1 drafter's GPU; None:
            rank 0's), kv_tokens and the switches padded, compile, cuda_graphs, skinny_gemm, pdl, collective_timeout_s.
        placements: the draft_tp values to load, 1 and/or the target's TP size (the first drafts until a plan names
            the other); None: ``(cfg.draft_tp or 1,)``.
        fake_peers: BENCHMARK ONLY — run rank 0 alone with no workers, its collectives no-ops (the module docstring);
            ``cfg.target_device_ids`` then names rank 0's GPU only (or none: CPU).
    Raises:
        ConfigError: a placement the engines cannot take. EngineError: a worker fails to start or dies.
    """

    def __init__(self, cfg: ServeConfig, placements: tuple[int, ...] | None = None, start_timeout_s: float = 300.0,
                 fake_peers: bool = False):
        self.config = cfg
        self.engines_dir = cfg.engines_dir
        device_ids, kv_tokens = list(cfg.target_device_ids), cfg.kv_tokens
        draft_tp = (cfg.draft_tp or 1,) if placements is None else placements
        meta = read_engine_meta(self.engines_dir / "target", "target")
        self.world = int(meta["mapping"]["tp_size"])
        self.placements = tuple(dict.fromkeys((draft_tp,) if isinstance(draft_tp, int) else draft_tp))
        for dtp in self.placements or (None,):
            if dtp not in (1, self.world):
                raise ConfigError(f"draft_tp = {dtp}: expected 1 (split placement) or {self.world} (sharded over the target's TP group)")
        ranks_here = 1 if fake_peers else self.world
        if device_ids and len(device_ids) != ranks_here:
            raise ConfigError(f"target engine is TP{self.world} but {len(device_ids)} target device ids were given"
                              + (" (fake_peers: rank 0's only)" if fake_peers else ""))
        if device_ids and (not torch.cuda.is_available() or max(device_ids) >= torch.cuda.device_count()):
            raise ConfigError(f"target_device_ids {device_ids}: this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA device(s)")
        self.devices = [f"cuda:{i}" for i in device_ids] if device_ids else ["cpu"] * ranks_here
        self.fake_peers = fake_peers
        draft_device = f"cuda:{cfg.draft_device_id}" if cfg.draft_device_id is not None else None
        # steady decode cycles in the static-shape form: always on GPU (CUDA graphs), opt-in on CPU
        self.padded = bool(device_ids) or cfg.padded
        if cfg.draft_ahead and not self.padded:
            warnings.warn("draft_ahead has no effect here: it acts on padded steady cycles, which run on GPUs or with "
                          "padded on (SPLITSPEC_PADDED=1)", stacklevel=2)
        timeout = datetime.timedelta(seconds=cfg.collective_timeout_s)
        self.procs: list[subprocess.Popen] = []
        self.control = None
        self.closed = False
        self._sending_plan = False  # a plan broadcast started and did not finish (interrupted: see close())
        cuda = self.devices[0].startswith("cuda")
        if cuda:
            torch.cuda.set_device(self.devices[0])
        if self.world > 1 and dist.is_initialized():
            raise EngineError("a torch.distributed group already exists in this process; one target group per process")
        if self.world > 1 and fake_peers:
            join_fake_group(self.world, timeout)
        elif self.world > 1:
            self.store = loopback_store(self.world, timeout)
            os.environ.setdefault("GLOO_SOCKET_IFNAME", GLOO_INTERFACE)  # this rank's and (inherited) the workers'
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            for r in range(1, self.world):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "splitspec.engine.worker", "--engines", str(self.engines_dir), "--rank", str(r),
                     "--world", str(self.world), "--store-port", str(self.store.port), "--device", self.devices[r],
                     "--draft-tp", ",".join(map(str, self.placements)), "--kv-tokens", str(kv_tokens or 0),
                     "--collective-timeout-s", str(cfg.collective_timeout_s)]
                    + ["--no-compile"] * (not cfg.compile) + ["--no-cuda-graphs"] * (not cfg.cuda_graphs)
                    + ["--skinny-gemm"] * cfg.skinny_gemm + ["--pdl"] * cfg.pdl, env=env))
            torch.set_num_threads(threads_per_rank(self.world))
            try:
                # join only once every worker is up: init_process_group cannot notice a worker that died
                # starting (or be interrupted by Ctrl-C) until its timeout
                self._wait_for("up", start_timeout_s)
                dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", store=self.store, rank=0,
                                        world_size=self.world, timeout=timeout)
                self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
            except BaseException:
                self._kill()
                raise
        try:
            self.rank0 = RankRunner(self.engines_dir, 0, self.world, TPComm(0, self.world), self.devices[0], self.placements,
                                    draft_device, kv_tokens, cfg.compile, cfg.cuda_graphs, cfg.skinny_gemm, cfg.pdl)
            if self.procs:
                self._wait_for("ready", start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_for(self, what: str, timeout_s: float) -> None:
        """Wait until every worker has set ``what/<rank>`` in the store, checking that each is alive (a
        Python loop: Ctrl-C interrupts it). Raises EngineError for a dead worker or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for r in range(1, self.world):
            while True:
                self.check_workers()
                if self.store.check([f"{what}/{r}"]):
                    break
                if time.monotonic() > deadline:
                    raise EngineError(f"target worker rank {r} did not become {what} in {timeout_s:.0f} s")
                time.sleep(0.05)

    @property
    def draft_tp(self) -> int:
        """The placement drafting now (1 or the target's TP size)."""
        return self.rank0.draft_tp

    @property
    def cfg(self) -> TargetConfig:
        return self.rank0.cfg

    @property
    def limits(self) -> dict:
        return self.rank0.limits

    def check_workers(self, wait_s: float = 0.0) -> None:
        """Raise EngineError if any worker process has exited. ``wait_s``: seconds to keep looking (after a collective
        failed: a killed worker's sockets close a moment before it can be reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise EngineError(f"target worker rank {r} (pid {p.pid}) exited with status {p.returncode}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)

    def run(self, plan: CyclePlan, on_launched: Callable[[], None] | None = None) -> CycleOutput:
        """Execute one cycle on every rank and return rank 0's output. A change of placement (``plan.draft_tp``)
        comes first, on every rank (:meth:`RankRunner.switch_placement`); its host time counts as draft time.
        ``on_launched``: called once the cycle's GPU work is queued, before the host waits for it."""
        if self.closed:
            raise EngineError("the engine is closed")
        r0, switch_ms = self.rank0, 0.0
        if plan.draft_tp is not None and plan.draft_tp != r0.draft_tp:
            if plan.draft_tp not in self.placements:
                raise ConfigError(f"draft_tp = {plan.draft_tp}: not loaded (placements {list(self.placements)})")
            t0 = time.perf_counter()
            if self.world > 1:
                self.check_workers()
                self._send_plan(CyclePlan(plan.work, draft_tp=plan.draft_tp, placement_switch=True))
            r0.switch_placement(plan.draft_tp, plan.work)
            switch_ms = (time.perf_counter() - t0) * 1e3
        out = self._cycle(plan, on_launched)
        out.draft_ms += switch_ms
        return out

    def _cycle(self, plan: CyclePlan, on_launched: Callable[[], None] | None) -> CycleOutput:
        r0 = self.rank0
        if self.padded:
            for sid in plan.finished:
                r0.aux.pop(sid, None)
            plan.padded_k = r0.padded_k(plan)
        if plan.padded_k is not None:
            drafts = None
            if r0.draft_tp == 1 and plan.padded_k:
                # from a drafter on its own GPU: to the GPU of rank 0's NCCL communicator (queued behind the draft)
                drafts = r0.drafts_ahead(plan)  # launched by the cycle before (draft-ahead), else drafted now
                if drafts is None:
                    r0.clock.start()
                    drafts = r0.draft_padded(plan).to(r0.device)
                    r0.clock.draft_done()
                else:
                    drafts = drafts.to(r0.device)
            if self.world > 1:
                self.check_workers()
                self._send_plan(plan)
                if drafts is not None and not self.fake_peers:  # no worker to receive them
                    dist.broadcast(drafts, 0)
            return r0.execute_padded(plan, drafts, draft_timed=drafts is not None, on_launched=on_launched)
        t0 = time.perf_counter()
        if r0.draft_tp == 1 and r0.drafter is not None:
            plan.drafts = r0.draft_phase(plan)
        draft_ms = (time.perf_counter() - t0) * 1e3
        if self.world > 1:
            self.check_workers()
            self._send_plan(plan)
        out = r0.execute(plan, on_launched)
        if r0.draft_tp == 1:
            out.draft_ms = draft_ms
        return out

    def _send_plan(self, plan: CyclePlan) -> None:
        """Broadcast ``plan`` to the workers (none with ``fake_peers``). ``broadcast_object_list`` is two broadcasts
        (size, then bytes): a KeyboardInterrupt between them leaves the workers expecting bytes, and a shutdown plan
        sent after it would be unpickled from its size header — so :meth:`close` kills the workers instead."""
        if self.fake_peers:
            return
        self._sending_plan = True
        dist.broadcast_object_list([plan], 0, group=self.control)
        self._sending_plan = False

    def _kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Stop the workers (shutdown plan, then kill stragglers) and leave the group. Idempotent."""
        if self.closed:
            return
        self.closed = True
        group, t = self.world > 1 and dist.is_initialized(), None
        if group and not self.fake_peers:
            if not self._sending_plan:  # else the control group is mid-message (see _send_plan): kill the workers
                sent = threading.Event()

                def shutdown() -> None:
                    try:
                        self.check_workers()
                        dist.broadcast_object_list([CyclePlan(work=[], shutdown=True)], 0, group=self.control)
                        sent.set()
                        for p in self.procs:
                            p.wait(timeout=10)
                    except Exception:
                        pass

                # in a thread: after an interrupted cycle a worker may sit in a collective and never take the
                # shutdown plan; killing it then releases the broadcast
                t = threading.Thread(target=shutdown, name="splitspec-group-shutdown", daemon=True)
                t.start()
                if sent.wait(timeout=SHUTDOWN_WAIT_S):  # taken: let the workers exit on their own
                    t.join(timeout=10)
            self._kill()
            if t is not None:
                t.join(timeout=5)
        # the graphs (and their memory pools) go now, with one rank too, not whenever the runner is collected; with a
        # group, after its workers and before leaving it (they hold its collectives)
        self._release_graphs()
        if group and (t is None or not t.is_alive()):  # else leaving the group could block as well; the process is ending anyway
            dist.destroy_process_group()
        self._kill()
        self.procs = []

    def _release_graphs(self) -> None:
        runner = getattr(self, "rank0", None)
        if runner is not None:
            ahead = [runner.ahead.graphs] if runner.ahead is not None else []
            for graphs in {id(g): g for g in [runner.graphs] + [slot[2] for slot in runner.slots.values()] + ahead}.values():
                graphs.clear()
            if runner.ahead is not None:
                runner.ahead.drop()  # its drafts live in the pool just released
