#!/usr/bin/env python3
"""Peak resident memory of ``convert`` on a generated checkpoint of a few GB, against its streaming bound.

Writes an FP8 block-scaled Kimi-K2-form checkpoint with wide routed experts (random float8_e4m3fn
weights and float32 tile scales, streamed to disk shard by shard, no model in memory) and an EAGLE-3
drafter into a temporary folder, converts the pair at each TP size in a fresh subprocess, and reports
that process's peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``, read by the child just before it exits)
against the bound the issue sets: the largest input shard plus one rank's output (the largest
``rank{i}.safetensors`` written). The temporary folder is deleted at the end unless ``--keep``.

Example: ``.venv/bin/python bench/convert_memory.py --size-gb 2.2 --tp 2 4``
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitspec import quant

from splitspec.testing import fixtures
from splitspec.convert.safetensors import StreamingSafetensorsWriter
from splitspec.files import write_json

CHILD = r"""
import json, resource, sys, time
from pathlib import Path
def rss_kb():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1])
from splitspec.convert.pair import convert_pair
base = rss_kb()
t0 = time.time()
convert_pair(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), tp_size=int(sys.argv[4]))
print('RESULT ' + json.dumps({'baseline_kb': base, 'peak_kb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                              'seconds': time.time() - t0}))
"""


def bench_config(size_gb: float) -> dict:
    """A Kimi-K2-form config whose FP8 checkpoint is about ``size_gb`` GB: hidden 1024, 64 experts of width 1024."""
    per_moe_layer = 64 * 3 * 1024 * 1024  # fp8 bytes of one layer's routed experts
    layers = max(2, round(size_gb * 1e9 / per_moe_layer) + 1)
    return fixtures.target_config(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024,
                                  num_hidden_layers=layers, n_routed_experts=64, num_experts_per_tok=8, num_attention_heads=8,
                                  num_key_value_heads=8, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64,
                                  qk_rope_head_dim=64, v_head_dim=64, quantization_config=fixtures.FP8_CONFIG)


def random_fp8(shape: tuple[int, int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float8_e4m3fn weight (NaN codes 0x7F/0xFF avoided) and float32 scales per 128×128 tile."""
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0x3C
    scale = torch.rand(quant.fp8_scale_shape(shape, fixtures.BLOCK), generator=g) * 1e-3
    return raw.view(torch.float8_e4m3fn), scale


def write_big_target(folder: Path, cfg: dict, shard_bytes: int) -> dict[str, int]:
    """Stream the checkpoint to ``folder`` in shards of about ``shard_bytes``; returns {shard: bytes}."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    linears = {m: shape for m, shape, _ in fixtures.target_linears(cfg)}
    H, V = cfg["hidden_size"], cfg["vocab_size"]

    def tensors():
        yield "model.embed_tokens.weight", torch.randn(V, H, generator=g).bfloat16()
        for n in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{n}."
            for norm, size in (("input_layernorm", H), ("post_attention_layernorm", H),
                               ("self_attn.q_a_layernorm", cfg["q_lora_rank"]), ("self_attn.kv_a_layernorm", cfg["kv_lora_rank"])):
                yield p + norm + ".weight", torch.ones(size, dtype=torch.bfloat16)
            if n >= cfg["first_k_dense_replace"]:
                yield p + "mlp.gate.weight", torch.randn(cfg["n_routed_experts"], H, generator=g).bfloat16()
                yield p + "mlp.gate.e_score_correction_bias", torch.zeros(cfg["n_routed_experts"])
            for m, shape in linears.items():
                if m.startswith(p):
                    w, s = random_fp8(shape, g)
                    yield m + ".weight", w
                    yield m + ".weight_scale_inv", s
        yield "model.norm.weight", torch.ones(H, dtype=torch.bfloat16)
        yield "lm_head.weight", torch.randn(V, H, generator=g).bfloat16()

    weight_map, sizes, writer, i = {}, {}, None, 0
    for name, t in tensors():
        if writer is None or writer.nbytes >= shard_bytes:
            if writer is not None:
                writer.close()
            i += 1
            writer = StreamingSafetensorsWriter(folder / f"model-{i:05d}.safetensors")
        writer.add(name, t)
        weight_map[name] = f"model-{i:05d}.safetensors"
    writer.close()
    for f in set(weight_map.values()):
        sizes[f] = (folder / f).stat().st_size
    write_json({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, folder / "model.safetensors.index.json")
    write_json(cfg, folder / "config.json")
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=2.2, help="approximate checkpoint size (GB, 10^9 bytes)")
    ap.add_argument("--shard-mb", type=int, default=400, help="approximate shard size (MB)")
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--dir", default=None, help="parent folder of the temporary data (default: the system temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the generated data")
    a = ap.parse_args()
    parent = Path(a.dir or tempfile.gettempdir())
    need = a.size_gb * 1e9 * 2.6  # the checkpoint, one conversion of it, one rank's temporary data file
    free = shutil.disk_usage(parent).free
    if free < need:
        sys.exit(f"{parent}: {free / 1e9:.1f} GB free, about {need / 1e9:.1f} GB needed")
    root = Path(tempfile.mkdtemp(prefix="splitspec-convert-memory-", dir=parent))
    try:
        cfg = bench_config(a.size_gb)
        t0 = time.time()
        sizes = write_big_target(root / "target", cfg, a.shard_mb * 10**6)
        total = sum(sizes.values())
        print(f"generated FP8 target: {cfg['num_hidden_layers']} layers, {cfg['n_routed_experts']} experts × "
              f"{cfg['moe_intermediate_size']} wide, hidden {cfg['hidden_size']}: {total / 1e9:.2f} GB in {len(sizes)} shards "
              f"(largest {max(sizes.values()) / 1e6:.0f} MB) in {time.time() - t0:.0f} s")
        dm = fixtures.drafter_master(fixtures.drafter_config(cfg, 128, [0, 1, 3]), seed=1)
        fixtures.write_drafter_form(root / "drafter", dm, cfg, {}, "drafter")
        rows = []
        for tp in a.tp:
            out = root / f"out_tp{tp}"
            p = subprocess.run([sys.executable, "-c", CHILD, str(root / "target"), str(root / "drafter"), str(out), str(tp)],
                               stdout=subprocess.PIPE, text=True, check=True)
            res = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
            rank = max(f.stat().st_size for f in (out / "target").glob("rank*.safetensors"))
            bound = max(sizes.values()) + rank
            peak = res["peak_kb"] * 1024
            rows.append((tp, peak, res["baseline_kb"] * 1024, bound, max(sizes.values()), rank, res["seconds"]))
            print(f"TP{tp}: peak RSS {peak / 1e6:.0f} MB (of which {res['baseline_kb'] * 1024 / 1e6:.0f} MB is the interpreter with "
                  f"torch before converting) vs bound {bound / 1e6:.0f} MB = largest shard {max(sizes.values()) / 1e6:.0f} MB + "
                  f"one rank's output {rank / 1e6:.0f} MB: {'within' if peak < bound else 'ABOVE'} the bound; "
                  f"converted {total / 1e9:.2f} GB in {res['seconds']:.0f} s")
            shutil.rmtree(out)
        if any(r[1] >= r[3] for r in rows):
            sys.exit(1)
    finally:
        if a.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            print(f"deleted {root}")


if __name__ == "__main__":
    main()
