#!/usr/bin/env bash
# GPU check for umbp_nvme's GPUDirect Storage path, built so that only GDS can make it fail:
#   1. requirements, all checked first (seconds): what is missing is listed and nothing else runs;
#   2. install what is missing from .whl/ (offline), the native build and lmdb (both mandatory);
#   3. one line: GPU, driver, /run/udev, nvidia-fs, libcufile, kvikio's compat decision;
#   4. the GPU tests, then the CPU tests of the GDS engine (real kvikio layer from the carried wheel);
#   5. the benchmark: GDS into CUDA memory vs io_uring into pinned host + copy, 1 and 4 MiB, with
#      the path kvikio really used (cuFile or its POSIX fallback).
# Each check ends with one "VERDICT <check>: ..." line; all within GPU_CHECK_BUDGET_S (290 s).
#
# The lent GPU machine (H200: Python 3.12, torch 2.11+cu130 installed, no network) needs in .whl/
# (gitignored; fill it on a machine with network, from the repo root):
#
#   mkdir -p .whl && pip download -d .whl --no-deps --only-binary=:all: \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
#     'kvikio-cu13==26.10.0' 'libkvikio-cu13==26.10.0' 'rapids-logger==0.3.*' cuda-pathfinder \
#     lmdb pytest-asyncio
#
# (kvikio's cupy dependency is left out on purpose: `import kvikio` does not need it.) Then with the
# device tool: run(command="bash tools/gpu_check.sh", carry=[".whl"]). One command, documented in
# docs/gpu.md.
#
# GPU_CHECK_DRY_RUN=1: no GPU needed -- CUDA is stubbed (tests/support/fake_kvikio.py stands in for kvikio's
# compiled core), nothing is installed, the benchmark is skipped; everything else runs as above.
#
# Environment: PYTHON (default python3), GPU_CHECK_DIR (benchmark files; default
# /var/tmp/umbp-gds-bench, must be on the NVMe under test), GPU_CHECK_BUDGET_S (default 290),
# GPU_CHECK_CUDA_MAJOR (dry run; default 13), OUT (if set, the log and bench-gds.json go there).
# Exit: 0 all good; 1 a step that is not GDS failed (build, tests); 2 GDS itself failed (path not
# cuFile, target missed); 3 no usable GPU here; 4 requirements missing (listed).

set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET_S:-290}
BENCH_DIR=${GPU_CHECK_DIR:-/var/tmp/umbp-gds-bench}
DRY=${GPU_CHECK_DRY_RUN:-0}
WHL=.whl
START=$(date +%s)
LOG=$(mktemp /tmp/gpu_check.XXXXXX.log)
exec > >(tee "$LOG") 2>&1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo; echo "== [$(($(date +%s) - START))s] $*"; }
verdict() { echo "VERDICT $*"; }
finish() {
  local rc=$1
  step "done: exit $rc"
  if [ -n "${OUT:-}" ]; then
    cp "$LOG" "$OUT/gpu_check.log" 2>/dev/null
    [ -f bench-gds.json ] && cp bench-gds.json "$OUT/" 2>/dev/null
  fi
  exit "$rc"
}

