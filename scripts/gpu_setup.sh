#!/usr/bin/env bash
# On the GPU machine (no network), from the repository root: turn .carry/ (make gpu-carry) into a venv
# in which tritonserver's Python backend stub runs NumPy 1 beside the image's torch
# (docs/measuring.md, "On a GPU machine without network access"):
#   - TSENV (default /tmp/tsenv): `python3 -m venv --without-pip`, its site-packages unpacked from
#     .carry/site-packages.tar.xz (pytriton + tritonserver, nvidia_pytriton.libs, numpy 1.26.4,
#     tritonclient, rapidjson);
#   - splitspec.pth there naming this checkout's src/ and TORCH_SITE (default: the site-packages of the
#     python3 on PATH, /opt/torch/.venv/lib/python3.12/site-packages on the image): torch, transformers,
#     grpcio, protobuf, requests come from the image; numpy 1 shadows its NumPy 2;
#   - checks: versions, the stub for this Python, the libraries the stub and tritonserver link.
# Then run everything as $TSENV/bin/python (splitspec.serving.triton_install.server_env puts its bin first on PATH for the stub).
#   bash scripts/gpu_setup.sh      (prints the export line)     or      source scripts/gpu_setup.sh
# Variables: CARRY (.carry), TSENV (/tmp/tsenv), PYTHON (python3: makes the venv), TORCH_SITE.
_splitspec_gpu_setup() (
  set -euo pipefail
  repo=$(pwd -P)
  carry=${CARRY:-.carry}
  tsenv=${TSENV:-/tmp/tsenv}
  python=${PYTHON:-python3}
  torch_site=${TORCH_SITE:-$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')}
  [ -f "$carry/site-packages.tar.xz" ] || { echo "$carry/site-packages.tar.xz missing: run 'make gpu-carry' and carry $carry" >&2; exit 1; }
  [ -d "$repo/src/splitspec" ] || { echo "run from the repository root (no src/splitspec in $repo)" >&2; exit 1; }
  want=$(cat "$carry/PYVER") have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$want" = "$have" ] || { echo "$carry is for Python $want, $python is $have: PYVER=$have make gpu-carry" >&2; exit 1; }
  rm -rf "$tsenv"
  "$python" -m venv --without-pip "$tsenv"
  site=$("$tsenv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$tsenv/bin/python" - "$carry/site-packages.tar.xz" "$site" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:  # Python's lzma: no xz binary needed
    t.extractall(sys.argv[2], **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
PY
  printf '%s\n' "$repo/src" "$torch_site" > "$site/splitspec.pth"
  echo "$tsenv: site-packages $site (+ $repo/src, $torch_site)" >&2
  "$tsenv/bin/python" - <<'PY' >&2
import shutil, subprocess, sys
import numpy, torch, tritonclient.grpc  # noqa: F401
from splitspec.serving.triton_install import find_triton, libpython_dir, server_env
assert numpy.__version__.startswith("1."), f"numpy {numpy.__version__} at {numpy.__file__}: the stub needs NumPy 1"
inst = find_triton()
print(f"python {sys.version.split()[0]} ({sys.executable}), numpy {numpy.__version__} ({numpy.__file__}), torch {torch.__version__} "
      f"(CUDA devices: {torch.cuda.device_count()}), libpython dir {libpython_dir()}\nstub {inst.stub}")
if shutil.which("ldd"):
    env = server_env(inst)
    for exe in (inst.stub, inst.server_bin, inst.backend_lib):
        out = subprocess.run(["ldd", str(exe)], env=env, capture_output=True, text=True).stdout
        missing = [ln.strip() for ln in out.splitlines() if "not found" in ln]
        assert not missing, f"{exe}: libraries not found: {missing}"
    print("ldd: the stub, tritonserver and libtriton_python.so find all their libraries")
PY
)
if _splitspec_gpu_setup; then
  if [ "${BASH_SOURCE[0]}" != "$0" ]; then export PATH="${TSENV:-/tmp/tsenv}/bin:$PATH"
  else echo "export PATH=${TSENV:-/tmp/tsenv}/bin:\$PATH"; fi
else
  echo "gpu_setup: failed" >&2
  [ "${BASH_SOURCE[0]}" != "$0" ] && return 1 || exit 1
fi
