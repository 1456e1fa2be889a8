import cProfile, pstats, sys, tempfile, time, io
from pathlib import Path
import torch
sys.path.insert(0, "bench")
from lab.draft_profile import write_engines, steady_plan
from splitspec.engine.graphs import bucket
from splitspec.engine.rank import RankRunner
from splitspec.models.kv import BLOCK_SIZE
from splitspec.models.layers import TPComm
tmp = Path(tempfile.mkdtemp())
eng = write_engines(tmp, "float", False, 16)
r = RankRunner(eng, 0, 1, TPComm(), "cuda:0", placements=(1,), compile=True)
per = r.limits["max_seq_len"] // BLOCK_SIZE
for B, k in ((1, 1), (16, 5)):
    plan = steady_plan(B, k, 100, per)
    r.aux.keep_batch([w.sid for w in plan.work], torch.randn(bucket(B) * (k + 1), 3 * r.drafter.cfg.target_hidden_size, dtype=r.drafter.dtype, device="cuda:0"), k + 1)
    for _ in range(5):
        r.draft_padded(plan); torch.cuda.synchronize()
    hs = []
    for _ in range(200):
        torch.cuda.synchronize(); t = time.perf_counter(); r.draft_padded(plan); hs.append(time.perf_counter() - t)
    hs.sort(); print(f"B{B} k{k} host us median {hs[100]*1e6:.0f} p10 {hs[20]*1e6:.0f} p90 {hs[180]*1e6:.0f}")
    pr = cProfile.Profile()
    for _ in range(200):
        torch.cuda.synchronize(); pr.enable(); r.draft_padded(plan); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue()[-2600:])
