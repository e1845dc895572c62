"""The doctor's ``page_hash`` item: whether SGLang's page-hash extension is already built.

SGLang (0.5.23) hashes each page's tokens with a C++ extension (``hicache_hash_cpp``) that
torch's cpp_extension JIT-builds with g++ on first use into ``TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions/py<ver>_<accelerator>/``). A server whose first prefetches wait for
that build (20-37 s on 2 cores) sees them time out, and L3 hits silently become recomputes. One
call before the server starts, with the server's TORCH_EXTENSIONS_DIR, builds it. Checked by
looking for the built library (no torch or SGLang import: the doctor stays fast).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys

from .findings import finding

EXTENSION = "hicache_hash_cpp"
WARM_COMMAND = ("python -c \"from sglang.srt.mem_cache.utils import get_hash_str; "
                "get_hash_str(list(range(8)), None, page_size=4)\"")


def extension_dirs(environ=None) -> list[str]:
    """Where torch would put (or find) the extension's build directory for this environment."""
    env = os.environ if environ is None else environ
    root = env.get("TORCH_EXTENSIONS_DIR")
    if root:
        return [os.path.join(root, EXTENSION)]
    cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    pyver = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    base = os.path.join(cache, "torch_extensions")
    found = sorted(glob.glob(os.path.join(base, f"{pyver}_*", EXTENSION)))
    return found or [os.path.join(base, f"{pyver}_<accelerator>", EXTENSION)]


def check_page_hash(findings: list, environ=None, sglang_present: bool | None = None) -> dict:
    if sglang_present is None:
        spec = importlib.util.find_spec("sglang")
        sglang_present = spec is not None and spec.origin is not None
    dirs = extension_dirs(environ)
    built = [d for d in dirs if os.path.isfile(os.path.join(d, f"{EXTENSION}.so"))]
    item = {"sglang": sglang_present, "dirs": dirs, "built": bool(built)}
    if not sglang_present:
        finding(findings, "page_hash", "info", "SGLang is not installed here: its page-hash extension is not checked")
    elif built:
        finding(findings, "page_hash", "ok", f"SGLang's page-hash extension is built ({built[0]})")
    else:
        finding(findings, "page_hash", "warn",
                f"SGLang's page-hash extension is not built in {dirs[0]}: the server builds it on its first "
                "prefetch (20-37 s on 2 cores), prefetches time out meanwhile and L3 hits become recomputes",
                f"before starting the server, with the same TORCH_EXTENSIONS_DIR, run once: {WARM_COMMAND}")
    return item
