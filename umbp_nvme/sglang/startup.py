"""What the backend says when its store opens (issue 35): the directory and capacity in use.

One INFO line per rank naming its store directory, the capacity it runs with (as its manifest
records it) and where that came from, with the reminder that ``ssd_capacity_bytes`` is per store
directory; a WARNING when the directory or the capacity is the default (``/tmp/umbp_ssd``, 32 GiB:
nobody chose them); and, on a writer, a WARNING when the stores under a root (one per rank) ask
more together than its file system holds (store/fs_room.py). Never fails an open.

Reads the seam's settings and store directories; changes nothing.
"""

from __future__ import annotations

import logging
import os

from ..config import DEFAULT_STORAGE_DIR, StoreConfig
from ..sizes import format_bytes
from ..store.fs_room import stores_in, warn_if_stores_short
from ..store.layout import read_manifest_or_none, recorded_capacity_bytes

log = logging.getLogger("umbp_nvme.sglang_backend")


def _role(seam) -> str:
    sc = seam.storage_config
    parts = [f"{name} {int(getattr(sc, rank, 0) or 0)}" for name, rank, size in
             (("pp rank", "pp_rank", "pp_size"), ("tp rank", "tp_rank", "tp_size")) if int(getattr(sc, size, 1) or 1) > 1]
    return " ".join(parts + ["reads the leader's store" if seam.follower else "writes store"])


def capacity_in_use(dirs: list[str]) -> int | None:
    """The capacity the stores in ``dirs`` record (their writer runs with it), summed over drives."""
    caps = []
    for d in dirs:
        try:
            caps.append(recorded_capacity_bytes(read_manifest_or_none(d) or {}))
        except Exception:  # noqa: BLE001 - a message must not fail the open
            caps.append(None)
    return sum(caps) if caps and all(caps) else None


def announce(seam) -> None:
    """Log the store this rank opened (INFO), the defaults it runs with (WARNING) and a node total
    past the file system (WARNING). Called once the store is open: its manifest is recorded."""
    try:
        _announce(seam)
    except Exception as e:  # noqa: BLE001 - the log line never costs the cache
        log.debug("umbp_nvme: the open's summary line failed: %r", e)


def _announce(seam) -> None:
    cfg, src = seam.config, seam.settings_from
    cap = capacity_in_use(seam.store_dirs) or cfg.ssd_capacity_bytes
    roots = cfg.storage_roots
    where = f"from {src['ssd_capacity_bytes']}" if "ssd_capacity_bytes" in src else "not set: the default"
    drives = f", split over {len(roots)} drives" if len(roots) > 1 else ""
    node = []
    for root in roots:
        stores = stores_in(os.path.abspath(root))
        if len(stores) > 1:
            node.append(f"the {len(stores)} stores under {root} ask {format_bytes(sum(s[1] for s in stores))} together")
    log.info("umbp_nvme: %s %s with capacity %s (ssd_capacity_bytes %s; per store directory: each rank has "
             "its own%s)%s", _role(seam), seam.store_dir, format_bytes(cap), where, drives,
             "; " + "; ".join(node) if node else "")
    if "ssd_storage_dir" not in src and cfg.ssd_storage_dir == DEFAULT_STORAGE_DIR:
        log.warning("umbp_nvme: ssd_storage_dir is not set (extra_config or UMBP_SSD_DIR), so the store is in the "
                    "default %s: /tmp is often memory (tmpfs) or the root disk, and may be emptied at reboot. Set "
                    "ssd_storage_dir to a directory on the NVMe drive", seam.store_dir)
    if "ssd_capacity_bytes" not in src and cfg.ssd_capacity_bytes == StoreConfig.ssd_capacity_bytes:
        log.warning("umbp_nvme: ssd_capacity_bytes is not set (extra_config or UMBP_SSD_CAPACITY), so %s runs with "
                    "the default %s. Set it per rank: the drive's room divided by the ranks that share it",
                    seam.store_dir, format_bytes(cap))
    if not seam.follower:
        for root in roots:
            warn_if_stores_short(os.path.abspath(root))
