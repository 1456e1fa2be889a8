"""What a measurement ran on: the machine, the software versions, the commit and the engines.

Every results file of ``splitspec perf``, ``splitspec bench`` and the lab scripts in ``bench/`` records
:func:`machine_info` (and, for a served run, :func:`engine_info`), so that a figure can be traced to the
hardware, the versions and the exact engine files it came from.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from splitspec.errors import ConfigError


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[str]:
    """GPU names from ``nvidia-smi`` (empty when there is none)."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in out.stdout.splitlines() if ln.strip()] if out.returncode == 0 else []


def package_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (None when it is not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> dict:
    """``{"commit": HEAD's hash or None, "dirty": whether tracked files differ from it}`` of the checkout this
    package is imported from (None and False for an installed package: no checkout holds it)."""

    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                               timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_info() -> dict:
    """Machine and software versions: CPU model and count, memory (GiB), GPUs, load average,
    Python, torch, numpy, tritonclient, nvidia-pytriton (tritonserver 2.51), genai-perf, git commit."""
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = None
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    torch_v = None
    if "torch" in sys.modules or package_version("torch"):
        try:
            import torch

            torch_v = torch.__version__
        except ImportError:
            pass
    return {"cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "memory_gib": round(mem, 1) if mem else None, "gpus": _gpus(), "load_average": load,
            "platform": platform.platform(), "python": platform.python_version(),
            "versions": {"torch": torch_v, "numpy": package_version("numpy"), "tritonclient": package_version("tritonclient"),
                         "nvidia-pytriton": package_version("nvidia-pytriton"), "genai-perf": package_version("genai-perf"),
                         "splitspec": package_version("splitspec")},
            "git": git_commit()}


def engine_info(engines: Path) -> dict:
    """``engine.json`` of target and drafter (dtype, mapping, limits, model sizes) and a short
    SHA-256 of each rank's weights (which pair was benchmarked)."""
    out = {"engines_dir": str(Path(engines).resolve())}
    for kind in ("target", "drafter"):
        p = Path(engines) / kind / "engine.json"
        try:
            e = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"{p}: cannot read the engine description ({err}); build the engines first") from None
        cfg = e.get("config", {})
        keep = {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "n_routed_experts", "num_experts_per_tok",
                                    "vocab_size", "draft_vocab_size", "aux_layer_ids") if k in cfg}
        hashes = {}
        for w in sorted((Path(engines) / kind).glob("rank*.safetensors")):
            h = hashlib.sha256()
            with open(w, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            hashes[w.name] = h.hexdigest()[:16]
        out[kind] = {"dtype": e.get("dtype"), "mapping": e.get("mapping"), "limits": e.get("limits"),
                     "config": keep, "weights_sha256": hashes}
    return out
