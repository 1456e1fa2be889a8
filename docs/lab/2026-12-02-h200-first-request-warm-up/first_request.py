"""First-request latency on one GPU: in-process without warm-up (load, 1st, 2nd request) and through the engine
process, which warms up before ready (time to ready, 1st, 2nd request)."""
import json, sys, threading, time
from pathlib import Path
from splitspec.runtime.scheduler import SpeculativeEngine
from splitspec.runtime.types import Request
from splitspec.serving.engine_process import EngineProcess
from splitspec.settings import ServeConfig

eng_dir = Path(sys.argv[1]); out = {}
cfg = ServeConfig.from_env(engines_dir=eng_dir, target_device_ids=(0,), num_draft_tokens=3)
prompt = list(range(5, 45))
def inproc():
    t0 = time.perf_counter(); eng = SpeculativeEngine.load(cfg); out["inproc_load_s"] = time.perf_counter() - t0
    for i in (1, 2, 3):
        t0 = time.perf_counter(); eng.generate(prompt, 64, stop_token_ids=set()); out[f"inproc_request{i}_s"] = time.perf_counter() - t0
    eng.close(); del eng
    print(json.dumps(out), flush=True)


def process():
    done = {}

    def on_cycle(events, stats):
        for sid, ev, fin in events:
            if ev.finished:
                done[sid].set()
    t0 = time.perf_counter(); proc = EngineProcess(cfg, on_cycle, lambda m: print("FAILED", m)); out["process_ready_s"] = time.perf_counter() - t0
    out["process_warm_up_s"] = proc.info.get("warm_up_s")
    for i in (1, 2, 3):
        done[i] = threading.Event(); t0 = time.perf_counter()
        proc.submit(i, Request(prompt, 64, stop_token_ids=set())); done[i].wait(600)
        out[f"process_request{i}_s"] = time.perf_counter() - t0
    proc.close()
    print(json.dumps(out), flush=True)


for phase in sys.argv[2].split(','):
    {'inproc': inproc, 'process': process}[phase]()
