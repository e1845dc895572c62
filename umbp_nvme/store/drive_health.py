"""One drive's health in a multi-drive store: healthy or degraded (and why), errors, throughput.

A drive is degraded at once when one of its calls ends with I/O errors, outlives io_timeout_s
(stalled), its directory disappears, or its file system fills up. Degraded: its reads miss
without waiting, writes go to the other drives, exists stops reporting its pages; a full drive
keeps serving reads (its pages are intact), only writes avoid it. One WARNING per change of state
names the drive and the reason. ``drives.MultiDriveStore`` probes degraded drives and re-admits
them; this module keeps the state and the two probe steps it runs on a drive (read back, owed deletes).

Reads: a drive store's counters() and, to probe, any_key() and a get through its public calls.
Changes: only its own DriveHealth.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import numpy as np

log = logging.getLogger("umbp_nvme.store")

# Store counters whose growth during a call means the drive failed it (not a miss or a bad key).
ERROR_COUNTERS = ("io_errors_read", "io_errors_write", "io_errors_sync", "timeouts")
FULL = "full"
UNRECORDED = "unrecorded"  # its session record (DRIVES.json) could not be written: reads only (drive_sessions.py)
FOREIGN = "foreign"  # another store's drive: never opened (drive_identity.py)
UNMOUNTED = "unmounted"  # held out at open: its drive looks unmounted (mounts.py); opened once mounted
FLAP_S = 10.0  # degraded again within this long after rejoining: back off the probes
MAX_BACKOFF_S = 60.0


class DriveHealth:
    def __init__(self, index: int, root: str):
        self.index = index
        self.root = root
        self.state = "healthy"
        self.reason: str | None = None
        self.kind: str | None = None  # "stall" | "io_error" | "gone" | "full" | "open" | "unmounted" | ...
        self.since = 0.0
        self.errors = 0  # failed ops and stalls seen on this drive
        self.degradations = 0
        self.pending = 0  # calls in flight on this drive (a stalled one keeps it above 0)
        self.probing = False
        self._busy = {"get": 0, "put": 0}  # calls of each kind in flight
        self._busy_from = {"get": 0.0, "put": 0.0}
        self.busy_s = {"get": 0.0, "put": 0.0}  # time with at least one such call in flight (for GB/s)
        self.deletes_owed: set[str] = set()  # deletes to apply before the drive serves again
        self.clear_owed = False  # the store was cleared while it was degraded: it clears before serving
        self.behind = False  # a reader's: it missed a writer session; served once a writer cleared it
        self.owed_unlogged: set[str] = set()  # owed deletes no log recorded (kept in memory): logged again when owed again
        self.readmitted_at = -1e9
        self.backoff_s = 0.0  # a drive that fails again right after rejoining is probed less often
        self.probe_after = 0.0  # monotonic time of its next probe
        self.changed = False  # a change of state not yet recorded in DRIVES.json (for the CLI)
        self.on_readable = None  # (index, readable) -> None: called when its pages start or stop being served

    @property
    def healthy(self) -> bool:
        return self.state == "healthy"

    @property
    def readable(self) -> bool:
        return self.state == "healthy" or self.kind in (FULL, UNRECORDED)

    @property
    def takes_deletes(self) -> bool:
        """Deleted on at once (an unrecorded drive takes no writes: its deletes are owed)."""
        return self.state == "healthy" or self.kind == FULL

    @property
    def writable(self) -> bool:
        return self.state == "healthy"

    def _readable_now(self, was: bool) -> None:
        if self.readable != was and self.on_readable is not None:
            self.on_readable(self.index, self.readable)

    def degrade(self, kind: str, reason: str) -> None:
        if self.state == "degraded":
            if kind not in (FULL, UNRECORDED) and self.kind in (FULL, UNRECORDED):  # worse: reads stop too
                self.kind, self.reason = kind, reason
                log.warning("drive %d (%s) degraded: %s; its pages are misses until it is healthy", self.index,
                            self.root, reason)  # fmt: skip
                self._readable_now(True)
            return
        self.state, self.kind, self.reason = "degraded", kind, reason
        self.changed = True
        self.since = time.monotonic()
        self.degradations += 1
        flapping = self.since - self.readmitted_at < FLAP_S
        self.backoff_s = min(MAX_BACKOFF_S, max(1.0, self.backoff_s * 2)) if flapping else 0.0
        self.probe_after = self.since + self.backoff_s
        if kind == FOREIGN:
            what = "; nothing of it is served"
        elif kind in (FULL, UNRECORDED):
            what = "; new writes go to the other drives until a probe finds it healthy"
        else:
            what = "; its pages are misses and new writes go to the other drives until a probe finds it healthy"
        log.warning("drive %d (%s) degraded: %s%s", self.index, self.root, reason, what)
        self._readable_now(True)

    def mark(self, kind: str, reason: str) -> None:
        """Degraded as ``kind`` (UNRECORDED: its session could not be recorded, it serves reads and
        takes no writes; FOREIGN: another store's), whatever it was degraded for (one WARNING)."""
        if self.state != "degraded":
            self.degrade(kind, reason)
        elif self.kind != kind:
            was = self.readable
            self.kind, self.reason, self.changed = kind, reason, True
            log.warning("drive %d (%s) degraded: %s", self.index, self.root, reason)
            self._readable_now(was)
        else:
            self.reason = reason

    def readmit(self) -> None:
        if self.state == "healthy":
            return
        # INFO: the one WARNING of an episode is the one that took the drive out
        log.info("drive %d (%s) healthy again after %.1f s (%s); serving its pages", self.index, self.root,
                 time.monotonic() - self.since, self.reason)  # fmt: skip
        was = self.readable
        self.state, self.kind, self.reason = "healthy", None, None
        self.changed = True
        self.readmitted_at = time.monotonic()
        self._readable_now(was)

    def begin(self, op: str) -> None:
        self.pending += 1
        if op in self._busy:
            self._busy[op] += 1
            if self._busy[op] == 1:
                self._busy_from[op] = time.perf_counter()

    def end(self, op: str) -> None:
        self.pending -= 1
        if op in self._busy:
            self._busy[op] -= 1
            if self._busy[op] == 0:
                self.busy_s[op] += time.perf_counter() - self._busy_from[op]

    def check_counters(self, before: Mapping, after: Mapping, what: str) -> None:
        """Degrade when the store counted failed ops during a call (EIO, ENOSPC on a write, ...)."""
        grown = {k: after.get(k, 0) - before.get(k, 0) for k in ERROR_COUNTERS}
        grown = {k: v for k, v in grown.items() if v > 0}
        if not grown:
            return
        if set(grown) == {"timeouts"}:
            self.degrade("stall", f"{what} outlived io_timeout_s")
        else:
            self.degrade("io_error", f"{what} failed: " + ", ".join(f"{k}={v}" for k, v in sorted(grown.items())))

    def record(self, row: dict | None = None) -> dict:
        """What DRIVES.json keeps of this drive, for ``umbp-nvme stats`` in another process: its
        state and, from its stats row (``row()``), errors and GB/s of this process so far."""
        out = {"state": self.state, "kind": self.kind, "reason": self.reason, "degradations": self.degradations,
               "at": time.time()}  # fmt: skip
        for k in ("errors", "read_gbps", "write_gbps", "bytes_read", "bytes_written"):
            if row and k in row:
                out[k] = row[k]
        return out

    def row(self, st: dict) -> dict:
        """The drive's line in stats(): state, bytes, objects, GB/s (over time busy), errors."""
        gb = 1e9
        rd, wr = st.get("bytes_read", 0), st.get("bytes_written", 0)
        return {
            "path": st.get("path", self.root),
            "state": self.state,
            "reason": self.reason,
            "objects": st.get("objects", 0),
            "bytes_used": st.get("bytes_used", 0),
            "capacity_bytes": st.get("capacity_bytes", 0),
            "bytes_read": rd,
            "bytes_written": wr,
            "read_gbps": round(rd / self.busy_s["get"] / gb, 3) if self.busy_s["get"] > 0 else 0.0,
            "write_gbps": round(wr / self.busy_s["put"] / gb, 3) if self.busy_s["put"] > 0 else 0.0,
            "errors": sum(int(st.get(k, 0)) for k in ERROR_COUNTERS),
            "degradations": self.degradations,
            "calls_in_flight": self.pending,
            "session_unrecorded": int(self.kind == UNRECORDED),
        }


async def reads_back(st, h: DriveHealth) -> bool:
    """One of the drive's objects reads back through its store (and engine) within io_timeout_s."""
    key = st.any_key()
    if key is None:
        return True  # nothing of ours to read: the directory answered
    ext = st.locate([key])[0]
    if ext is None:
        return True
    buf = np.empty(ext.length, dtype=np.uint8)
    before = dict(st.counters())
    h.begin("probe")
    try:
        ok = (await st.get_many([key], [buf]))[0]
    finally:
        h.end("probe")
    after = st.counters()
    errors = any(after.get(k, 0) > before.get(k, 0) for k in ("io_errors_read", "timeouts"))
    return bool(ok) and not errors


async def settle_deletes(st, h: DriveHealth) -> bool:
    """Apply the deletes the drive owes (made while it was degraded); True when none is left."""
    if h.clear_owed:
        await st.clear()
        h.clear_owed = False
    owed = h.deletes_owed
    if not owed:
        return True
    keys = list(owed)
    await st.delete_many(keys)
    # not exists: a delete whose commit outlived io_timeout_s hides the key but may not have landed
    left = {k for k, f in zip(keys, st.delete_pending(keys)) if f}
    owed.difference_update(k for k in keys if k not in left)  # keys owed meanwhile stay owed
    return not owed
