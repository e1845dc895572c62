"""Whether the file system under a store can hold the capacity it is opened with.

A capacity past what the drive holds is accepted (the store shrinks its effective capacity when
a segment file cannot be made, and keeps caching), but the operator should hear it at open, not
from a full disk later: one WARNING naming both numbers and the fix. Several roots need nothing
here: each drive's share is already capped to its file system (drive_set.py) with a WARNING.
A writer's open calls it (opening.py), so the Python API, the CLI and the SGLang backend all say it.

State: none (statvfs of the roots).
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


def warn_if_short(roots: list[str], capacity_bytes: int) -> str | None:
    """Log the capacity_shortfall of a single-root store once, as a WARNING; returns it."""
    if len(roots) != 1:
        return None
    msg = capacity_shortfall(roots[0], int(capacity_bytes))
    if msg is not None:
        log.warning("%s", msg)
    return msg
