"""Soak under faults: the served demo pair at ``--streams`` concurrent clients for ``--minutes`` while faults are
injected; reports lost, duplicated and mismatched greedy responses among the requests no fault touched, the time
from each fault to ready again, and the memory (RSS) of every process of the pipeline over time.

It runs ``splitspec serve`` (the supervisor under test) on a repository rendered for ``--engines`` (continuous
batching up to ``--streams`` sequences), keeps ``--streams`` clients busy — each sends greedy requests of
``--max-tokens`` tokens over the three doors in turn (gRPC stream, HTTP server-sent events, HTTP generate) — and
every ``--fault-every-s`` injects the next fault of a cycle: SIGKILL of the spec_decode, preprocessing or
postprocessing stub, of the engine process or of a target worker, and clients vanishing (a batch of
requests dropped mid-generation). A request is *hit* when its time overlaps a fault's window (fault → ready again;
for vanishing clients, the dropped requests). Among the others: *lost* = ended in an error or without an answer,
*duplicated* = more than one final response, *mismatched* = token ids other than the reference (target-only
greedy decoding in this process, independent of the server and the drafter).

Writes ``soak.json`` (the summary, every fault, RSS samples per role) and ``soak.png`` (RSS per role over time,
faults marked) to ``--out``. Usage::

    .venv/bin/python bench/soak.py --engines engines/demo --minutes 10

RSS "flat": per role, the median of the last quarter of the run against the median of the second quarter (after
warm-up), reported as a ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from splitspec.errors import SplitspecError
from splitspec.files import write_json, write_png
from splitspec.serving.client import ask_http, stream_grpc, stream_http
from splitspec.serving.process_tree import pipeline_processes
from splitspec.serving.repo import render_repo
from splitspec.serving.tritonserver import free_ports
from splitspec.settings import ServeConfig

FAULTS = ("spec_decode stub", "clients vanish", "engine process", "preprocessing stub", "target worker rank 1",
          "postprocessing stub")
DOORS = ("grpc", "sse", "http")
PROMPTS = [f"{head}{i}" for i in range(8) for head in
           ("def f", "x = ", "class C", "import m", "# note ", "for i in range(", "print(", "return ")]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def reference(engines: Path, max_tokens: int) -> dict[str, list[int]]:
    from splitspec.runtime.scheduler import SpeculativeEngine
    from splitspec.runtime.tokenizer import ChatTokenizer
    from splitspec.runtime.types import Request

    tok = ChatTokenizer.from_dir(engines / "target")
    with SpeculativeEngine.load(ServeConfig(engines, num_draft_tokens=0, max_batch_size=len(PROMPTS))) as eng:
        results = eng.run([Request(tok.encode(p), max_tokens, num_draft_tokens=0) for p in PROMPTS])
    return {p: r.token_ids for p, r in zip(PROMPTS, results)}


class Soak:
    def __init__(self, a):
        self.a = a
        self.records: list[dict] = []
        self.faults: list[dict] = []
        self.rss: list[dict] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.vanish: set[int] = set()  # client ids whose next request is dropped mid-generation

    def start_server(self, repo: Path, out: Path) -> None:
        self.http, self.grpc, self.metrics, self.health = free_ports(4)
        cmd = [sys.executable, "-m", "splitspec.cli", "serve", "--repo", str(repo), "--http-port", str(self.http),
               "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics), "--health-port", str(self.health)]
        self.log = open(out / "serve.out", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_ready(600)

    def ready(self) -> bool:
        try:
            return requests.get(f"http://127.0.0.1:{self.health}/v2/health/ready", timeout=1).ok
        except requests.RequestException:
            return False

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout_s:
                raise SplitspecError(f"splitspec serve not ready (status {self.proc.poll()})")
            time.sleep(0.1)
        return time.monotonic() - t0

    # -- clients --------------------------------------------------------------------------------
    def client(self, cid: int) -> None:
        url = f"http://127.0.0.1:{self.http}/v2/models/ensemble"
        n = 0
        while not self.stop.is_set():
            prompt, door = PROMPTS[(cid + n) % len(PROMPTS)], DOORS[(cid + n) % len(DOORS)]
            n += 1
            rec = {"client": cid, "door": door, "prompt": prompt, "t0": time.monotonic(), "finals": 0, "ids": []}
            vanish = cid in self.vanish
            try:
                if door == "http":
                    if vanish:
                        requests.post(f"{url}/generate", json={"text_input": prompt, "max_tokens": self.a.max_tokens},
                                      timeout=0.05)
                    ans = ask_http(f"{url}/generate", prompt, self.a.max_tokens, return_token_ids=True, timeout_s=120)
                    rec["ids"], rec["finals"] = ans.get("output_ids", []), 1
                else:
                    gen = (stream_grpc(f"127.0.0.1:{self.grpc}", prompt, self.a.max_tokens, timeout_s=120,
                                       return_token_ids=True) if door == "grpc" else
                           stream_http(f"{url}/generate_stream", prompt, self.a.max_tokens, timeout_s=120,
                                       return_token_ids=True))
                    for ev in gen:
                        rec["ids"] += ev.get("output_ids", [])
                        rec["finals"] += "finish_reason" in ev
                        if vanish:
                            gen.close()
                            break
                rec["outcome"] = "vanished" if vanish else "ok"
            except (SplitspecError, requests.RequestException) as e:
                rec["outcome"] = "vanished" if vanish else "error"
                rec["error"] = str(e)[:300]
                if not vanish:  # as a retrying client would: wait for the supervisor's readiness, not a busy loop
                    t_wait = time.monotonic()
                    while not self.stop.is_set() and not self.ready() and time.monotonic() - t_wait < 300:
                        self.stop.wait(0.25)
            if vanish:
                self.vanish.discard(cid)
            rec["t1"] = time.monotonic()
            with self.lock:
                self.records.append(rec)

    # -- faults and memory ----------------------------------------------------------------------
    def inject(self) -> None:
        i = 0
        while not self.stop.wait(self.a.fault_every_s):
            what = FAULTS[i % len(FAULTS)]
            i += 1
            t = time.monotonic()
            if what == "clients vanish":
                self.vanish.update(random.sample(range(self.a.streams), 8))
                self.faults.append({"fault": what, "t": t, "ready_s": 0.0})
                continue
            pids = {role: pid for pid, role in pipeline_processes(self.proc.pid).items()}
            if what not in pids:
                continue
            os.kill(pids[what], signal.SIGKILL)
            while self.ready() and time.monotonic() - t < 5:
                time.sleep(0.05)
            try:
                self.wait_ready(300)
            except SplitspecError:
                self.faults.append({"fault": what, "t": t, "ready_s": None})
                self.stop.set()
                return
            self.faults.append({"fault": what, "t": t, "ready_s": time.monotonic() - t})
            print(f"  {what}: ready again after {self.faults[-1]['ready_s']:.1f} s", flush=True)

    def sample_rss(self) -> None:
        while not self.stop.wait(self.a.rss_every_s):
            row = {"t": time.monotonic(), "splitspec serve": rss_mib(self.proc.pid)}
            for pid, role in pipeline_processes(self.proc.pid).items():
                row[role] = rss_mib(pid)
            self.rss.append(row)


def summarise(s: Soak, refs: dict, t_start: float) -> dict:
    windows = [(f["t"], f["t"] + (f["ready_s"] if f["ready_s"] is not None else 1e9)) for f in s.faults]
    hit = lambda r: r["outcome"] == "vanished" or any(r["t0"] <= b and r["t1"] >= a for a, b in windows)  # noqa: E731
    clean = [r for r in s.records if not hit(r)]
    lost = [r for r in clean if r["outcome"] != "ok"]
    dup = [r for r in clean if r["outcome"] == "ok" and r["finals"] > 1]
    bad = [r for r in clean if r["outcome"] == "ok" and r["ids"] != refs[r["prompt"]]]
    roles = sorted({k for row in s.rss for k in row if k != "t"})
    flat = {}
    for role in roles:
        vals = [row[role] for row in s.rss if row.get(role)]
        q = len(vals) // 4
        if q:
            flat[role] = round(statistics.median(vals[-q:]) / statistics.median(vals[q:2 * q]), 3)
    return {"minutes": s.a.minutes, "streams": s.a.streams, "max_tokens": s.a.max_tokens,
            "requests": len(s.records), "answered": sum(r["outcome"] == "ok" for r in s.records),
            "hit_by_a_fault": len(s.records) - len(clean), "clean": len(clean),
            "lost": len(lost), "duplicated": len(dup), "mismatched": len(bad),
            "examples": [{k: r.get(k) for k in ("door", "prompt", "outcome", "error")} for r in (lost + dup + bad)[:5]],
            "answered_latency_s_p50": round(statistics.median(
                [r["t1"] - r["t0"] for r in s.records if r["outcome"] == "ok"] or [0.0]), 2),
            "faults": [{"fault": f["fault"], "at_s": round(f["t"] - t_start, 1),
                        "ready_again_s": None if f["ready_s"] is None else round(f["ready_s"], 1)} for f in s.faults],
            "rss_last_quarter_over_second_quarter": flat,
            "requests_log": [{"door": r["door"], "outcome": r["outcome"], "t0": round(r["t0"] - t_start, 2),
                              "t1": round(r["t1"] - t_start, 2), "tokens": len(r["ids"])} for r in s.records],
            "rss_mib": [{k: (round(v - t_start, 1) if k == "t" else v) for k, v in row.items()} for row in s.rss]}


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    rows = summary["rss_mib"]
    for role in sorted({k for row in rows for k in row if k != "t"}):
        pts = [(row["t"], row[role]) for row in rows if row.get(role)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=role)
    for f in summary["faults"]:
        ax.axvline(f["at_s"], color="grey", lw=0.6, ls=":")
    ax.set_xlabel("seconds (dotted: an injected fault)")
    ax.set_ylabel("RSS, MiB")
    ax.set_title(f"{summary['streams']} streams, {summary['requests']} requests, {len(summary['faults'])} faults")
    ax.legend(fontsize=7, loc="upper left")
    write_png(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=Path, default=Path("engines/demo"))
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--fault-every-s", type=float, default=90.0)
    p.add_argument("--rss-every-s", type=float, default=2.0)
    p.add_argument("--out", type=Path, default=Path("soak_results"))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    print("reference (target-only greedy, in this process) ...", flush=True)
    refs = reference(a.engines, a.max_tokens)
    s = Soak(a)
    with tempfile.TemporaryDirectory() as tmp:
        repo = render_repo(ServeConfig(a.engines, max_batch_size=a.streams, kv_tokens=a.streams * 80), Path(tmp) / "repo")
        print("starting splitspec serve ...", flush=True)
        s.start_server(repo, a.out)
        t_start = time.monotonic()
        threads = [threading.Thread(target=s.client, args=(i,), daemon=True) for i in range(a.streams)]
        threads += [threading.Thread(target=s.inject, daemon=True), threading.Thread(target=s.sample_rss, daemon=True)]
        for t in threads:
            t.start()
        s.stop.wait(a.minutes * 60)
        s.stop.set()
        deadline = time.monotonic() + 150
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        s.proc.send_signal(signal.SIGTERM)  # a background job may have SIGINT ignored
        s.proc.wait(120)
    summary = summarise(s, refs, t_start)
    write_json(summary, a.out / "soak.json")
    plot(summary, a.out / "soak.png")
    short = {k: v for k, v in summary.items() if k not in ("rss_mib", "requests_log")}
    print(short, flush=True)
    return 0 if summary["lost"] == summary["duplicated"] == summary["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
