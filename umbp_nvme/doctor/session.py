"""`umbp-nvme doctor`'s ``session`` item: whether a writer can record its session on this drive.

A drive of a multi-drive store takes writes only once its DRIVES.json shows the writer's session
(store/drive_sessions.py). Where no new small file can be created there (no free inodes, no space,
a quota, I/O errors) the drive serves reads and takes no writes. This check reports what a running
writer last recorded about the drive (another drive's DRIVES.json: the drive itself may not take
the record), the file system's free inodes and bytes, and whether a small file written and fsynced
beside the store (never inside it) survives. A single-directory store keeps no such record: skipped.
"""

from __future__ import annotations

import os
import tempfile

from ..store.drive_set import DRIVES_FILE, read_set, recorded_health
from .findings import existing, finding

_SMALL_FILE_BYTES = 4096


def _small_file_beside(store_dir: str) -> str | None:
    """None when a small file can be created, written and fsynced beside the store; else why not."""
    try:
        fd, path = tempfile.mkstemp(prefix=".umbp-doctor-", dir=existing(os.path.dirname(os.path.abspath(store_dir))))
    except OSError as e:
        return f"creating a file: {e}"
    try:
        os.write(fd, b"\0" * _SMALL_FILE_BYTES)
        os.fsync(fd)
    except OSError as e:
        return f"writing and fsyncing a file: {e}"
    finally:
        os.close(fd)
        os.unlink(path)
    return None


def check_session_record(store_dir: str, findings: list) -> dict:
    if not os.path.exists(os.path.join(store_dir, DRIVES_FILE)):
        finding(findings, "session", "info", "no drive set recorded here (a single-directory store, or not created yet)")
        return {"drive_set": False}
    own = read_set(store_dir)
    out = {"drive_set": True, "store_id": own.get("store_id"), "drive_id": own.get("drive_id"),
           "session": own.get("session")}  # fmt: skip
    fix = ("free inodes and space on its file system (df -i, df -h), check quotas and the kernel log (dmesg) for "
           "I/O errors; the writer records the session again at its next probe")  # fmt: skip
    rec = recorded_health(store_dir) or {}
    if rec.get("kind") == "unrecorded":
        finding(findings, "session", "fail", f"a running writer could not record its session on this drive: "
                f"{rec.get('reason')}", fix)  # fmt: skip
    sv = os.statvfs(existing(store_dir))
    out.update(free_inodes=sv.f_favail, free_bytes=sv.f_bavail * sv.f_frsize)
    if sv.f_files and not sv.f_favail:
        finding(findings, "session", "fail", "no free inodes on this drive's file system: a writer cannot create "
                f"its session record ({DRIVES_FILE}), so the drive takes no writes", fix)  # fmt: skip
    elif out["free_bytes"] < _SMALL_FILE_BYTES:
        finding(findings, "session", "fail", "no free space on this drive's file system: a writer cannot write "
                f"its session record ({DRIVES_FILE}), so the drive takes no writes", fix)  # fmt: skip
    else:
        why = _small_file_beside(store_dir)
        out["small_file_error"] = why
        if why is not None:
            finding(findings, "session", "fail", f"a small file beside the store could not be made durable ({why}): "
                    f"a writer cannot record its session ({DRIVES_FILE}) here either", fix)  # fmt: skip
        elif rec.get("kind") != "unrecorded":
            finding(findings, "session", "ok", f"a writer can record its session here (last: session "
                    f"{own.get('session')}, drive {own.get('drive_id')})")  # fmt: skip
    return out
