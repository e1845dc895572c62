"""Whether the file system under a store can hold the capacity it is opened with.

A capacity past what the drive holds is accepted (the store shrinks its effective capacity when
a segment file cannot be made, and keeps caching), but the operator should hear it at open, not
from a full disk later: one WARNING naming both numbers and the fix. Several roots need nothing
here: each drive's share is already capped to its file system (drive_set.py) with a WARNING.
A writer's open calls it (opening.py), so the Python API, the CLI and the SGLang backend all say it.

The same for the stores beside each other under one directory (``stores_shortfall``): SGLang's
ranks each open a store directory under ``ssd_storage_dir``, each sized ``ssd_capacity_bytes``
(per rank, docs/sglang.md §9), so 8 ranks of 512 GiB ask one drive for 4 TiB while each alone
fits. The backend calls it once its own store is open (its manifest recorded): whichever rank
checks last sees every rank's manifest, so at least one rank warns (issue 35).

State: none (statvfs of the roots, the manifests and segment files beside them).
"""

from __future__ import annotations

import logging
import os

from ..sizes import format_bytes

log = logging.getLogger("umbp_nvme.store")


def capacity_shortfall(root: str, capacity_bytes: int) -> str | None:
    """The warning for ``root`` when its file system cannot hold ``capacity_bytes`` (its free space
    plus the store's own segment files), else None; None too when the file system cannot be asked."""
    from .layout import segment_disk_bytes
    from .mounts import nearest_above

    try:
        vfs = os.statvfs(nearest_above(root, os.path.exists))
        used = segment_disk_bytes(root) if os.path.isdir(root) else 0
    except OSError:
        return None  # the open reports the path itself
    free = vfs.f_bavail * vfs.f_frsize
    if capacity_bytes <= free + used:
        return None
    held = f"{format_bytes(free)} free" + (f" + {format_bytes(used)} in its segment files" if used else "")
    return (f"capacity {format_bytes(capacity_bytes)} is more than the file system under {root} can hold "
            f"({held}); the store will fill up short of it (stats: effective_capacity_bytes). Lower "
            "ssd_capacity_bytes (--capacity) below that, or free space on the drive")


def stores_in(root: str) -> list[tuple[str, int, int]]:
    """(directory, recorded capacity, bytes in its segment files) of each store at ``root`` and in
    its subdirectories, one level down: the stores SGLang's ranks open under ``ssd_storage_dir``."""
    from .layout import read_manifest_or_none, recorded_capacity_bytes, segment_disk_bytes

    try:
        with os.scandir(root) as it:
            dirs = sorted(e.path for e in it if e.is_dir(follow_symlinks=False))
    except OSError:
        return []
    out = []
    for d in [root, *dirs]:
        try:
            m = read_manifest_or_none(d)
        except Exception:  # noqa: BLE001 - a damaged neighbour is its own writer's business
            continue
        cap = recorded_capacity_bytes(m) if m else None
        if cap:
            out.append((d, cap, segment_disk_bytes(d)))
    return out


def stores_shortfall(root: str) -> str | None:
    """The warning when the stores under ``root`` (two or more) ask more together than its file
    system can hold (its free space plus their segment files), with the per-store capacity that
    fits; else None."""
    stores = stores_in(root)
    if len(stores) < 2:
        return None
    try:
        vfs = os.statvfs(root)
    except OSError:
        return None
    free = vfs.f_bavail * vfs.f_frsize
    total, used = sum(s[1] for s in stores), sum(s[2] for s in stores)
    if total <= free + used:
        return None
    names = [os.path.relpath(d, root) for d, _, _ in stores]
    shown = ", ".join(names[:4]) + (f", ... ({len(names)} in all)" if len(names) > 4 else "")
    return (f"the {len(stores)} stores under {root} ({shown}) ask {format_bytes(total)} together, more than its "
            f"file system can hold ({format_bytes(free)} free" + (f" + {format_bytes(used)} in their segment files"
                                                                  if used else "")
            + "): ssd_capacity_bytes is per store directory, and each rank (tensor-parallel, pipeline, "
            "attention-DP) has its own. They will fill up short of it. Set ssd_capacity_bytes to at most "
            f"{format_bytes((free + used) // len(stores))} (the room divided by {len(stores)}), or free space")


def warn_if_stores_short(root: str) -> str | None:
    """Log ``stores_shortfall(root)`` as a WARNING; returns it."""
    msg = stores_shortfall(root)
    if msg is not None:
        log.warning("%s", msg)
    return msg


def warn_if_short(roots: list[str], capacity_bytes: int) -> str | None:
    """Log the capacity_shortfall of a single-root store once, as a WARNING; returns it."""
    if len(roots) != 1:
        return None
    msg = capacity_shortfall(roots[0], int(capacity_bytes))
    if msg is not None:
        log.warning("%s", msg)
    return msg
