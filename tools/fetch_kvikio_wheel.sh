#!/usr/bin/env bash
# Download the kvikio-cu12 wheel (about 0.7 MB) for the tests that load the real kvikio Python layer
# with its compiled modules stubbed (tests/engine/test_gds_engine.py, tests/store/test_gpu_buffer_routing.py). Nothing is
# installed: only the wheel's .py files are read, at test time, from the cache folder. Without
# network the download fails quietly and those tests skip, saying why.
#
#   bash tools/fetch_kvikio_wheel.sh [python]     # default: python3
# Folder: $KVIKIO_WHEEL_DIR, else ${XDG_CACHE_HOME:-~/.cache}/umbp-nvme/kvikio-wheels.
set -uo pipefail
PY=${1:-${PYTHON:-python3}}
VER=${KVIKIO_VERSION:-26.10.0}
DIR=${KVIKIO_WHEEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/umbp-nvme/kvikio-wheels}
mkdir -p "$DIR"
if ls "$DIR"/kvikio_cu12-"$VER"-*.whl >/dev/null 2>&1; then
  echo "kvikio-cu12 $VER wheel already in $DIR"
  exit 0
fi
# --no-deps and a pinned platform: downloads this one wheel, never cupy/CUDA packages or torch.
if timeout 120 "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.11 --implementation cp --abi abi3 --platform manylinux_2_28_x86_64 \
    -d "$DIR" "kvikio-cu12==$VER"; then
  echo "kvikio-cu12 $VER wheel in $DIR"
else
  echo "could not download kvikio-cu12==$VER (offline?); the real-kvikio-layer tests will skip"
fi
exit 0
