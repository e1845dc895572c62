#!/usr/bin/env bash
# CI: every wheel that `make wheel` built (dist/umbp_nvme-*-cpXY-*.whl) installs into a fresh venv
# of its own Python, exactly as the README writes it, and runs there with no compiler on PATH (as
# in an SGLang image without gcc): `umbp-nvme --version`, `demo`, `doctor --no-probe`, the
# installed docs the help names. Then, once, a source build with no compiler on PATH must fail
# with the one line that names what to install.
# Usage: tools/wheel_check.sh   (the interpreters are found as tools/build_wheel.sh finds them)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=tools/pythons.sh
source tools/pythons.sh
src=$PWD
ver=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' umbp_nvme/__init__.py)
shopt -s nullglob
wheels=("$src"/dist/umbp_nvme-*.whl)
((${#wheels[@]})) || { echo "wheel_check: no dist/umbp_nvme-*.whl: run make wheel first" >&2; exit 1; }
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
pip_q=(-q --disable-pip-version-check)
t_all=$SECONDS

# check_wheel WHEEL DIR: install WHEEL into DIR/venv of its own Python and run it there.
check_wheel() {
  local whl=$1 d=$2 t0=$SECONDS name tag v py got
  name=$(basename "$whl")
  [[ "$name" == "umbp_nvme-$ver-"* ]] || { echo "wheel_check: $name is not version $ver (umbp_nvme/__init__.py)" >&2; return 1; }
  tag=$(echo "$name" | sed -n 's/^umbp_nvme-[^-]*-cp3\([0-9]*\)-.*/\1/p')
  v=3.$tag
  py=$(find_python "$v") || { missing_python "$v" wheel_check; return 1; }
  "$py" -m venv "$d/venv"
  # The README's two install lines. From the folder of wheels, pip picks this Python's own (checked
  # on a dry run: which file it takes); one wheel file with an extra is installed for real.
  (cd "$src" && "$d/venv/bin/pip" install "${pip_q[@]}" --dry-run --report "$d/report.json" --find-links dist 'umbp_nvme[metrics]')
  "$d/venv/bin/python" - "$d/report.json" "$name" <<'EOF2'
import json, sys
rep = json.load(open(sys.argv[1]))
urls = {i["metadata"]["name"].lower().replace("-", "_"): i["download_info"]["url"] for i in rep["install"]}
got = urls.get("umbp_nvme", "")
if not got.endswith("/" + sys.argv[2]) or "prometheus_client" not in urls:
    sys.exit(f"wheel_check: pip install --find-links dist 'umbp_nvme[metrics]' would install {sorted(urls.items())}, "
             f"not {sys.argv[2]} with prometheus_client")
EOF2
  "$d/venv/bin/pip" install "${pip_q[@]}" "$whl[metrics]"
  cd "$d"  # not the checkout: the installed package must be the one that runs
  local bare=(env -i PATH="$d/venv/bin" HOME="$d")  # the venv's bin alone on PATH: no gcc, cc or make
  "${bare[@]}" python -c 'import shutil, sys; sys.exit(any(map(shutil.which, ("gcc", "cc", "make"))))' \
    || { echo "wheel_check: a compiler is still on PATH" >&2; return 1; }
  "${bare[@]}" python -c 'import prometheus_client' \
    || { echo "wheel_check: the [metrics] extra did not install prometheus_client" >&2; return 1; }
  echo "== $name installed into a Python $v venv with no compiler on PATH"
  got=$("${bare[@]}" umbp-nvme --version)
  [[ "$got" == "umbp-nvme $ver (Python $v."* ]] || { echo "wheel_check: umbp-nvme --version says '$got'" >&2; return 1; }
  "${bare[@]}" umbp-nvme demo
  "${bare[@]}" umbp-nvme doctor --no-probe --store "$d/store"
  "${bare[@]}" umbp-nvme --help | grep -qx "Docs: $d/venv/lib/python$v/site-packages/umbp_nvme/docs/cli.md" \
    || { echo "wheel_check: umbp-nvme --help does not name the installed docs" >&2; return 1; }
  [[ -f "$d/venv/lib/python$v/site-packages/umbp_nvme/docs/CHANGELOG.md" ]] \
    && compgen -G "$d/venv/lib/python$v/site-packages/umbp_nvme-$ver.dist-info/licenses/LICENSE" >/dev/null \
    || { echo "wheel_check: LICENSE or CHANGELOG.md is missing from $name" >&2; return 1; }
  echo "== Python $v: $((SECONDS - t0)) s"
}

# All wheels at once (most of the time is pip and the demo's I/O, not CPU), each in its own
# folder and log; the logs are shown in order afterwards.
pids=()
for i in "${!wheels[@]}"; do
  mkdir -p "$w/$i"
  (set -e; check_wheel "${wheels[$i]}" "$w/$i") >"$w/$i.log" 2>&1 &
  pids+=("$!")
done
failed=0
for i in "${!wheels[@]}"; do
  rc=0
  wait "${pids[$i]}" || rc=$?
  grep -v "^WARNING: Location" "$w/$i.log" || true
  ((rc == 0)) || { echo "wheel_check: $(basename "${wheels[$i]}") failed (exit $rc)" >&2; failed=1; }
done
((failed == 0)) || exit 1
d="$w/0"
echo "== a source build with no compiler on PATH"
s="$w/src"
mkdir -p "$s/umbp_nvme"
cp -r "$src/setup.py" "$src/setup.cfg" "$src/pyproject.toml" "$src/README.md" "$src/MANIFEST.in" "$src/LICENSE" \
  "$src/CHANGELOG.md" "$src/native" "$s/"
cp "$src/umbp_nvme/__init__.py" "$s/umbp_nvme/"
bare=(env -i PATH="$d/venv/bin" HOME="$d")
if "${bare[@]}" pip install -q --no-deps "$s" >"$w/src.log" 2>&1; then
  echo "wheel_check: the source build without a compiler did not fail" >&2; exit 1
fi
grep "umbp_nvme: building its C extension needs a C compiler" "$w/src.log" \
  || { tail -30 "$w/src.log"; echo "wheel_check: no line naming what to install" >&2; exit 1; }
echo "wheel_check: ${#wheels[@]} wheel(s) checked in $((SECONDS - t_all)) s"
