"""`umbp-nvme export`: a store's objects, CRC-checked, into an archive (the format: archive.py).

The archive is written under a private temporary name beside ``out`` and renamed onto it when
complete, so ``out`` is never a partial archive; a pipe or a device is written into. An ``out``
whose directory is missing or not writable is refused before anything is read, naming the
directory and what to do (issue 35: the error named the hidden temporary file).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time

from ..keybytes import printable_key
from .archive import ArchiveError, ArchiveWriter


def open_for_write(path: str):
    """A binary file for the archive: stdout for "-", else a new private temp file beside ``path``.

    Returns (file, temp path or None). The temp name has a random part and is created with
    O_EXCL|O_NOFOLLOW, mode 0600 like the store's files: nobody can pre-plant it or a symlink
    in its place, and the caller renames it onto ``path`` when complete. A ``path`` that is a pipe
    or a device (a FIFO, /dev/null, /dev/stdout) is written into like stdout, never replaced: the
    rename would put a regular file in place of the device node (as root, /dev/null itself).
    """
    if path == "-":
        import sys

        return sys.stdout.buffer, None
    if is_pipe_or_device(path):
        return open(path, "wb", buffering=1 << 20), None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = tmp_path_for(path)
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileExistsError:
            continue
        except OSError as e:  # the temp name is ours, not the user's: name the directory they gave
            raise ArchiveError(out_dir_problem(path, e)) from None
        return os.fdopen(fd, "wb", buffering=1 << 20), tmp
    raise FileExistsError(f"cannot create a temporary file beside {path}: 16 random names were taken")


def out_dir_problem(path: str, e: OSError) -> str:
    """Why no file can be made beside ``path``, naming its directory and what to do."""
    d = os.path.dirname(os.path.abspath(path))
    head = f"cannot write the archive {path}: "
    if e.errno == errno.ENOENT:
        return (head + f"its directory {d} does not exist; create it first (mkdir -p {d}) or write the archive "
                "into an existing directory")
    if e.errno == errno.ENOTDIR:
        return head + f"{d} is not a directory (a file is in the way); give a path inside a directory"
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (head + f"no file can be created in {d} ({e.strerror}); write the archive into a directory this "
                "user can write, or fix that directory's permissions")
    return head + f"no file can be created in {d} ({e.strerror or e})"


def is_pipe_or_device(path: str) -> bool:
    """Whether ``path`` names an existing pipe or device (followed: /dev/stdout links to /proc)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISDIR(mode) and (not stat.S_ISREG(mode) or os.path.realpath(path).startswith("/proc/"))


def tmp_path_for(path: str) -> str:
    d, b = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{b}.partial.{os.getpid()}.{secrets.token_hex(8)}")


# --- export ----------------------------------------------------------------------------------


def export_store(store_path: str, out: str, *, keys: list[str] | None = None, progress=None) -> dict:
    """Write the store's objects (or only ``keys``) to an archive at ``out`` ("-" = stdout).

    Reads the store read-only (a running writer is fine): each object is read as it lies on disk
    and checked against the store's CRC32C before it goes into the archive; an object the writer
    evicts meanwhile is left out. A file is written under a private temporary name (random,
    O_EXCL|O_NOFOLLOW, 0600) and renamed when complete, so ``out`` is never a partial archive.
    """
    from .maintenance import StoreReader

    t0 = time.perf_counter()
    summary = {"store": os.path.abspath(store_path), "out": out, "exported": 0, "bytes": 0, "vanished": 0,
               "failed": 0, "missing": 0, "errors": []}
    with StoreReader(store_path) as r:
        recs = r.records(keys)
        if keys is not None:
            summary["missing"] = len(set(keys)) - len(recs)
        f, tmp = open_for_write(out)
        ok = False
        try:
            w = ArchiveWriter(f, r.namespace, source=r.path, extra={"objects_listed": len(recs)})
            # a length from a damaged index must not size the buffer: no object outgrows a segment
            limit = min(r.segment_bytes, (1 << 32) - 1)
            buf = bytearray(max([x.length for x in recs if x.length <= limit], default=1))
            for rec in recs:
                if rec.length > limit:
                    status = f"implausible length {rec.length} (over the segment size {limit}); the index is damaged"
                else:
                    status = r.read_into(rec, buf)
                if status == "ok":
                    w.add(rec.key, memoryview(buf)[: rec.length], rec.crc)
                    summary["exported"] += 1
                    summary["bytes"] += rec.length
                elif status == "vanished":
                    summary["vanished"] += 1
                else:
                    summary["failed"] += 1
                    if len(summary["errors"]) < 20:
                        summary["errors"].append(f"{printable_key(rec.key)}: {status} (left out; `umbp-nvme verify --repair` drops it)")
                if progress is not None:
                    progress(rec.length)
            w.close()
            if tmp is not None:
                f.flush()
                os.fsync(f.fileno())
            ok = True
        finally:
            if out != "-":
                f.close()  # the temp file, or a pipe or device written into (open_for_write)
            if tmp is not None:
                try:
                    if ok:
                        os.replace(tmp, out)  # replaces a symlink at out, never writes through it
                        tmp = None
                        _fsync_dir(os.path.dirname(os.path.abspath(out)))
                finally:
                    if tmp is not None:  # failed, or out cannot be replaced (a directory): no debris
                        try:
                            os.unlink(tmp)
                        except OSError:
                            pass
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary


def _fsync_dir(d: str) -> None:
    """Make the rename durable (best effort: some file systems refuse fsync on a directory)."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
