"""The drive set of a multi-drive store: each drive's capacity share, and which drives it had.

Each root records the set it was last opened with (``DRIVES.json``: roots and object counts at
close, its identity and the writer sessions it took part in: drive_identity.py, drive_sessions.py). A root that was in the
recorded set and is not configured now was removed: its pages are gone from this store, and the
open says so once, with the count recorded at the last close. The remaining drives open as usual
(removing a drive never refuses the rest); a removed drive added back is cleared before it
serves (it missed the sessions run without it).

Reads: the drive stores' object counts. Changes: nothing of a PageStore (the drive set's files).
"""

from __future__ import annotations

import logging
import os

from ..config import StoreConfig
from .layout import read_json_or_none, read_manifest_or_none, recorded_capacity_bytes, segment_disk_bytes, write_json_atomic
from .mounts import nearest_above

log = logging.getLogger("umbp_nvme.store")

DRIVES_FILE = "DRIVES.json"


def _free_bytes(root: str) -> int:
    """Free bytes (for an unprivileged writer) on the file system that holds ``root``."""
    vfs = os.statvfs(nearest_above(root, os.path.exists))
    return vfs.f_bavail * vfs.f_frsize


def drive_capacities(roots: list[str], config: StoreConfig, *, sized: bool, skip=None) -> list[int]:
    """``ssd_capacity_bytes`` split evenly over the drives, whole segments, at least one each.

    ``sized`` (a writer that runs with the config's capacity): a share never exceeds what the
    drive's file system can hold (free space plus this store's own segment files), except that a
    drive keeps the capacity its store already records (lowering it would evict its pages).
    ``skip[i]``: not sized now (a drive held out as unmounted: its file system is not there yet).
    """
    seg = int(config.ssd_segment_size_bytes)
    share = capacity_share(config, len(roots))
    if not sized:
        return [share] * len(roots)
    return [share if skip and skip[i] else sized_share(r, share, seg) for i, r in enumerate(roots)]


def capacity_share(config: StoreConfig, n: int) -> int:
    """One drive's even share of ``ssd_capacity_bytes`` over ``n`` drives (whole segments, at least one)."""
    seg = int(config.ssd_segment_size_bytes)
    return max(seg, int(config.ssd_capacity_bytes) // n // seg * seg)


def sized_share(root: str, share: int, seg: int) -> int:
    """``share`` capped by what the file system under ``root`` can hold (see drive_capacities)."""
    try:
        room = (_free_bytes(root) + segment_disk_bytes(root)) // seg * seg
    except OSError:
        room = share  # the open will report the drive
    m = read_manifest_or_none(root) if os.path.isdir(root) else None
    recorded = (recorded_capacity_bytes(m) or 0) if m else 0
    cap = min(share, max(room, recorded, seg))
    if cap < share:
        log.warning("drive %s: capacity share %d B lowered to %d B (what its file system can hold)", root, share, cap)
    return cap


def read_set(root: str) -> dict:
    d = read_json_or_none(os.path.join(root, DRIVES_FILE))  # a FIFO or deep nesting there: no record
    return d if isinstance(d, dict) else {}


def note_drive_set(roots: list[str], recs: list[dict]) -> list[dict]:
    """Removed drives ({root, objects}) named by the recorded sets ``recs`` (read_set of each root)."""
    now = set(roots)
    removed: dict[str, int] = {}
    for rec in recs:
        counts = rec.get("objects") if isinstance(rec.get("objects"), dict) else {}
        for old in rec.get("roots") or []:
            if isinstance(old, str) and old not in now:
                n = counts.get(old)
                removed[old] = max(removed.get(old, 0), n if isinstance(n, int) else 0)
    out = [{"root": r, "objects": n} for r, n in sorted(removed.items())]
    for d in out:
        log.warning("drive %s was in this store's drive set and is not configured now: its %d objects (as "
                    "counted at the last close) are no longer served; the other drives serve theirs",
                    d["root"], d["objects"])  # fmt: skip
    return out


def set_fields(roots: list[str], stores: list, health: dict | None = None) -> dict:
    """What DRIVES.json keeps of the set beside the writer session (drive_sessions.py): the roots,
    each open drive's object count and (``health``: root -> DriveHealth.record) each drive's state,
    so that ``umbp-nvme stats`` shows what a running writer last recorded."""
    rec = {"roots": list(roots), "objects": {r: st.object_count() for r, st in zip(roots, stores) if st is not None}}
    if health is not None:
        rec["health"] = health
    return rec


def write_record(path: str, rec: dict) -> None:
    """Replace one drive's DRIVES.json, durably (written, fsynced, renamed, directory fsynced)."""
    write_json_atomic(path, rec)


def recorded_health(root: str) -> dict | None:
    """The state a writer last recorded for the drive at ``root``: the newest DRIVES.json among
    the set's drives that names it (a degraded drive's own record is not updated)."""
    own = read_set(root)
    best = None
    for r in own.get("roots") or [root]:
        h = (read_set(r).get("health") or {}).get(os.path.abspath(root))
        if isinstance(h, dict) and (best is None or h.get("at", 0) > best.get("at", 0)):
            best = h
    return best
