#!/usr/bin/env bash
# CI: the wheel that `make wheel` built installs into a fresh venv and runs with no compiler on
# PATH (as in an SGLang image without gcc): `umbp-nvme demo`, `umbp-nvme doctor --no-probe`, the
# installed docs the help names. Then a source build with no compiler on PATH must fail with the
# one line that names what to install. Usage: tools/wheel_check.sh [PYTHON] (default python3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
PY=${1:-python3.11}
whl=$(ls "$src"/dist/umbp_nvme-*.whl)
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
"$PY" -m venv "$w/venv"
"$w/venv/bin/pip" install -q "$whl"
cd "$w"  # not the checkout: the installed package must be the one that runs
bare=(env -i PATH="$w/venv/bin" HOME="$w")  # the venv's bin alone on PATH: no gcc, cc or make
"${bare[@]}" python -c 'import shutil, sys; sys.exit(any(map(shutil.which, ("gcc", "cc", "make"))))' \
  || { echo "wheel_check: a compiler is still on PATH" >&2; exit 1; }
echo "== wheel $(basename "$whl") installed with no compiler on PATH"
"${bare[@]}" umbp-nvme demo
"${bare[@]}" umbp-nvme doctor --no-probe --store "$w/store"
"${bare[@]}" umbp-nvme --help | grep -qx "Docs: $w/venv/lib/python3.*/site-packages/umbp_nvme/docs/cli.md" \
  || { echo "wheel_check: umbp-nvme --help does not name the installed docs" >&2; exit 1; }
echo "== a source build with no compiler on PATH"
cp -r "$src/setup.py" "$src/setup.cfg" "$src/pyproject.toml" "$src/README.md" "$src/MANIFEST.in" "$src/native" "$w/"
mkdir "$w/umbp_nvme" && cp "$src/umbp_nvme/__init__.py" "$w/umbp_nvme/"
if "${bare[@]}" pip install -q --no-deps "$w" >"$w/src.log" 2>&1; then
  echo "wheel_check: the source build without a compiler did not fail" >&2; exit 1
fi
grep "umbp_nvme: building its C extension needs a C compiler" "$w/src.log" \
  || { tail -30 "$w/src.log"; echo "wheel_check: no line naming what to install" >&2; exit 1; }
