"""Rebuild the index from the records in the segments (records.py).

Read every segment's record area sequentially, keep the records that check out, and give back
(keys, 48-byte index records) for the LMDB index. A record is kept when its own CRC, magic,
segment number, slot position (offset == slot index x size class), extent bounds, key checksum
and generation are all right; a record not marked confirmed (its data's fdatasync was not seen
to complete) is kept only when the object's bytes read back with the record's data CRC. When one
key has several records the newest generation wins; the allocator later keeps one record per
slot (newest generation) and one size class per segment.

State: none (reads segment files, writes a new index file the open adopts; index_swap.py puts it in place).
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from ..engine.files import open_regular, zero_range
from ..keybytes import decode_keys, encode_key
from .index import FLAG_CRC, FLAG_KEYCRC, REC_DTYPE, key_crcs
from .index_swap import damaged_copy_name, replace_index
from .layout import GENERATION_MAX, SLOT_ALIGN_BYTES, record_slots, segment_files
from .records import (KEY_INLINE, MAGIC, PER_BLOCK, area_blocks, R_CONFIRMED, R_KEY_TRUNC, R_VALID, RECORD_DTYPE,
                      record_crcs)  # fmt: skip

log = logging.getLogger("umbp_nvme.store")

READ_CHUNK = 8 << 20


def _read_blocks(fd: int, segment_bytes: int, nblocks: int) -> np.ndarray:
    """Record blocks 0..nblocks-1 (block 0 = the file's last 4 KiB) as RECORD_DTYPE, in block order."""
    n = nblocks * SLOT_ALIGN_BYTES
    buf = np.zeros(n, np.uint8)
    start = segment_bytes - n
    pos = 0
    while pos < n:
        got = os.preadv(fd, [memoryview(buf)[pos : min(n, pos + READ_CHUNK)]], start + pos)
        if got <= 0:
            break
        pos += got
    # file order puts block nblocks-1 first: reverse the blocks, keep each block's records in order
    return buf.reshape(nblocks, SLOT_ALIGN_BYTES)[::-1].reshape(-1).copy().view(RECORD_DTYPE)


def _majority_class(r: np.ndarray) -> int:
    live = r[(r["magic"] == MAGIC) & ((r["flags"] & R_VALID) != 0)]
    live = live[record_crcs(np.ascontiguousarray(live)) == live["rcrc"]] if len(live) else live
    if not len(live):
        return 0
    cls = (-(-live["length"].astype(np.int64) // SLOT_ALIGN_BYTES)) * SLOT_ALIGN_BYTES
    u, c = np.unique(cls, return_counts=True)
    return int(u[np.argmax(c)])


def read_area(path: str, segment_bytes: int) -> tuple[np.ndarray, int]:
    """One segment's record area as RECORD_DTYPE (index = slot index) and its class. Block 0 tells the segment's
    class and so the area's size; when it holds no record, the largest area is read and the most
    common class among its sound records decides."""
    fd = open_regular(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size < segment_bytes:
            return np.zeros(0, RECORD_DTYPE), 0
        cls = _majority_class(_read_blocks(fd, segment_bytes, 1))
        if not cls:
            most = area_blocks(segment_bytes, SLOT_ALIGN_BYTES)
            cls = _majority_class(_read_blocks(fd, segment_bytes, most))
            if not cls:
                return np.zeros(0, RECORD_DTYPE), 0
        n = record_slots(segment_bytes, cls)
        return _read_blocks(fd, segment_bytes, area_blocks(segment_bytes, cls))[:n], cls
    finally:
        os.close(fd)


def valid_records(area: np.ndarray, seg: int, segment_bytes: int, seg_cls: int) -> np.ndarray:
    """The records of one area (of class ``seg_cls``) that are sound in themselves (not yet
    checked against data): a record of another class is not this area's."""
    live = np.flatnonzero((area["magic"] == MAGIC) & ((area["flags"] & R_VALID) != 0))
    if not len(live):
        return area[:0]
    r = np.ascontiguousarray(area[live])
    lens = r["length"].astype(np.int64)
    offs = r["offset"]
    cls = np.maximum((-(-lens // SLOT_ALIGN_BYTES)) * SLOT_ALIGN_BYTES, SLOT_ALIGN_BYTES)
    ok = (
        (cls == seg_cls)
        & (record_crcs(r) == r["rcrc"])
        & (r["segment"] == seg)
        & (lens > 0)
        & (offs < np.uint64(segment_bytes))
        & (offs.astype(np.int64) + cls <= segment_bytes)
        & (offs.astype(np.int64) == live.astype(np.int64) * cls)
        & (r["generation"] < np.uint64(GENERATION_MAX))
        & (r["key_len"] > 0)
        & ((r["flags"] & R_KEY_TRUNC) == 0)
        & (r["key_len"] <= KEY_INLINE)
    )
    return r[ok]


def _keys_of(r: np.ndarray) -> list[bytes]:
    kb = r["key"]
    return [bytes(kb[i, :n]) for i, n in enumerate(r["key_len"].tolist())]


def _data_ok(path: str, r: np.ndarray, crc32c) -> np.ndarray:
    """Whether each (unconfirmed) record's object bytes read back with its data CRC."""
    ok = np.zeros(len(r), bool)
    if not len(r):
        return ok
    fd = open_regular(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        for i, (off, n, c) in enumerate(zip(r["offset"].tolist(), r["length"].tolist(), r["crc"].tolist())):
            try:
                b = os.pread(fd, n, off)
            except OSError:
                continue
            ok[i] = len(b) == n and crc32c(b) == c
    finally:
        os.close(fd)
    return ok


def rebuild_records(directory: str, segment_bytes: int, n_segments: int, progress=None):
    """(keys as str, REC_DTYPE records, confirmed mask, summary dict) from the segments' record areas."""
    from .._uring import crc32c

    t0 = time.perf_counter()
    files = {i: n for i, n in segment_files(directory).items() if i < n_segments}
    parts, keys, conf = [], [], []
    summary = {"segments": len(files), "records": 0, "bad_records": 0, "unconfirmed": 0, "data_bad": 0,
               "long_keys": 0, "duplicates": 0, "tied": 0, "generation_max": 0}  # fmt: skip
    for done, (seg, name) in enumerate(sorted(files.items())):
        p = os.path.join(directory, name)
        area, seg_cls = read_area(p, segment_bytes)
        live = int(((area["magic"] == MAGIC) & ((area["flags"] & R_VALID) != 0)).sum())
        r = valid_records(area, seg, segment_bytes, seg_cls)
        if len(r):  # the clock restarts above every sound record, kept or not (clock.py)
            summary["generation_max"] = max(summary["generation_max"], int(r["generation"].max()))
        summary["long_keys"] += int(((area["magic"] == MAGIC) & ((area["flags"] & R_KEY_TRUNC) != 0)).sum())
        k = _keys_of(r)
        kc = key_crcs(k) if k else np.zeros(0, np.uint32)
        good = kc == r["key_crc"]
        c = (r["flags"] & R_CONFIRMED) != 0
        unconf = np.flatnonzero(good & ~c)
        if len(unconf):
            summary["unconfirmed"] += len(unconf)
            ok = _data_ok(p, r[unconf], crc32c)
            summary["data_bad"] += int((~ok).sum())
            good[unconf[~ok]] = False
        summary["bad_records"] += live - int(good.sum())
        sel = np.flatnonzero(good)
        parts.append(r[sel])
        keys.extend(k[i] for i in sel.tolist())
        conf.append(c[sel])
        if progress is not None:
            progress(done + 1, len(files), len(keys))
    r = np.concatenate(parts) if parts else np.zeros(0, RECORD_DTYPE)
    c = np.concatenate(conf) if conf else np.zeros(0, bool)
    # one record per key: the newest generation. Two records of one key with the same newest
    # generation cannot both be what was acknowledged last (generations are unique per put batch
    # and a batch writes a key once): neither is trusted, the key is dropped.
    if len(keys) > 1:
        uniq: dict[bytes, int] = {}
        gens = r["generation"].tolist()
        drop, tied = [], set()
        for i, k in enumerate(keys):
            j = uniq.get(k)
            if j is None:
                uniq[k] = i
            elif gens[i] > gens[j]:
                uniq[k] = i
                drop.append(j)
                tied.discard(k)
            else:
                drop.append(i)
                if gens[i] == gens[j]:
                    tied.add(k)
        if tied:
            drop.extend(uniq[k] for k in tied)
            summary["tied"] = len(tied)
            log.error("%s: %d keys have two records of the same newest generation; dropping them", directory,
                      len(tied))  # fmt: skip
        if drop:
            summary["duplicates"] = len(drop) - len(tied)
            sel = np.setdiff1d(np.arange(len(keys)), np.asarray(drop, np.int64))
            r, c = r[sel], c[sel]
            keys = [keys[i] for i in sel.tolist()]
    out = np.zeros(len(keys), REC_DTYPE)
    out["segment"], out["length"], out["offset"] = r["segment"], r["length"], r["offset"]
    out["generation"] = out["group"] = r["generation"]
    out["crc"], out["depth"], out["key_crc"] = r["crc"], r["depth"], r["key_crc"]
    out["flags"] = FLAG_CRC | FLAG_KEYCRC
    summary["records"] = len(keys)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return decode_keys(keys), out, c, summary


def write_area(path: str, segment_bytes: int, area: np.ndarray | None, cls: int) -> None:
    """Write one segment's record area for class ``cls`` from ``area`` (zeros where it has none) and
    fdatasync it (open path). Blocks beyond the class's area are slots and are never touched."""
    if not cls:
        return
    nb = area_blocks(segment_bytes, cls)
    img = np.zeros(nb * PER_BLOCK, RECORD_DTYPE)
    if area is not None:
        img[: len(area)] = area
    raw = img.view(np.uint8).reshape(nb, SLOT_ALIGN_BYTES)[::-1].reshape(-1).copy()  # block 0 last in the file
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        start, pos = segment_bytes - len(raw), 0
        while pos < len(raw):
            pos += os.pwritev(fd, [memoryview(raw)[pos : min(len(raw), pos + READ_CHUNK)]], start + pos)
        os.fdatasync(fd)
    finally:
        os.close(fd)


_BOOT_ID = None


def boot_id() -> bytes:
    """This boot's id: a writer state left by another boot means the machine restarted under it."""
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                _BOOT_ID = f.read().strip() or b"unknown"
        except OSError:
            _BOOT_ID = b"unknown"
    return _BOOT_ID


def clear_area(path: str, segment_bytes: int) -> None:
    """Zero the record area of a segment holding no object (the largest area any class has) and
    fdatasync it: records left there by puts that never published must not reach a later rebuild."""
    fd = open_regular(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_size < segment_bytes:
            return
        n = area_blocks(segment_bytes, SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
        zero_range(fd, segment_bytes - n, n)
        os.fdatasync(fd)
    finally:
        os.close(fd)


def rewrite_areas(directory: str, segment_bytes: int, n_segments: int, keys: list, recs: np.ndarray) -> dict:
    """Write every segment's record area from an index's (keys, records): data synced first, so every
    record says confirmed; segments without an object get their area cleared. Returns counts."""
    from .records import make_records

    enc = [encode_key(k) for k in keys]
    segs = recs["segment"].astype(np.int64)
    out = {"areas_written": 0, "areas_cleared": 0}
    for s, name in sorted(segment_files(directory).items()):
        if s >= n_segments:
            continue
        p = os.path.join(directory, name)
        js = np.flatnonzero(segs == s)
        if not len(js):
            clear_area(p, segment_bytes)
            out["areas_cleared"] += 1
            continue
        r = recs[js]
        rk = [enc[j] for j in js.tolist()]
        sealed = make_records(r["segment"], r["offset"], r["length"], r["generation"], r["crc"], r["depth"],
                              r["key_crc"], rk, R_VALID | R_CONFIRMED)  # fmt: skip
        cls = int(-(-int(r["length"][0]) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES)
        area = np.zeros(record_slots(segment_bytes, cls), RECORD_DTYPE)
        area[r["offset"].astype(np.int64) // cls] = sealed
        fd = open_regular(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.fdatasync(fd)  # the data first: the records written now say confirmed
        finally:
            os.close(fd)
        write_area(p, segment_bytes, area, cls)
        out["areas_written"] += 1
    return out


# the steps of a rebuild at open and of ``verify --rebuild-index`` (``step`` is called after each;
# index_swap.py says what each leaves on disk): the records read | older damaged copies pruned |
# the temporary index made | its records committed and synced | (verify) every area rewritten from
# them | then index_swap's last steps | (at open) the new file reopened at the path
OPEN_STEPS = ("records_read", "pruned", "created", "committed", "marked", "set_aside", "renamed", "dir_synced",
              "old_removed", "reopened")  # fmt: skip
VERIFY_STEPS = ("records_read", "pruned", "created", "committed", "areas_rewritten", "marked", "set_aside",
                "renamed", "dir_synced", "old_removed")  # fmt: skip


def rebuild_index(directory: str, ipath: str, segment_bytes: int, n_segments: int, map_size: int, why: str, *,
                  state: bytes, old_damaged: bool, rewrite: bool = False, step=None) -> dict:  # fmt: skip
    """Write a new index from the segments' records and put it at ``ipath`` marked ``state``,
    atomically (index_swap.py: the old file, if any, stays at the path until the new one is
    complete, then is kept as a damaged copy when ``old_damaged``, else removed); returns the
    summary. ``rewrite``: every record area is rewritten from the new index before it is marked
    (no writer follows to do it). Progress and the outcome are logged."""
    step = step or (lambda name: None)
    aside = damaged_copy_name(ipath) if old_damaged and os.path.lexists(ipath) else None
    if aside:
        then = f" (the old file goes to {aside} once the new one is complete)"
    else:
        then = " (the old file is removed once the new one is in place)" if os.path.lexists(ipath) else ""
    log.error("%s: %s; rebuilding it from the record areas of the segments%s", directory, why, then)
    last = [time.monotonic()]

    def progress(done, total, found):
        if time.monotonic() - last[0] >= 2.0 or done == total:
            last[0] = time.monotonic()
            log.warning("%s: rebuilding the index: %d/%d segments read, %d records so far", directory, done, total,
                        found)  # fmt: skip

    keys, recs, _conf, summary = rebuild_records(directory, segment_bytes, n_segments, progress)
    step("records_read")

    def fill(ix, step):
        blob = recs.tobytes()
        n = REC_DTYPE.itemsize
        puts = [(encode_key(k), blob[i * n : (i + 1) * n]) for i, k in enumerate(keys)]
        nxt = max(summary["generation_max"], int(recs["generation"].max()) if len(recs) else 0) + 1
        ix.commit(puts=puts, next_generation=max(nxt, time.time_ns() // 1000))
        ix.sync()
        step("committed")
        if rewrite:  # no writer follows to bring the areas in line with the new index: do it here
            summary.update(rewrite_areas(directory, segment_bytes, n_segments, keys, recs))
            step("areas_rewritten")

    had_old = os.path.lexists(ipath)
    dest = replace_index(ipath, map_size, fill, state=state, old_damaged=old_damaged, aside=aside, step=step)
    if dest:
        summary["moved_aside"] = dest
    elif had_old:
        summary["old_index_removed"] = True
    log.warning(
        "%s: rebuilt the index from %d segments in %.2f s: %d objects (%d records failed their checks, %d unconfirmed "
        "records checked against their data of which %d did not match, %d older duplicates, %d keys too long to "
        "rebuild)", directory, summary["segments"], summary["seconds"], summary["records"], summary["bad_records"],
        summary["unconfirmed"], summary["data_bad"], summary["duplicates"], summary["long_keys"],
    )  # fmt: skip
    return summary
