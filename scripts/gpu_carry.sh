#!/usr/bin/env bash
# Build .carry/: what a GPU machine without network access needs to serve our model repository with
# tritonserver and the Python backend (docs/measuring.md, "On a GPU machine without network access": why
# NumPy 1, which Python the stub uses). scripts/gpu_setup.sh unpacks it there.
#
#   .carry/site-packages.tar.xz  a site-packages tree, ready to unpack:
#       pytriton (tritonserver 2.51, Python backend) + nvidia_pytriton.libs from this checkout's .venv,
#         with only the Python backend stub for PYVER and without the bundled libpython3.13;
#       numpy 1.26.4 (the stubs need NumPy 1; its tests left out), tritonclient 2.50.0 (the pure-Python
#         wheel: no perf_analyzer) and python-rapidjson 1.25 (tritonclient.grpc imports it): wheels for
#         CPython PYVER on manylinux x86_64, unzipped (grpcio, protobuf, packaging, requests: the image's)
#   .carry/PYVER                 the Python version it was built for
#
# Variables: PYVER (default 3.12, the GPU image's), CARRY (default .carry), PY (default .venv/bin/python:
# the interpreter whose site-packages hold nvidia-pytriton 0.7.0). Needs PyPI and xz; takes ~1-2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
CARRY=${CARRY:-.carry}
PY=${PY:-.venv/bin/python}
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
STUBS="$SITE/pytriton/tritonserver/python_backend_stubs"
[ -x "$STUBS/$PYVER/triton_python_backend_stub" ] || { echo "no Python $PYVER stub in $STUBS" >&2; exit 1; }

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
excludes=(--exclude=__pycache__ --exclude='nvidia_pytriton.libs/libpython3*13.so*')
for d in "$STUBS"/*/; do
  v=$(basename "$d")
  [ "$v" = "$PYVER" ] || excludes+=(--exclude="pytriton/tritonserver/python_backend_stubs/$v")
done
tar -C "$SITE" -cf - "${excludes[@]}" pytriton nvidia_pytriton.libs nvidia_pytriton-0.7.0.dist-info \
  | tar -C "$STAGE" -xf -

mkdir "$STAGE/.wheels"
pip_dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
             -d "$STAGE/.wheels" "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
pip_dl --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
       --platform manylinux2014_x86_64 numpy==1.26.4 python-rapidjson==1.25
pip_dl --platform any tritonclient==2.50.0
for w in "$STAGE"/.wheels/*.whl; do
  echo "  $(basename "$w")"
  "$PY" -m zipfile -e "$w" "$STAGE"
done
rm -rf "$STAGE/.wheels"
for d in "$STAGE"/*.data/purelib "$STAGE"/*.data/platlib; do  # what a wheel installs into site-packages
  [ -d "$d" ] && cp -a "$d"/. "$STAGE"/
done
rm -rf "$STAGE"/*.data "$STAGE"/numpy/tests "$STAGE"/numpy/*/tests "$STAGE"/numpy/*/*/tests
for f in numpy/__init__.py tritonclient/grpc/__init__.py rapidjson.cpython-"${PYVER/./}"-*.so \
         pytriton/tritonserver/bin/tritonserver "pytriton/tritonserver/python_backend_stubs/$PYVER"; do
  compgen -G "$STAGE/$f" > /dev/null || { echo "$f: missing from the staged site-packages" >&2; exit 1; }
done

rm -rf "$CARRY"
mkdir -p "$CARRY"
echo "$PYVER" > "$CARRY/PYVER"
tar -C "$STAGE" -cf - . | xz -9 -T0 > "$CARRY/site-packages.tar.xz"
ls -l "$CARRY"
echo "$CARRY: $(du -sb "$CARRY" | awk '{printf "%.1f", $1 / 1048576}') MiB for Python $PYVER (unpacked: $(du -sm "$STAGE" | cut -f1) MiB)"
