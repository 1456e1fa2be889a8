#!/usr/bin/env python3
"""Static costs of the INT4 MoE kernels on an H100/H200 (sm_90) without a GPU: each kernel compiled by Triton for
sm_90, its SASS (cuobjdump) inner loop counted — instructions per weight and thread, by opcode — with the registers
and spill bytes ptxas reports, shared memory, and the width of the global-to-shared copies (LDGSTS .64 or .128).
What it shows: the instruction stream the unpacking costs (the current ``fma`` kernels spend ~6.7 instructions per
weight, ``mma_asm`` ~2.5), not time; bench/lab/int4_moe_bench.py measures time on a GPU.

    export PYTHONPATH=$PWD/src
    python3 bench/lab/int4_sass.py > results/int4_sass.txt

Integer arguments that are multiples of 16 at Kimi-K2 shapes (strides, H, I) are compiled as the launcher
specialises them (``tt.divisibility`` 16); Triton, ptxas and cuobjdump are the ones installed with Triton.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass

from splitspec.models import grouped_moe, int4_down, int4_fma, int4_moe

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
POINTERS = {"x_ptr": "*bf16", "xp_ptr": "*bf16", "ids_ptr": "*i32", "p_ptr": "*i16", "s_ptr": "*bf16",
            "wt_ptr": "*fp32", "order_ptr": "*i32", "bexp_ptr": "*i32", "bfirst_ptr": "*i32", "bcount_ptr": "*i32"}
KERNELS = {  # kernel → (function, pointer types of its own, weights per loop iteration from (BLOCK_N, BLOCK_K))
    "fma gate_up": (int4_fma._gate_up_fma, {"p_ptr": "*i32", "act_ptr": "*fp32"}, lambda n, k: 2 * n * k),
    "mma gate_up": (int4_moe._gate_up_mma, {"out_ptr": "*bf16"}, lambda n, k: 2 * n * k),
    "mma down": (int4_down._down_mma, {"a_ptr": "*bf16", "out_ptr": "*bf16"}, lambda n, k: n * k),
    "columns down": (int4_down._down_columns, {"a_ptr": "*bf16", "out_ptr": "*bf16"}, lambda n, k: 8 * n * k),
    "grouped gate_up": (grouped_moe._gate_up_grouped, {"act_ptr": "*bf16"}, lambda n, k: 2 * n * k),
    "grouped down": (grouped_moe._down_grouped, {"act_ptr": "*bf16", "out_ptr": "*fp32"}, lambda n, k: n * k),
}
CASES = [  # (kernel, constexprs, num_warps, num_stages)
    ("fma gate_up", {"G": 32, "BLOCK_N": 8, "BLOCK_K": 1024}, 4, 4),
    *[("mma gate_up", {"G": 32, "BLOCK_N": n, "BLOCK_K": k, "PARTIAL": False, "EVEN_K": True, "MODE": mode, "KS": 1},
       n // 16, 3) for mode in (2, 1) for n, k in ((16, 256), (32, 256), (32, 512), (64, 256))],
    *[("mma gate_up", {"G": 32, "BLOCK_N": n, "BLOCK_K": k, "PARTIAL": False, "EVEN_K": True, "MODE": 2, "KS": ks},
       ks * n // 16, st) for n, k, ks, st in ((32, 512, 2, 3), (32, 1024, 4, 2), (16, 1024, 8, 2))],
    *[("mma down", {"G": 32, "BLOCK_N": n, "BLOCK_K": k, "ATOMIC": False, "EVEN_K": True, "MODE": mode}, n // 16, 3)
      for mode in (2, 1) for n, k in ((16, 256), (32, 256), (16, 512))],
    *[("columns down", {"G": 32, "BLOCK_N": n, "BLOCK_K": k, "SLOTS": 8, "EVEN_K": True, "MODE": 2}, w, 3)
      for n, k, w in ((16, 256, 8), (16, 512, 8), (8, 512, 4))],
    *[("grouped gate_up", {"G": 32, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 256, "EVEN_K": True, "MODE": 2}, w, 3)
      for m, n, w in ((16, 32, 2), (64, 64, 4))],
    *[("grouped down", {"G": 32, "BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 256, "EVEN_K": True, "MODE": 2}, w, 3)
      for m, n, w in ((16, 32, 2), (64, 64, 4))],
]


def inner_loop(sass: str) -> collections.Counter:
    """Opcode counts of the innermost loop (the smallest backward branch's body that holds a load)."""
    lines = sass.splitlines()
    labels = {ln.strip().rstrip(":"): i for i, ln in enumerate(lines) if re.fullmatch(r"\.?L\w+:", ln.strip())}
    bodies = []
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+(\w+)", ln)
        if m and labels.get(m.group(1), i) < i:
            body = collections.Counter()
            for b in lines[labels[m.group(1)] + 1:i + 1]:
                op = re.match(r"^\S+\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", b.strip())
                if op:
                    body[op.group(1)] += 1
            if body["LDGSTS"] + body["LDG"]:
                bodies.append(body)
    return min(bodies, key=lambda b: sum(b.values())) if bodies else collections.Counter()


def main() -> None:
    print(f"Triton {triton.__version__}, sm_90; per weight and thread, innermost loop")
    for name, consts, warps, stages in CASES:
        fn, own, per_iter = KERNELS[name]
        sig = {a: {**POINTERS, **own}.get(a, "i64" if a in ("stride_pe", "stride_se") else "i32")
               for a in fn.arg_names if a not in consts}
        attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig
                 if sig[a].startswith("*") or a.startswith("stride") or a in ("H", "I")}
        src = ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in consts}}, constexprs=consts, attrs=attrs)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        sass = get_sass(c.asm["cubin"])
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(c.asm["ptx"])
            f.flush()
            v = subprocess.run([str(BIN / "ptxas"), "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                               capture_output=True, text=True).stderr
        regs, spill = re.search(r"Used (\d+) registers", v), re.search(r"(\d+) bytes spill stores", v)
        body = inner_loop(sass)
        weights = per_iter(consts["BLOCK_N"], consts["BLOCK_K"]) / (32 * warps)
        copies = sorted(set(re.findall(r"LDGSTS\.E(?:\.BYPASS)?\.(\d+)", sass)))
        cfg = {k: v for k, v in consts.items() if k != "G"}
        print(f"{name:<16} {cfg} warps {warps}: {sum(body.values()) / weights:.2f} instructions/weight "
              f"({', '.join(f'{op} {n / weights:.2f}' for op, n in body.most_common(6))}); registers "
              f"{regs and regs.group(1)}, spill stores {spill and spill.group(1)} B, shared {c.metadata.shared} B, "
              f"cp.async widths {copies or '-'}")


if __name__ == "__main__":
    main()
