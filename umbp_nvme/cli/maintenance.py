"""Offline views of a store directory: records, raw extent reads, stats, verify, compact, inspect.

The store (store.py) serves keys; operators also need to walk *every* record, read an extent
as it is on disk and check it, and see what takes the space. Those are built here on the public
pieces of index.py (``Index.scan`` / ``get_records``, ``REC_DTYPE``) and segments.py
(``segment_name``, ``size_class``, ``SegmentAllocator.rebuild``), so the store's hot path stays
small.

Read-only helpers open the index read-only (LMDB readers never block the writer, so they work
beside a running server). A record read here may be evicted and its slot reused by a running
writer between the lookup and the read: a CRC mismatch is therefore confirmed by looking the
key up again, and counts as corruption only when the record is unchanged.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from ..engine.files import open_regular, punch_hole
from ..errors import NotAStoreError
from ..keybytes import KeyEncodingError, encode_key
from ..store.index import FLAG_CRC, INDEX_FILE, REC_BYTES, REC_DTYPE, Index, disk_bytes
from ..store.layout import SLOT_ALIGN_BYTES, lock_holder, read_manifest, segment_files, segment_name
from ..store.layout import has_records, recorded_capacity_bytes, take_lock
from ..store.records import area_blocks
from ..store.segments import SegmentAllocator, size_classes

log = logging.getLogger(__name__)

_READONLY_MAP_BYTES = 1 << 30  # LMDB grows a read-only map to the file's own size


def _crc32c():
    from .._uring import crc32c

    return crc32c


# --- the directory ---------------------------------------------------------------------------


def segment_files_on_disk(path: str) -> dict[int, str]:
    os.listdir(path)  # an unreadable directory raises here, as it always did
    return {i: os.path.join(path, name) for i, name in segment_files(path).items()}


# --- records ---------------------------------------------------------------------------------


@dataclass
class Record:
    key: str
    segment: int
    offset: int
    length: int
    crc: int
    generation: int
    group: int
    depth: int
    flags: int

    @classmethod
    def from_row(cls, key: str, row) -> "Record":
        return cls(
            key,
            int(row["segment"]),
            int(row["offset"]),
            int(row["length"]),
            int(row["crc"]),
            int(row["generation"]),
            int(row["group"]),
            int(row["depth"]),
            int(row["flags"]),
        )

    def as_dict(self) -> dict:
        return {
            "segment": self.segment,
            "offset": self.offset,
            "length": self.length,
            "crc32c": f"{self.crc:08x}" if self.flags & FLAG_CRC else None,
            "generation": self.generation,
            "group": self.group,
            "depth": self.depth,
        }


class StoreReader:
    """Read-only access to a store directory's records and raw extents (no engine, no lock)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.manifest = read_manifest(self.path)
        self.segment_bytes = int(self.manifest["layout"]["segment_bytes"])
        self.namespace = self.manifest.get("namespace") or {}
        idx = os.path.join(self.path, INDEX_FILE)
        if not os.path.exists(idx):
            raise NotAStoreError(f"{self.path} has no {INDEX_FILE}: the store was never opened by a writer")
        self.index = Index(idx, readonly=True, map_size=_READONLY_MAP_BYTES, durable=False)
        self._fds: dict[int, int] = {}
        self._crc32c = _crc32c()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.index is not None:
            self.index.close()
            self.index = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def scan(self) -> tuple[list[str], np.ndarray]:
        keys, recs = self.index.scan()
        if self.index.scan_damage is not None:
            log.warning(
                "%s: the store index is damaged (%s); those records are left out here, and the writer rebuilds "
                "the index without them at its next open", self.path, self.index.scan_damage,
            )  # fmt: skip
        return keys, recs  # str, one decode per key (keybytes): a key's bytes never shift onto another

    def records(self, keys: list[str] | None = None) -> list[Record]:
        """Every record (sorted by segment and offset: sequential reads), or the given keys' (missing ones left out)."""
        if keys is None:
            names, recs = self.scan()
            order = np.lexsort((recs["offset"], recs["segment"])) if len(recs) else []
            return [Record.from_row(names[i], recs[i]) for i in np.asarray(order, np.int64).tolist()]
        return [r for r in self.lookup(keys) if r is not None]

    def lookup(self, keys: list[str]) -> list[Record | None]:
        enc = []
        for k in keys:
            try:
                enc.append(encode_key(k))
            except KeyEncodingError:
                enc.append(None)  # no byte form: no record can have this key
        found = iter(self.index.get_records([b for b in enc if b is not None]))
        vals = [None if b is None else next(found) for b in enc]
        out: list[Record | None] = []
        for k, v in zip(keys, vals):
            if v is None or len(v) != REC_BYTES:
                out.append(None)
            else:
                out.append(Record.from_row(k, np.frombuffer(v, dtype=REC_DTYPE)[0]))
        return out

    def _fd(self, seg: int) -> int:
        fd = self._fds.get(seg)
        if fd is None:
            fd = open_regular(os.path.join(self.path, segment_name(seg)), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            self._fds[seg] = fd
        return fd

    def read_into(self, rec: Record, buf) -> str:
        """Read rec's bytes into buf and check them: 'ok', 'crc_mismatch', 'short_read', 'missing_segment',
        'io_error: ...', or 'vanished' (the writer replaced the record while we read)."""
        mv = memoryview(buf).cast("B")[: rec.length]
        if rec.offset % SLOT_ALIGN_BYTES or rec.offset + rec.length > self.segment_bytes:
            return "bad_extent"  # a damaged record: outside its segment (or beyond any file offset)
        try:
            fd = self._fd(rec.segment)
        except FileNotFoundError:
            status = "missing_segment"
        except OSError as e:
            status = f"io_error: {e.strerror or e}"
        else:
            try:
                n = os.preadv(fd, [mv], rec.offset)
            except OSError as e:
                status = f"io_error: {errno.errorcode.get(e.errno, e.errno)}"
            else:
                if n < rec.length:
                    status = "short_read"
                elif rec.flags & FLAG_CRC and self._crc32c(mv) != rec.crc:
                    status = "crc_mismatch"
                else:
                    return "ok"
        now = self.lookup([rec.key])[0]
        if now is None or now.generation != rec.generation:
            return "vanished"
        return status

    def check(self, rec: Record, scratch: np.ndarray | None = None) -> str:
        buf = scratch if scratch is not None and scratch.nbytes >= rec.length else np.empty(rec.length, np.uint8)
        return self.read_into(rec, buf)


# --- key classification (stats per pool) -----------------------------------------------------

_HASH_RE = re.compile(r"(?:^|_)([0-9a-fA-F]{16,})(?=_)")


def classify_key(key: str) -> tuple[str, str]:
    """(pool, prefix) of a component key, from its shape (keys.py): KV v1 keys are
    ``<hash>_<rank>_k|v`` (MLA ``<hash>__k``, envelope ``_kv``) without a prefix; side-pool keys are
    ``<prefix>_<hash>_<rank>_<pool>[_k|_v]``, Mamba's ``..._temporal`` / ``..._conv_<i>``."""
    m = _HASH_RE.search(key)
    if m is None:
        return ("kv" if re.search(r"_(k|v|kv)$", key) else "other"), ""
    prefix = key[: m.start(1)].rstrip("_")
    rest = key[m.end(1) + 1 :].split("_")
    # drop the rank suffix: digits (tp / pp), dcp/cp shards, or the empty MLA suffix
    while rest and (rest[0] == "" or rest[0].isdigit() or re.fullmatch(r"(dcp|cp)\d+", rest[0])):
        rest = rest[1:]
    if not rest:
        return "other", prefix
    if rest in (["k"], ["v"], ["kv"]):
        return ("kv" if not prefix else "kv(prefixed)"), prefix
    if rest[0] == "temporal" or (rest[0] == "conv" and len(rest) == 2):
        return "mamba", prefix
    if rest[-1] in ("k", "v") and len(rest) > 1:
        rest = rest[:-1]
    return "_".join(rest), prefix


# --- stats -----------------------------------------------------------------------------------


def store_stats(path: str, capacity_bytes: int | None = None, high_wm: float | None = None,
                low_wm: float | None = None) -> dict:
    """Usage computed from the index and the files (what is stored, not what a server counted).

    The capacity: ``capacity_bytes`` when given (what-if), else the one MANIFEST.json records (the
    capacity its writer runs with), else, for a store made before it was recorded, its segment
    files; ``capacity_source`` says which. Watermarks: StoreConfig's defaults unless given."""
    from ..config import StoreConfig

    high_wm = StoreConfig.ssd_high_watermark if high_wm is None else high_wm
    low_wm = StoreConfig.ssd_low_watermark if low_wm is None else low_wm
    with StoreReader(path) as r:
        names, recs = r.scan()
        seg_bytes = r.segment_bytes
        namespace = r.namespace
        recorded = recorded_capacity_bytes(r.manifest)
    lengths = recs["length"].astype(np.int64)
    classes = size_classes(lengths) if len(lengths) else np.zeros(0, np.int64)
    pools: dict[str, dict] = defaultdict(lambda: {"objects": 0, "bytes": 0})
    prefixes: Counter = Counter()
    for k, n in zip(names, lengths.tolist()):
        pool, prefix = classify_key(k)
        pools[pool]["objects"] += 1
        pools[pool]["bytes"] += n
        prefixes[prefix or "(none)"] += 1
    segs = segment_files_on_disk(path)
    disk = 0
    for p in segs.values():
        try:
            disk += os.stat(p).st_blocks * 512
        except OSError:
            pass
    used_segs = np.unique(recs["segment"]).tolist() if len(recs) else []
    if capacity_bytes:
        cap, source = capacity_bytes, "given: --capacity, --config or UMBP_SSD_CAPACITY"
    elif recorded:
        cap, source = recorded, "recorded in MANIFEST.json: the capacity its writer runs with"
    else:
        cap, source = max(len(segs), 1) * seg_bytes, "its segment files: the store records no capacity (an old store)"
    usable = (cap // seg_bytes) * seg_bytes
    slot_bytes = int(classes.sum())
    out = {
        "store": os.path.abspath(path),
        "namespace": namespace,
        "writer_pid": None if (pid := lock_holder(path)) is None else str(pid),  # JSON kept: a string
        "capacity_bytes": int(cap),
        "capacity_source": source,
        "recorded_capacity_bytes": recorded,
        "usable_bytes": int(usable),
        "segment_bytes": seg_bytes,
        "segments_in_use": len(used_segs),
        "segment_files": len(segs),
        "disk_bytes": disk,
        "objects": len(names),
        "object_bytes": int(lengths.sum()),
        "bytes_used": slot_bytes,  # slots: object bytes rounded up to 4 KiB, what capacity counts
        "fill": round(slot_bytes / usable, 4) if usable else None,
        "high_watermark": high_wm,
        "low_watermark": low_wm,
        "high_watermark_bytes": int(usable * high_wm),
        "low_watermark_bytes": int(usable * low_wm),
        "pools": {k: dict(v) for k, v in sorted(pools.items())},
        "prefixes": dict(sorted(prefixes.items())),
        "size_classes": {int(c): int(n) for c, n in zip(*np.unique(classes, return_counts=True))} if len(classes) else {},
        "index_bytes": disk_bytes(os.path.join(path, INDEX_FILE)),
    }
    return out


# --- verify ----------------------------------------------------------------------------------


def verify_records(path: str, progress=None) -> dict:
    """Read and CRC-check every object. progress(nbytes) is called after each object."""
    bad: list[dict] = []
    vanished = 0
    checked = 0
    nbytes = 0
    with StoreReader(path) as r:
        recs = r.records()
        scratch = np.empty(max([x.length for x in recs], default=1), np.uint8)
        for rec in recs:
            if rec.offset % SLOT_ALIGN_BYTES or rec.offset + rec.length > r.segment_bytes or rec.length <= 0:
                status = "bad_extent"
            else:
                status = r.check(rec, scratch)
            checked += 1
            nbytes += rec.length
            if status == "vanished":
                vanished += 1
            elif status != "ok":
                bad.append({"key": rec.key, "status": status, **rec.as_dict()})
            if progress is not None:
                progress(rec.length)
        damage = r.index.scan_damage
    return {"store": os.path.abspath(path), "checked": checked, "bytes": nbytes, "bad": bad, "vanished": vanished,
            "index_damage": damage}  # fmt: skip


# --- inspect ---------------------------------------------------------------------------------


def inspect_keys(path: str, keys: list[str]) -> list[dict]:
    out = []
    with StoreReader(path) as r:
        for key, rec in zip(keys, r.lookup(keys)):
            if rec is None:
                out.append({"key": key, "found": False, "status": "missing"})
                continue
            status = r.check(rec)
            out.append(
                {
                    "key": key,
                    "found": True,
                    "file": os.path.join(r.path, segment_name(rec.segment)),
                    "status": status,
                    "pool": classify_key(key)[0],
                    **rec.as_dict(),
                }
            )
    return out


# --- compact ---------------------------------------------------------------------------------

def free_ranges(path: str) -> tuple[dict[int, list[tuple[int, int]]], set[int], int]:
    """Per segment, the byte ranges no live record uses, merged; the segments with no record at
    all; and the number of records the store itself would drop at open (kept out of the count).
    A segment's record area (at its tail, sized by its class) is never free."""
    with StoreReader(path) as r:
        names, recs = r.scan()
        seg_bytes = r.segment_bytes
        records = has_records(r.manifest)
    on_disk = segment_files_on_disk(path)
    # records in segments without a file are dropped below; a damaged segment number must not size this
    n_segments = max(on_disk, default=-1) + 1
    alloc = SegmentAllocator(max(n_segments, 1), seg_bytes, records=records)
    keep = alloc.rebuild(recs["segment"], recs["offset"], recs["length"], recs["generation"]) if len(recs) else np.zeros(0, bool)
    live = recs[keep] if len(recs) else recs
    used: dict[int, list[tuple[int, int]]] = defaultdict(list)
    cls = size_classes(live["length"]) if len(live) else np.zeros(0, np.int64)
    for s, o, c in zip(live["segment"].tolist(), live["offset"].tolist(), cls.tolist()):
        used[int(s)].append((int(o), int(o) + int(c)))
    if records:
        for s in list(used):
            c = alloc.seg_class[s] if s < len(alloc.seg_class) else 0
            if c:
                used[s].append((seg_bytes - area_blocks(seg_bytes, c) * SLOT_ALIGN_BYTES, seg_bytes))
    ranges: dict[int, list[tuple[int, int]]] = {}
    empty = set()
    for s in on_disk:
        spans = sorted(used.get(s, []))
        if not spans:
            empty.add(s)
            continue
        gaps, pos = [], 0
        for a, b in spans:
            if a > pos:
                gaps.append((pos, a))
            pos = max(pos, b)
        if pos < seg_bytes:
            gaps.append((pos, seg_bytes))
        ranges[s] = gaps
    return ranges, empty, int((~keep).sum()) if len(recs) else 0


def rebuild_index_dir(path: str, *, step=None) -> dict:
    """``verify --rebuild-index``: write a new index.lmdb from the records in the segments, rewrite
    every record area from it, mark it clean and put it in place of the old one, atomically: until
    the new file is complete the old one stays at the path, so an interrupted run (Ctrl-C, a kill)
    leaves the store as it found it, less a temporary file the next writer or run removes. The old
    file is then removed, or kept as ``index.lmdb.corrupt-<time>`` when it does not open or scan
    clean (the newest index_swap.DAMAGED_COPIES_KEPT such copies are kept). Takes the writer lock
    (StoreLockedError while a writer runs). ``step(name)`` is called after each step
    (rebuild.VERIFY_STEPS): the seam crash tests kill the process at."""
    from ..store.index_swap import index_damage, settle_leftovers
    from ..store.layout import map_size_bytes
    from ..store.rebuild import rebuild_index

    path = os.path.abspath(path)
    m = read_manifest(path)
    if not has_records(m):
        raise NotAStoreError(
            f"{path} was written before the segments held index records; open it once with a writer "
            "(it migrates) before rebuilding its index from the segments"
        )
    fd = take_lock(path)
    try:
        seg = int(m["layout"]["segment_bytes"])
        on_disk = segment_files(path)
        cap = recorded_capacity_bytes(m) or (max(on_disk, default=0) + 1) * seg
        n_segments = max(cap // seg, max(on_disk, default=-1) + 1)
        ipath = os.path.join(path, INDEX_FILE)
        done = settle_leftovers(ipath, map_size_bytes(cap))
        if done is not None:
            log.warning("%s: an index rebuild was interrupted: %s", path, done)
        damage = index_damage(ipath, map_size_bytes(cap))  # a sound old index is not kept as "corrupt"
        why = "verify --rebuild-index" + (f" (the old index is damaged: {damage})" if damage else "")
        summary = rebuild_index(path, ipath, seg, n_segments, map_size_bytes(cap), why, state=b"clean",
                                old_damaged=damage is not None, rewrite=True, step=step)  # fmt: skip
    finally:
        os.close(fd)
    summary["store"] = path
    return summary


def compact_dir(path: str, *, interior: bool = True) -> dict:
    """Reclaim disk space of free slots. The caller holds the writer lock (opened the store as writer).

    Segment files stay at full size (the store treats a short segment file as lost): free ranges
    become holes (FALLOC_FL_PUNCH_HOLE | KEEP_SIZE), which keeps the size and returns the blocks.
    A segment with no live record at all is deleted; the store recreates it when it needs it.
    ``interior=False`` punches only the free tail of each segment.
    """
    ranges, empty, invalid = free_ranges(path)
    on_disk = segment_files_on_disk(path)
    before = sum(os.stat(p).st_blocks * 512 for p in on_disk.values())
    removed, punched, errors = [], 0, []
    for s in sorted(empty):
        try:
            os.unlink(on_disk[s])
            removed.append(s)
        except OSError as e:
            errors.append(f"{on_disk[s]}: {e}")
    for s, gaps in sorted(ranges.items()):
        if not interior:
            gaps = gaps[-1:] if gaps and gaps[-1][1] >= os.path.getsize(on_disk[s]) else []
        if not gaps:
            continue
        fd = os.open(on_disk[s], os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            for a, b in gaps:
                try:
                    punch_hole(fd, a, b - a)
                    punched += 1
                except OSError as e:
                    errors.append(f"{on_disk[s]}: cannot punch a hole ({e.strerror}); the file system may not support it")
                    break
        finally:
            os.close(fd)
    remaining = segment_files_on_disk(path)
    after = sum(os.stat(p).st_blocks * 512 for p in remaining.values())
    return {
        "store": os.path.abspath(path),
        "segments_removed": removed,
        "ranges_punched": punched,
        "disk_bytes_before": before,
        "disk_bytes_after": after,
        "reclaimed_bytes": max(0, before - after),
        "invalid_records": invalid,
        "errors": errors,
    }
