#!/usr/bin/env bash
# Install the real sglang wheel (0.5.23 unless told otherwise) for the SGLang integration
# tests, on a CPU-only machine, without touching torch.
#
#   tools/install_sglang.sh [PYTHON]                    # install 0.5.23 into PYTHON's environment
#   tools/install_sglang.sh [PYTHON] --version 0.5.21   # another release (SUPPORTED_SGLANG below)
#   tools/install_sglang.sh [PYTHON] --check            # only report whether it imports
#
# PYTHON defaults to $PYTHON, then python3 (CI passes .venv/bin/python). Idempotent: a few
# seconds plus the smoke import when everything is already there. `make test-sglang-versions`
# (tools/test_sglang_versions.sh) runs tests/sglang against each supported release, each in a
# venv of its own.
#
# What it does:
#   1. `pip install --no-deps -r tools/requirements-sglang.txt` with the sglang line set to the
#      version asked for (pinned; --no-deps so pip never resolves sglang's own torch/triton/CUDA
#      pins and never replaces the CPU torch that is installed globally). The other pins are
#      0.5.23's; the older supported releases import with the same set.
#   2. Makes sure g++ and the OpenSSL headers exist (sglang JIT-builds its native
#      page-hash extension with torch.utils.cpp_extension + ninja on first use).
#   3. Smoke test: imports the modules the tests use and computes one page hash,
#      which also warms the JIT build cache (~/.cache/torch_extensions).
#
# torchvision is NOT installed: PyPI torchvision does not load beside CPU torch.
# The tests put umbp_nvme/bench/sglang_shims (an inert torchvision stand-in) on sys.path.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
PY="${PYTHON:-python3}"
# The releases the backend is tested against (make test-sglang-versions); the oldest is the first
# whose storage API it supports as tested (docs/sglang.md, "SGLang versions").
SUPPORTED_SGLANG="0.5.20 0.5.21 0.5.22 0.5.23"
VERSION=0.5.23
check_only=0
while (($#)); do
    case "$1" in
        --check) check_only=1 ;;
        --version) VERSION="${2:?install_sglang.sh: --version needs a release, one of: $SUPPORTED_SGLANG}"; shift ;;
        -*) echo "install_sglang.sh: unknown option $1" >&2; exit 2 ;;
        *) PY="$1" ;;
    esac
    shift
done
if [[ " $SUPPORTED_SGLANG " != *" $VERSION "* ]]; then
    echo "install_sglang.sh: sglang $VERSION is not one the backend is tested against ($SUPPORTED_SGLANG)" >&2
    exit 2
fi

smoke() {
    PYTHONPATH="$repo/umbp_nvme/bench/sglang_shims${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'PYEOF'
import hashlib, struct, sys, warnings
warnings.filterwarnings("ignore")
import torch
import sglang.srt.mem_cache.hicache_storage as hs
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, MambaPool  # noqa: F401
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: F401
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str
got = get_hash_str(list(range(8)), None, page_size=4)
want, prev = [], b""
for p in range(2):
    prev = hashlib.sha256(prev + b"".join(struct.pack("<I", t) for t in range(4 * p, 4 * p + 4))).digest()
    want.append(prev.hex())
assert got == want, (got, want)
import os
expect = os.environ.get("SGLANG_EXPECT")
assert not expect or __import__("sglang").__version__ == expect, (__import__("sglang").__version__, expect)
print(f"sglang {__import__('sglang').__version__} OK (torch {torch.__version__}, "
      f"HiCacheFile={hs.HiCacheFile.__name__}, native page hash OK)")
PYEOF
}

if ((check_only)); then
    smoke  # whichever version is there
    exit $?
fi

torch_before="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
if [[ "$torch_before" == none ]]; then
    echo "install_sglang.sh: torch is not installed; install the CPU torch first" >&2
    exit 1
fi

if ! command -v g++ >/dev/null || [[ ! -e /usr/include/openssl/sha.h ]]; then
    echo "install_sglang.sh: installing g++ and libssl-dev for sglang's native hash"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq g++ libssl-dev >/dev/null
fi

# Base packages: only those the environment lacks entirely (never up/downgrade what is there).
missing_base="$("$PY" - "$here/requirements-sglang-base.txt" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for line in open(sys.argv[1]):
    req = line.split("#", 1)[0].strip()
    if not req:
        continue
    try:
        version(req.split("==", 1)[0])
    except PackageNotFoundError:
        print(req)
PYEOF
)"
pip_install=("$PY" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps)
if [[ -n "$missing_base" ]]; then
    # shellcheck disable=SC2086  # one requirement per word
    "${pip_install[@]}" $missing_base
fi
reqs="$(mktemp)"
trap 'rm -f "$reqs"' EXIT
sed "s/^sglang==.*/sglang==$VERSION/" "$here/requirements-sglang.txt" >"$reqs"
"${pip_install[@]}" -r "$reqs"

torch_after="$("$PY" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_after" != "$torch_before" ]]; then
    echo "install_sglang.sh: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi

SGLANG_EXPECT="$VERSION" smoke
