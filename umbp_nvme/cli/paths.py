"""The paths an operator gives `umbp-nvme`: expanded, checked, and explained when they fail.

Each failure gets one line that names the path, what it is, and the fix: a ``~`` the shell left
alone (quoted) is the home directory; a store path that is a file is not "missing"; a directory
that holds stores one level down (a kept demo, rank subdirectories) names them; a permission
error names the owner and mode it met.
"""

from __future__ import annotations

import json
import os
import stat

from ..store.layout import MANIFEST_FILE

_PATH_ARGS = ("keep", "out", "keys", "replay", "namespace", "config")


def expand_paths(args) -> None:
    """``~`` and ``~user`` in the paths of ``args``, as the shell would have done unquoted."""
    store = getattr(args, "store", None)
    if isinstance(store, str) and "~" in store:
        args.store = expand_store(store)
    for name in _PATH_ARGS:
        v = getattr(args, name, None)
        if isinstance(v, str) and v.startswith("~") and (name not in ("namespace", "config") or not v.lstrip().startswith("{")):
            setattr(args, name, os.path.expanduser(v))
    if getattr(args, "sources", None):
        args.sources = [expand_store(s) if s.startswith("~") else s for s in args.sources]


def expand_store(value: str) -> str:
    """One root, a comma list or a JSON list, each root with ``~`` expanded (same form back)."""
    from ..config import parse_roots

    roots = [os.path.expanduser(r) for r in parse_roots(value)]
    if len(roots) == 1:
        return roots[0]
    return json.dumps(roots) if value.lstrip().startswith("[") or any("," in r for r in roots) else ",".join(roots)


def store_path_error(store: str) -> str | None:
    """Why ``store`` (one root or several) cannot be a store directory as given, else None."""
    from ..config import parse_roots

    for root in parse_roots(store):
        if os.path.lexists(root) and not os.path.isdir(root):
            what = "a symlink to nothing" if os.path.islink(root) else "a file"
            return (f"--store {root} is {what}, not a directory; give the store's directory (one rank's "
                    "ssd_storage_dir), or a new path for a writing command to create")
    return None


def stores_below(path: str) -> list[str]:
    """Subdirectories of ``path`` that are stores (a demo kept with --keep, rank directories tp0, tp1)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n, MANIFEST_FILE))]


def not_a_store_hint(store: str) -> str:
    """A sentence to add when ``store`` is a directory without a store but with stores inside it."""
    below = stores_below(store) if isinstance(store, str) and os.path.isdir(store) else []
    if not below:
        return ""
    shown = ", ".join(below[:4]) + (", ..." if len(below) > 4 else "")
    return f"; it holds {'a store' if len(below) == 1 else 'stores'} one level down: --store {shown}"


def permission_message(e: PermissionError, store: str | None = None) -> str:
    """'permission denied: PATH (DIR: owner uid U, mode M; this process runs as uid V); the fix'."""
    path = e.filename or ""
    d = path if os.path.isdir(path) else os.path.dirname(path) or "."
    try:
        st = os.stat(d)
        seen = f"{d}: owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}"
    except OSError:
        seen = f"{d} cannot be examined"
    head = f"permission denied: {path} ({seen}; this process runs as uid {os.geteuid()})"
    roots = _roots(store)
    if path and any(os.path.abspath(path).startswith(os.path.abspath(r) + os.sep) or os.path.abspath(path) == os.path.abspath(r)
                    for r in roots):
        return (f"{head}. The store directory must be writable by the user who runs umbp-nvme (its index lock is "
                f"written even by stats): chmod -R u+w {d}, or run as its owner")
    return f"{head}. Give this user access to {d} (chmod / chown), or choose another path"


def _roots(store) -> list[str]:
    from ..config import parse_roots

    try:
        return parse_roots(store) if isinstance(store, str) and store else []
    except ValueError:
        return []


def docs_dir() -> str:
    """The docs of this installation: umbp_nvme/docs in a wheel, docs/ beside the package in a checkout."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # umbp_nvme/ (this is umbp_nvme/cli/)
    for d in (os.path.join(package, "docs"), os.path.join(os.path.dirname(package), "docs")):
        if os.path.isfile(os.path.join(d, "cli.md")):
            return d
    return "docs/ in the source tree"