# ---------------------------------------------------------------- 1. requirements, all at once
step "requirements (dry run: $DRY)"
REQ_OUT=$("$PY" - "$WHL" "$DRY" "${GPU_CHECK_CUDA_MAJOR:-13}" <<'PYEOF'
import glob, importlib.util, os, re, shutil, sys, sysconfig

whl, dry, dry_major = sys.argv[1], sys.argv[2] == "1", sys.argv[3]

def have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False

def wheel(pattern):
    found = sorted(glob.glob(os.path.join(whl, pattern)))
    return found[-1] if found else None

missing, install = [], []
major = dry_major
if not dry:
    spec = importlib.util.find_spec("torch")
    if spec is None:
        missing.append("torch with CUDA (not carried: it must already be installed on the GPU machine)")
    else:
        text = open(os.path.join(os.path.dirname(spec.origin), "version.py")).read()
        m = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*['\"](\d+)", text, re.M)
        if not m:
            missing.append("a CUDA build of torch (torch.version.cuda is None: a CPU-only build)")
        major = m.group(1) if m else "13"
need = [  # (module, wheel in .whl/, pip name)
    ("kvikio", f"kvikio_cu{major}-*.whl", f"kvikio-cu{major}"),
    ("libkvikio", f"libkvikio_cu{major}-*.whl", f"libkvikio-cu{major}"),
    ("rapids_logger", "rapids_logger-*.whl", "rapids-logger"),
    ("cuda.pathfinder", "cuda_pathfinder-*.whl", "cuda-pathfinder"),
    ("lmdb", "lmdb-*.whl", "lmdb"),
    ("pytest", "pytest-[0-9]*.whl", "pytest"),
    ("pytest_asyncio", "pytest_asyncio-*.whl", "pytest-asyncio"),
    ("numpy", "numpy-*.whl", "numpy"),
    ("setuptools", "setuptools-*.whl", "setuptools"),
]
for mod, pattern, name in need:
    if dry and mod in ("kvikio", "libkvikio", "rapids_logger", "cuda.pathfinder"):
        # the dry run installs nothing: the carried wheel must be there (its Python layer is tested)
        if wheel(pattern) is None:
            missing.append(f"{name} (no {pattern} in {whl}/)")
        continue
    if have(mod):
        continue
    w = wheel(pattern)
    if w is None:
        missing.append(f"{name} (not installed, no {pattern} in {whl}/)")
    else:
        install.append(w)
if not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
    missing.append(f"Python.h for the native build (python{sys.version_info[0]}.{sys.version_info[1]}-dev)")
if not (shutil.which("gcc") or shutil.which("cc")):
    missing.append("a C compiler (gcc) for the native build")
print("MAJOR", major)
for m in missing:
    print("MISSING", m)
for w in install:
    print("INSTALL", w)
PYEOF
)
echo "$REQ_OUT" | sed 's/^/  /'
CUDA_MAJOR=$(echo "$REQ_OUT" | awk '$1=="MAJOR"{print $2}')
if echo "$REQ_OUT" | grep -q '^MISSING'; then
  verdict "requirements: MISSING $(echo "$REQ_OUT" | grep -c '^MISSING') (listed above; nothing else was run)"
  finish 4
fi
verdict "requirements: OK (CUDA $CUDA_MAJOR)"

# ---------------------------------------------------------------- 2. install, build, lmdb
mapfile -t TO_INSTALL < <(echo "$REQ_OUT" | awk '$1=="INSTALL"{print $2}')
if [ ${#TO_INSTALL[@]} -gt 0 ]; then
  step "install from $WHL (offline, no dependency resolution)"
  if ! "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check "${TO_INSTALL[@]}"; then
    verdict "install: FAIL (a carried wheel does not fit this Python/platform)"
    finish 4
  fi
  verdict "install: OK (${#TO_INSTALL[@]} wheels)"
fi

step "native build (mandatory)"
if timeout 120 "$PY" setup.py -q build_ext --inplace >/tmp/gpu_check_build.txt 2>&1 \
    && "$PY" -c "import umbp_nvme._uring"; then
  verdict "build: OK"
else
  tail -20 /tmp/gpu_check_build.txt
  verdict "build: FAIL (not a GDS problem; output above)"
  finish 1
fi
if "$PY" -c "import lmdb; print('lmdb', lmdb.version())"; then
  verdict "lmdb: OK"
else
  verdict "lmdb: FAIL"
  finish 1
fi

# ---------------------------------------------------------------- 3. the machine in one line
step "machine"
MACHINE=$(timeout 60 "$PY" - "$DRY" <<'PYEOF'
import ctypes, os, subprocess, sys

dry = sys.argv[1] == "1"
def smi():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        return out[0] if out else "none"
    except Exception:
        return "none (no nvidia-smi)"
def loads(name):
    try:
        ctypes.CDLL(name)
        return "loads"
    except OSError:
        return "absent"
udev = "readable" if os.access("/run/udev", os.R_OK) else "absent"
nvfs = "loaded" if os.path.exists("/proc/driver/nvidia-fs") or os.path.exists("/sys/module/nvidia_fs") else "absent"
if dry:
    sys.path.insert(0, "tests/support")
    import fake_kvikio
    # kvikio's AUTO needs a readable /run/udev for cuFile: the stub decides as kvikio would here
    fake_kvikio.install().core.cufile_available = udev == "readable"
    gpu, cufile = "stub (dry run: CUDA stubbed by tests/support/fake_kvikio.py)", "stub"
else:
    gpu, cufile = smi(), loads("libcufile.so.0")
from umbp_nvme.engine import gds
try:
    kv = gds._import_kvikio()
    failed = gds.configure_kvikio(kv, 32)
    s = gds.kvikio_settings(kv)
    kvline = (f"kvikio {kv.__version__}: compat_mode={s['compat_mode']} -> {s['compat_decision']}, "
              f"gds_driver={s['gds_driver_available']}, threads={s['num_threads']}, "
              f"gds_threshold={s['gds_threshold']}" + (f", NOT TAKEN: {failed}" if failed else ""))
except Exception as e:
    kvline = f"kvikio: import failed: {type(e).__name__}: {e}"
print(f"GPU: {gpu} | /run/udev: {udev} | nvidia-fs: {nvfs} | libcufile: {cufile} | {kvline}")
PYEOF
)
echo "$MACHINE"
if [ "$DRY" != 1 ] && echo "$MACHINE" | grep -q "^GPU: none"; then
  verdict "gpu: NONE (nvidia-smi sees no GPU)"
  finish 3
fi
case "$MACHINE" in
  *"-> cufile"*) verdict "compat decision: cuFile (each file is still checked: see the tests and the benchmark)" ;;
  *"-> posix"*) verdict "compat decision: POSIX (kvikio will not use GDS here; reasons on the line above)" ;;
  *) verdict "compat decision: UNKNOWN (line above)" ;;
