#!/usr/bin/env bash
# Install NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, from the
# `ai-dynamo-runtime` wheel) in a venv of its own, for `umbp-nvme bench fleet --dynamo-python`
# and the Dynamo half of tests/cli/test_bench_fleet.py. Opt-in: nothing else needs it.
#
#   tools/install_dynamo.sh [VENV]          # default .venv-dynamo (next to .venv)
#   tools/install_dynamo.sh [VENV] --check  # only report whether it imports
#
# Its own venv because the wheel pins its own pydantic/uvloop and needs none of ours; CPU only,
# no NATS or etcd (the indexer runs HTTP + ZMQ). About 75 MB, ~10 s with a warm package index.
# Idempotent: a second run only checks the import. Exits 1 when pip cannot get the wheel
# (offline): callers that treat Dynamo as optional should say so and go on.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
VENV="$repo/.venv-dynamo"
VERSION="1.6.1"  # the version docs/fleet.md and /work/shared/docs/fleet-events.md were measured with
check_only=0
for arg in "$@"; do
    case "$arg" in
        --check) check_only=1 ;;
        -*) echo "install_dynamo.sh: unknown option $arg" >&2; exit 2 ;;
        *) VENV="$arg" ;;
    esac
done
PY="$VENV/bin/python"

imports() {
    [[ -x "$PY" ]] && "$PY" - <<'PYEOF'
import importlib.util, sys
from importlib.metadata import version
if importlib.util.find_spec("dynamo.indexer") is None:
    sys.exit(1)
print(f"dynamo.indexer importable (ai-dynamo-runtime {version('ai-dynamo-runtime')})")
PYEOF
}

if ((check_only)); then
    imports
    exit $?
fi
if imports 2>/dev/null; then
    exit 0
fi
base="$(command -v python3.11 || command -v python3)"
"$base" -m venv "$VENV"
if ! "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore "ai-dynamo-runtime==$VERSION"; then
    echo "install_dynamo.sh: pip could not install ai-dynamo-runtime==$VERSION (offline?)" >&2
    exit 1
fi
imports
echo "use: umbp-nvme bench fleet --dynamo-python $PY   (or UMBP_DYNAMO_PYTHON=$PY)"
