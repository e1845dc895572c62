#!/usr/bin/env bash
# Install what SGLang 0.5.23's HTTP server (`python -m sglang.launch_server`) needs on top of
# tools/install_sglang.sh (which installs the wheel --no-deps and what its HiCache parts import):
# the real-server test (tests/sglang/test_real_server.py) and `umbp-nvme bench server` use it.
#
#   tools/install_sglang_server.sh [PYTHON]          # install into PYTHON's environment
#   tools/install_sglang_server.sh [PYTHON] --check  # only report whether the server imports
#
# PYTHON defaults to $PYTHON, then python3. Idempotent: when every package is there it only runs
# the import check (a few seconds). Run tools/install_sglang.sh first.
#
# These are resolved with their dependencies (unlike the wheel itself) but under a constraint
# that pins the torch already installed: pip may never replace the CPU torch.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
check_only=0
for arg in "$@"; do
    case "$arg" in
        --check) check_only=1 ;;
        -*) echo "install_sglang_server.sh: unknown option $arg" >&2; exit 2 ;;
        *) PY="$arg" ;;
    esac
done

# What the server imports at start (fastapi app, uvicorn loop, the tokenizer manager's parsers,
# the OpenAI-compatible routes) and the plain CPU environment lacks. openai is pinned to the
# version 0.5.23's routes were written against; python-dateutil<3 is what its date parsing needs.
PACKAGES=(fastapi uvicorn uvloop setproctitle interegular partial-json-parser prometheus-client
          python-multipart einops xxhash zstandard distro watchfiles "openai==2.8.0"
          "python-dateutil<3" jsonschema xgrammar soundfile)

smoke() {
    "$PY" - <<'PYEOF'
import importlib, warnings
warnings.filterwarnings("ignore")
for m in ("fastapi", "uvicorn", "uvloop", "setproctitle", "interegular", "partial_json_parser",
          "prometheus_client", "multipart", "einops", "xxhash", "zstandard", "distro", "watchfiles",
          "openai", "dateutil", "jsonschema", "xgrammar", "soundfile"):
    importlib.import_module(m)
import sglang
print(f"sglang {sglang.__version__}: the HTTP server's dependencies import")
PYEOF
}

if ((check_only)); then
    smoke
    exit $?
fi

if ! "$PY" -c 'import sglang' 2>/dev/null; then
    echo "install_sglang_server.sh: sglang is not installed; run tools/install_sglang.sh $PY first" >&2
    exit 1
fi

missing="$("$PY" - "${PACKAGES[@]}" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        if req.specifier.contains(version(req.name), prereleases=True):
            continue
    except PackageNotFoundError:
        pass
    print(spec)
PYEOF
)"
if [[ -n "$missing" ]]; then
    torch_before="$("$PY" -c 'import torch; print(torch.__version__)')"
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==$torch_before" >"$constraints"
    echo "install_sglang_server.sh: installing $(echo $missing | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one requirement per word
    "$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
        -c "$constraints" $missing
    torch_after="$("$PY" -c 'import torch; print(torch.__version__)')"
    if [[ "$torch_after" != "$torch_before" ]]; then
        echo "install_sglang_server.sh: torch changed from $torch_before to $torch_after" >&2
        exit 1
    fi
fi
smoke