esac

# ---------------------------------------------------------------- 4. tests
export KVIKIO_WHEEL_DIR="$PWD/$WHL"  # the real kvikio Python layer from the carried wheel
if [ "$DRY" = 1 ]; then
  step "GPU tests: skipped (dry run)"
  verdict "gpu-tests: SKIP (dry run)"
else
  step "GPU tests (tests/engine/test_gds_engine.py -k test_gpu_)"
  t=$(($(left) - 170)); [ "$t" -lt 30 ] && t=30
  timeout "$t" "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_gds_engine.py -k test_gpu_ 2>&1 | tee /tmp/gpu_check_gpu.txt
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ] || grep -q "SKIPPED" /tmp/gpu_check_gpu.txt; then
    verdict "gpu-tests: FAIL (exit $rc, or skipped on a GPU machine; reasons above)"
    finish 2
  fi
  verdict "gpu-tests: OK"
fi
step "GDS engine tests on the fake and the real kvikio layer"
t=$(($(left) - 150)); [ "$t" -lt 30 ] && t=30
timeout "$t" "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_gds_engine.py tests/store/test_gpu_buffer_routing.py -k "not test_gpu_" \
  2>&1 | tee /tmp/gpu_check_cpu.txt
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ]; then
  verdict "engine-tests: FAIL (exit $rc)"
  finish 1
fi
if grep -q "no kvikio-cu12/-cu13 wheel" /tmp/gpu_check_cpu.txt; then
  verdict "engine-tests: FAIL (the real kvikio layer was not tested: no wheel in $WHL/)"
  finish 1
fi
verdict "engine-tests: OK (fake and real kvikio Python layer)"

# ---------------------------------------------------------------- 5. benchmark
if [ "$DRY" = 1 ]; then
  step "benchmark: skipped (dry run)"
  verdict "bench: SKIP (dry run: no GPU)"
  finish 0
fi
step "benchmark: GDS into device memory vs io_uring into pinned host + copy"
t=$(($(left) - 5)); [ "$t" -lt 30 ] && t=30
timeout "$t" "$PY" tools/bench_gds.py --dir "$BENCH_DIR" --sizes 1 4 --total-mib 1024 \
  --queue-depth 32 --runs 3 --out bench-gds.json 2>&1 | tee /tmp/gpu_check_bench.txt
bench_rc=${PIPESTATUS[0]}
rm -rf "$BENCH_DIR"
grep -E '^# .*(-> path|target)' /tmp/gpu_check_bench.txt | sed 's/^# /  /'
case $bench_rc in
  0) verdict "bench: OK (cuFile served the bytes; GDS >= 0.9x io_uring + copy)"; finish 0 ;;
  2) verdict "bench: GDS FAIL (below the 0.9x target, or kvikio's bytes not served by cuFile; lines above)"; finish 2 ;;
  3) verdict "bench: NO GPU"; finish 3 ;;
  124) verdict "bench: FAIL (ran past the time budget)"; finish 1 ;;
  *) verdict "bench: FAIL (exit $bench_rc)"; finish 1 ;;
esac
