"""Is a root's drive mounted: ``ssd_require_mount`` and the multi-drive guard (Swift's mount_check).

When a drive is not mounted, its mount point is an empty directory on the file system below it
(usually /): a writer that created its store there would fill that file system, and the files
would be hidden once the drive is mounted over them. ``unmounted_reason`` says why a root must
not be opened (None: open it); drives.py keeps such a drive degraded without touching it, and the
probe (drive_probe.py) opens it once the rule passes. ``os.path.ismount`` is looked up at call
time (tests replace it).

* ``ssd_require_mount`` on: a root must lie on a mounted drive: the root itself or a directory
  above it other than ``/`` is a mount point (``/mnt/nvme0/hicache/tp0`` passes when ``/mnt/nvme0``
  is mounted). A single-root store refuses to open (``DriveNotMountedError``).
* always, for several roots: a root that holds no store yet is held out when its drive directory
  is not a mount point while another root's is (a per-drive mount layout with one drive missing).
  A root's drive directory is the root less the trailing path all roots share (``/mnt/nvme1`` for
  ``/mnt/nvme0/hicache`` and ``/mnt/nvme1/hicache``; the root itself when they share none). Plain
  directories (tests, tmp), a single root and a root that holds a store are never held out by it.

State: none.
"""

from __future__ import annotations

import os

from ..errors import DriveNotMountedError
from .layout import MANIFEST_FILE


def nearest_above(path: str, pred) -> str:
    """The nearest directory at or above ``path`` for which ``pred`` holds (``/`` when none does)."""
    p = os.path.abspath(path)
    while not pred(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def mount_above(path: str) -> str:
    """The nearest mount point at or above ``path`` (``/`` when none below it is one)."""
    return nearest_above(path, os.path.ismount)  # looked up per call: tests patch it


def drive_dirs(roots: list[str]) -> list[str]:
    """Each root less the trailing path components that every root shares (never down to ``/``)."""
    parts = [os.path.abspath(r).split(os.sep) for r in roots]  # "/a/b" -> ["", "a", "b"]
    n = 0
    while all(len(p) > n + 2 for p in parts) and len({p[-1 - n] for p in parts}) == 1:
        n += 1
    return [os.sep.join(p[: len(p) - n]) for p in parts]


def unmounted_reason(i: int, roots: list[str], require: bool) -> str | None:
    """Why root ``i`` of ``roots`` must not be opened (its drive looks unmounted), or None."""
    root = os.path.abspath(roots[i])
    if require and mount_above(root) == os.sep:
        return (f"{root} is not on a mounted drive (ssd_require_mount is on and no directory above it "
                "but / is a mount point)")  # fmt: skip
    if len(roots) < 2 or os.path.lexists(os.path.join(root, MANIFEST_FILE)):
        return None
    dirs = drive_dirs(roots)
    if os.path.ismount(dirs[i]):
        return None
    mounted = [d for j, d in enumerate(dirs) if j != i and os.path.ismount(d)]
    if not mounted:
        return None
    return (f"its drive looks unmounted: {dirs[i]} is not a mount point while {mounted[0]} is, and {root} holds "
            "no store (a store created there would fill the file system under it)")  # fmt: skip


def check_mounted(path: str, require: bool) -> None:
    """A single-root open: raise DriveNotMountedError when ``ssd_require_mount`` refuses ``path``."""
    why = unmounted_reason(0, [path], require) if require else None
    if why:
        raise DriveNotMountedError(f"{why}; nothing was created there: mount the drive, or turn ssd_require_mount off")
