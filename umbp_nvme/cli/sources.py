"""Warm-up sources: the *unit* every source becomes, the ``Summary`` of an import, and the store
and archive readers.

A unit is one blob read from a source that holds one or more objects (a HiCacheFile MHA page is
K then V); ``umbp_nvme.cli.warmup.Importer`` runs units into a store. ``detect_source`` tells a
HiCacheFile directory (read by ``umbp_nvme.cli.hicache_files``), a store directory and an archive
apart by what they are on disk.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .archive import ArchiveError, ArchiveReader
from ..keybytes import printable_key
from .maintenance import StoreReader
from ..store import MANIFEST_FILE

log = logging.getLogger("umbp_nvme.cli.warmup")  # Summary's messages: the warm-up's own logger


# --- summary ---------------------------------------------------------------------------------


@dataclass
class Summary:
    imported: int = 0  # objects newly stored
    skipped: int = 0  # objects already present (dedup / resume)
    failed: int = 0  # objects that could not be read, verified or stored
    too_large: int = 0  # of those, objects larger than the largest the store takes (refused before any put)
    evicted: int = 0  # objects the store evicted during the import to make room (imported ones among them are gone)
    refused_files: int = 0  # source files refused whole (size or name does not fit the namespace)
    ignored_files: int = 0  # files of other ranks / models, temporaries: not ours to import
    bytes_imported: int = 0
    bytes_skipped: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    sources: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # the first few messages
    more_errors: int = 0  # messages past the first 20 (counted, not kept or logged)
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        """Counters move from the reader thread and the loop thread alike."""
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, msg: str) -> None:
        """Keep and log the first 20 messages; count the rest (a damaged source may have millions)."""
        with self._lock:
            if len(self.errors) >= 20:
                self.more_errors += 1
                return
            self.errors.append(msg)
        log.warning("%s", msg)

    def finish(self) -> "Summary":
        self.seconds = time.perf_counter() - self._t0
        return self

    @property
    def ok(self) -> bool:
        return not (self.failed or self.refused_files or self.interrupted)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        d["seconds"] = round(self.seconds, 3)
        d["gbps"] = round(self.bytes_imported / self.seconds / 1e9, 3) if self.seconds > 0 else 0.0
        return d

    def table(self) -> str:
        d = self.as_dict()
        rows = [
            ("imported", f"{d['imported']} objects, {d['bytes_imported'] / 1e9:.3f} GB"),
            ("skipped (present)", f"{d['skipped']} objects, {d['bytes_skipped'] / 1e9:.3f} GB"),
            ("failed", str(d["failed"]) + (f" ({d['too_large']} larger than the store takes)" if d["too_large"] else "")),
        ]
        if d["evicted"]:
            rows.append(("evicted meanwhile", f"{d['evicted']} objects: the store is smaller than what was imported"))
        if d["refused_files"]:
            rows.append(("refused files", str(d["refused_files"])))
        if d["ignored_files"]:
            rows.append(("ignored files", f"{d['ignored_files']} (other ranks/models or temporaries)"))
        rows.append(("time", f"{d['seconds']:.2f} s, {d['gbps']:.3f} GB/s"))
        if d["interrupted"]:
            rows.append(("interrupted", "yes: run the same command again to continue"))
        w = max(len(r[0]) for r in rows)
        lines = [f"{a:<{w}}  {b}" for a, b in rows]
        for e in d["errors"][:10]:
            lines.append(f"  ! {e}")
        hidden = len(d["errors"]) - 10 + d["more_errors"]
        if hidden > 0:
            lines.append(f"  ! ... and {hidden} more (--json lists the first 20)")
        return "\n".join(lines)


# --- units -----------------------------------------------------------------------------------


@dataclass
class Unit:
    keys: list[str]
    offsets: list[int]  # of each object inside the blob
    lengths: list[int]
    blob_bytes: int
    label: str  # where it came from, for messages
    crcs: list | None = None  # CRC32C per object when the source keeps one
    read: Callable | None = None  # read(memoryview of blob_bytes) -> None | error message
    skip: Callable | None = None  # skip() when not read (streams)


# --- store and archive sources ---------------------------------------------------------------


def store_units(reader: StoreReader, summary: Summary, keys: list[str] | None = None) -> Iterator[Unit]:
    recs = reader.records(keys)
    if keys is not None and len(recs) < len(keys):
        summary.error(f"{reader.path}: {len(keys) - len(recs)} of the requested keys are not in the store")
    for rec in recs:

        def read(mv, rec=rec):
            st = reader.read_into(rec, mv)
            return None if st == "ok" else f"{reader.path}: object {printable_key(rec.key)}: {st}"

        yield Unit([rec.key], [0], [rec.length], rec.length, printable_key(rec.key), crcs=[None], read=read)


def archive_units(ar: ArchiveReader, summary: Summary) -> Iterator[Unit]:
    """Units straight off the stream; each must be read or skipped before the next is produced.

    Every failure counts in the summary and never ends the import early on its own: a bad record
    (CRC, empty key, too large, damaged frame) fails alone; truncation ends this source after the
    intact records, with the reason."""
    skip_err: list[str] = []

    def skip():
        try:
            ar.skip()
        except ArchiveError as e:  # truncated inside a record nobody wanted: report it, end the source
            skip_err.append(str(e))

    while True:
        if skip_err:
            summary.add(failed=1)
            summary.error(skip_err[0])
            return
        if ar.fatal is not None:  # a read hit the end of the file; the importer counted that record
            return
        try:
            head = ar.next()
        except ArchiveError as e:
            summary.add(failed=1)
            summary.error(str(e))
            return
        finally:
            for note in ar.resync_notes:
                summary.add(failed=1)
                summary.error(note)
        if head is None:
            return
        if head.error is not None:
            summary.add(failed=1)
            summary.error(head.error)
            skip()
            continue

        def read(mv, head=head):
            try:
                return None if ar.read_into(mv) else f"{ar.name}: record {printable_key(head.key)} fails its CRC32C"
            except ArchiveError as e:
                return str(e)

        yield Unit([head.key], [0], [head.length], head.length, printable_key(head.key), read=read, skip=skip)


class SourceError(ValueError):
    pass


def detect_source(path: str) -> str:
    if path == "-":
        return "archive"
    if os.path.isdir(path):
        return "store" if os.path.exists(os.path.join(path, MANIFEST_FILE)) else "files"
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        mode, why = 0, "does not exist" if e.errno == errno.ENOENT else f"cannot be examined ({e.strerror or e})"
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):  # a file, a pipe, <(...)
        return "archive"
    if mode:  # a block device (a raw drive is no archive) or a socket
        why = f"is a {'block device' if stat.S_ISBLK(mode) else 'socket' if stat.S_ISSOCK(mode) else 'special file'}"
    raise SourceError(f"warm-up source {path} {why}; give a HiCacheFile directory, a store directory or an archive")
