#!/usr/bin/env bash
# GPU check for umbp_nvme's GPUDirect Storage path: build, GPU tests, GDS benchmark. <= 5 minutes.
#
# For a GPU machine WITHOUT network: it installs nothing from the internet. What kvikio needs comes
# from the repo folder .whl/ (gitignored), filled beforehand on a machine with network, from the
# repo root (Python 3.12, x86_64; both CUDA majors, the script picks the one matching torch):
#
#   mkdir -p .whl && pip download -d .whl --no-deps --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
#     'kvikio-cu12==26.10.*' 'libkvikio-cu12==26.10.*' 'kvikio-cu13==26.10.*' 'libkvikio-cu13==26.10.*' \
#     'rapids-logger==0.3.*' cuda-pathfinder nvidia-cufile-cu12 nvidia-cufile packaging \
#     pytest pytest-asyncio pytest-timeout pluggy iniconfig pygments lmdb numpy setuptools wheel
#
# (about 30 MB; kvikio's cupy dependency is left out on purpose: `import kvikio` does not need it.)
# Then, with the device tool, carry the folder: run(command="bash tools/gpu_check.sh", carry=[".whl"]).
# torch with CUDA must already be on the GPU machine (it is far too big to carry).
# If kvikio is already installed, .whl/ is not needed for it.
#
# Environment: PYTHON (default python3), GPU_CHECK_DIR (benchmark files; default
# /var/tmp/umbp-gds-bench, must be on the NVMe under test), GPU_CHECK_BUDGET_S (default 290),
# OUT (if set, the log and bench-gds.json are copied there).
# Exit: 0 all good; 1 a step failed; 2 benchmark below the 0.9x target; 3 no usable GPU here.

set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-290}
BENCH_DIR=${GPU_CHECK_DIR:-/var/tmp/umbp-gds-bench}
WHL=.whl
START=$(date +%s)
LOG=$(mktemp /tmp/gpu_check.XXXXXX.log)
exec > >(tee "$LOG") 2>&1

left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "== [$(($(date +%s) - START))s] $*"; }
finish() {
  local rc=$1
  step "done: exit $rc"
  if [ -n "${OUT:-}" ]; then
    cp "$LOG" "$OUT/gpu_check.log" 2>/dev/null
    [ -f bench-gds.json ] && cp bench-gds.json "$OUT/" 2>/dev/null
  fi
  exit "$rc"
}
have_mod() { "$PY" -c "import $1" >/dev/null 2>&1; }
pip_offline() {  # install the named wheels from .whl/ only, no dependency resolution
  if [ ! -d "$WHL" ]; then
    echo "cannot install $*: no $WHL/ folder (see the preparation command at the top of this script)"
    return 1
  fi
  "$PY" -m pip install --no-index --no-deps --find-links "$WHL" --disable-pip-version-check -q "$@"
}

step "machine"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi not found"
"$PY" -V
if ! "$PY" -c "import torch, sys; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available', torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "SKIP: torch with a visible CUDA device is required on this machine"
  finish 3
fi
CUDA_MAJOR=$("$PY" -c "import torch; print((torch.version.cuda or '12').split('.')[0])")

step "test dependencies"
missing=()
have_mod numpy || missing+=(numpy)
have_mod pytest || missing+=(pytest pluggy iniconfig pygments packaging)
have_mod pytest_asyncio || missing+=(pytest-asyncio)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing from $WHL: ${missing[*]}"
  pip_offline "${missing[@]}" || finish 1
else
  echo "required ones present"
fi
optional=()  # not needed by tests/test_gds.py; installed when the wheels are at hand
have_mod lmdb || optional+=(lmdb)
have_mod pytest_timeout || optional+=(pytest-timeout)
if [ ${#optional[@]} -gt 0 ]; then
  pip_offline "${optional[@]}" || echo "(optional, continuing without: ${optional[*]})"
fi

step "kvikio (cu$CUDA_MAJOR)"
if have_mod kvikio; then
  echo "kvikio already installed"
else
  if [ "$CUDA_MAJOR" = "13" ]; then cufile=nvidia-cufile; else cufile=nvidia-cufile-cu12; fi
  pkgs=("kvikio-cu$CUDA_MAJOR" "libkvikio-cu$CUDA_MAJOR" rapids-logger cuda-pathfinder)
  "$PY" -m pip show -q "$cufile" >/dev/null 2>&1 || pkgs+=("$cufile")
  have_mod packaging || pkgs+=(packaging)
  echo "installing from $WHL: ${pkgs[*]}"
  pip_offline "${pkgs[@]}" || finish 1
fi
"$PY" -c "import kvikio; print('kvikio', kvikio.__version__)" || finish 1

step "build (native/_uring in place)"
if have_mod setuptools; then
  timeout 120 "$PY" setup.py -q build_ext --inplace || echo "WARNING: build failed; the io_uring baseline falls back to posix"
else
  echo "WARNING: setuptools missing; not building (io_uring baseline falls back to posix)"
fi

step "GPU tests (tests/test_gds.py)"
t=$(($(left) - 150))
[ "$t" -lt 30 ] && t=30
timeout "$t" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gds.py 2>&1 | tee /tmp/gpu_check_pytest.txt
test_rc=${PIPESTATUS[0]}
if [ "$test_rc" -ne 0 ]; then
  echo "FAIL: tests exit $test_rc"
  finish 1
fi
if grep -q "SKIPPED.*needs a CUDA device" /tmp/gpu_check_pytest.txt; then
  echo "FAIL: GPU tests skipped on a GPU machine (reason above)"
  finish 1
fi

step "benchmark: GDS into device memory vs io_uring into pinned host + copy"
t=$(($(left) - 5))
[ "$t" -lt 30 ] && t=30
timeout "$t" env PYTHONPATH=. "$PY" tools/bench_gds.py --dir "$BENCH_DIR" --sizes 1 4 --total-mib 1024 \
  --queue-depth 32 --runs 3 --out bench-gds.json
bench_rc=$?
rm -rf "$BENCH_DIR"
case $bench_rc in
  0) finish 0 ;;
  2) echo "benchmark ran; GDS below the 0.9x target (figures above)"; finish 2 ;;
  3) finish 3 ;;
  124) echo "FAIL: benchmark ran past the time budget"; finish 1 ;;
  *) finish 1 ;;
esac
