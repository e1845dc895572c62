#!/usr/bin/env bash
# make test-sglang-versions: tests/sglang against each supported SGLang release, each installed
# (tools/install_sglang.sh --version V) into a Python 3.11 venv of its own under $VENVS
# (default /tmp/umbp-sglang-venvs; kept, so a second run only reruns the tests). Not in .ci/run:
# each release costs ~250 MB of wheels and a full tests/sglang run (minutes); .ci/run tests 0.5.23.
#   VERSIONS="0.5.21 0.5.23" tools/test_sglang_versions.sh   # some of them
# Prints one line per release (the pytest summary); exits non-zero if any release failed.
# Needs the network (PyPI) the first time, gcc, g++ and libssl-dev (sglang's JIT page hash).
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
# shellcheck source=tools/pythons.sh
source tools/pythons.sh
supported=$(sed -n 's/^SUPPORTED_SGLANG="\(.*\)"$/\1/p' tools/install_sglang.sh)
VERSIONS=${VERSIONS:-$supported}
VENVS=${VENVS:-/tmp/umbp-sglang-venvs}
TORCH=${TORCH:-torch==2.13.0}
py=$(find_python 3.11) || { missing_python 3.11 test_sglang_versions; exit 1; }  # the sglang wheels are cp311
mkdir -p "$VENVS"
results=() failed=0
for v in $VERSIONS; do
  [[ " $supported " == *" $v "* ]] || { echo "test_sglang_versions: $v is not in install_sglang.sh's SUPPORTED_SGLANG ($supported)" >&2; exit 2; }
  venv="$VENVS/$v"
  log="$VENVS/$v.log"
  # Each release JIT-builds its own page-hash extension under one name: in the shared
  # ~/.cache/torch_extensions, one venv's build replaces another's (and races any other sglang
  # test on this machine). Each venv builds into its own folder.
  export TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
  t0=$SECONDS
  {
    [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "$TORCH"
    "$venv/bin/pip" install -q --disable-pip-version-check -e "$src[test]"
    bash tools/install_sglang.sh "$venv/bin/python" --version "$v"
  } >"$log" 2>&1 || { tail -20 "$log"; results+=("sglang $v: install failed ($log)"); failed=1; continue; }
  rc=0
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/sglang >>"$log" 2>&1 || rc=$?
  summary=$(grep -E "^=*.* (passed|failed|error)" "$log" | tail -1 | tr -d '=' | sed 's/^ *//')
  results+=("sglang $v: ${summary:-no pytest summary} ($((SECONDS - t0)) s; $log)")
  ((rc == 0)) || failed=1
done
printf '%s\n' "${results[@]}"
exit $failed
