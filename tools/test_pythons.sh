#!/usr/bin/env bash
# make test-pythons: the store, engine and CLI tests on each supported CPython (3.10-3.13), each
# in a venv of its own under $VENVS (default /tmp/umbp-py-venvs; kept, so a second run only
# reruns the tests). Not in .ci/run: .ci/run tests 3.11 in full and installs and runs every
# version's wheel (tools/wheel_check.sh).
#   PYTHONS="3.10 3.13" TESTS="tests/store" tools/test_pythons.sh
# torch (the test extra): 3.11 takes $TORCH311 (default torch==2.13.0, the CPU wheel `make venv`
# uses); the others take PyPI's torch, whose Linux wheels are CUDA builds (~5 GB a venv, run on the
# CPU here): override with TORCH="torch==X --index-url URL" where a CPU index is reachable.
# Prints one line per Python (the pytest summary); exits non-zero if any failed or is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD
# shellcheck source=tools/pythons.sh
source tools/pythons.sh
PYTHONS=${PYTHONS:-$SUPPORTED_PYTHONS}
VENVS=${VENVS:-/tmp/umbp-py-venvs}
TESTS=${TESTS:-tests/store tests/engine tests/cli}
TORCH=${TORCH:-torch}
TORCH311=${TORCH311:-torch==2.13.0}
mkdir -p "$VENVS"
results=() failed=0
for v in $PYTHONS; do
  py=$(find_python "$v") || { missing_python "$v" test_pythons; results+=("Python $v: no interpreter"); failed=1; continue; }
  venv="$VENVS/$v"
  log="$VENVS/$v.log"
  t0=$SECONDS
  torch=$TORCH
  [[ "$v" == 3.11 ]] && torch=$TORCH311
  {
    [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
    # shellcheck disable=SC2086  # TORCH may carry pip options
    "$venv/bin/pip" install -q --disable-pip-version-check $torch
    "$venv/bin/pip" install -q --disable-pip-version-check -e "$src[test]"  # builds this Python's _uring in place
  } >"$log" 2>&1 || { tail -20 "$log"; results+=("Python $v: install failed ($log)"); failed=1; continue; }
  rc=0
  # shellcheck disable=SC2086  # TESTS is a list of paths
  "$venv/bin/python" -m pytest -q -p no:cacheprovider $TESTS >>"$log" 2>&1 || rc=$?
  summary=$(grep -E "^=*.* (passed|failed|error)" "$log" | tail -1 | tr -d '=' | sed 's/^ *//')
  results+=("Python $v ($("$venv/bin/python" -c 'import platform; print(platform.python_version())')): ${summary:-no pytest summary} ($((SECONDS - t0)) s; $log)")
  ((rc == 0)) || failed=1
done
printf '%s\n' "${results[@]}"
exit $failed
