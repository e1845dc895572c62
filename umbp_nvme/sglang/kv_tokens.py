"""What subscribers were told, kept beside the store: the record the re-announcement repairs from.

Routers keep what they were told until told otherwise, across our restarts. So the publisher
thread (never the data path) records, before a batch goes out, each page it announces stored
(with its token ids and parent in relay mode: Dynamo's indexer drops a DISK ``BlockStored``
without them, and a restarted node no longer has them from the engine) and each page it
announces removed. A re-announcement then sends ``BlockRemoved`` for every page subscribers may
believe held and the store does not hold: told stored and not held (its removal was dropped from
a full queue, or the page was lost across a restart: a drive that no longer opens, a removed
root, a shrink, a behind drive cleared at open, a power loss), and told removed lately (for a
subscriber whose gap is older than the replay buffer, or lost with a killed process's socket).

The file, ``kv_tokens.log``, is an append-only log of records ``[u32 payload bytes][u32 crc32]
[msgpack payload]``: ``[0, hash, parent hash | None, [tokens]]`` (told stored, with tokens),
``[2, [hash, ...]]`` (told stored, no tokens), ``[1, [hash, ...]]`` (told removed: counts for
the pages told stored before it) and ``[3, [hash, ...]]`` (told removed, as a rewrite keeps it). A hash
list holds at most ``HASHES_PER_RECORD`` hashes, so a record stays under ``RECORD_MAX_BYTES``
however many pages leave at once. Reading stops at the first torn or damaged record (what follows
is lost). With a strict store the records are fdatasynced before the batch that tells their pages
stored is sent (``sync``): no power loss leaves a page told stored and not recorded. With a
relaxed store, at most every ``RECORD_SYNC_RELAXED_S``: a power loss may also cost the record its
last second (pages lost then may stay announced), as it costs the store its unsynced pages.

A copy of the log is kept on every open drive (``paths``), each receiving the same bytes: a lost
drive loses no record. At open every copy is read, merged (a hash any copy knows is known, tokens
from any copy) and, with several, all are rewritten identical.

Recording costs the publisher thread an append per batch, no per-page work: the log is read back
and folded (records applied in order) only when its state is needed: at a re-announcement
(``reconcile``, which then rewrites it with its live records only), and once it has grown past
twice its size at the last fold plus ``COMPACT_SLACK_BYTES`` (rewritten too). Memory holds only
hash -> offset of the tokens records (relay mode). A fold keeps the latest ``max_pages`` pages
told stored (older ones are counted, ``not_recorded_pages``) and the latest ``gone_max`` told
removed.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Iterable, Optional

log = logging.getLogger(__name__)

FILE_NAME = "kv_tokens.log"
MAX_PAGES_DEFAULT = 1_000_000  # pages told stored: ~100 MB of index in memory at most
GONE_MAX_DEFAULT = 262_144  # pages told removed, remembered for subscribers that missed it
COMPACT_SLACK_BYTES = 4 << 20
RECORD_MAX_BYTES = 1 << 20  # a page of 64K tokens; a longer length field is damage
HASHES_PER_RECORD = 65_536  # 9 msgpack bytes per int64: ~590 KB, under RECORD_MAX_BYTES
RECORD_SYNC_RELAXED_S = 1.0  # a relaxed store's record is made durable at most this often (kv_events.py)
_HEAD = struct.Struct("<II")
_KEEP, _GONE, _SEEN, _TOMB = 0, 1, 2, 3
_SHIFT = 21  # an index value: record offset << _SHIFT | record bytes (at most RECORD_MAX_BYTES + 8)


def _well_formed(rec) -> bool:
    """A payload of one of the four kinds, its fields of the types written."""
    if not isinstance(rec, list) or not rec or type(rec[0]) is not int:
        return False
    if rec[0] == _KEEP:
        return len(rec) == 4 and type(rec[1]) is int and (rec[2] is None or type(rec[2]) is int) and isinstance(rec[3], list)
    return rec[0] in (_GONE, _SEEN, _TOMB) and len(rec) == 2 and isinstance(rec[1], list) and all(type(h) is int for h in rec[1])


def _split(hashes: list) -> list[list]:
    return [hashes[i : i + HASHES_PER_RECORD] for i in range(0, len(hashes), HASHES_PER_RECORD)]


class TokenLog:
    """Single-threaded (the publisher's thread). Every method catches I/O errors: a copy that
    cannot be written is given up (logged once, counted), the others go on, and with none left
    nothing is recorded; the events go on."""

    def __init__(self, paths, max_pages: int = MAX_PAGES_DEFAULT, gone_max: int = GONE_MAX_DEFAULT):
        import msgspec

        self.paths = [os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
        self.path = self.paths[0]
        self.max_pages, self.gone_max = int(max_pages), int(gone_max)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._at: dict[int, int] = {}  # pages with a tokens record: hash -> offset << _SHIFT | record bytes
        self._fds: list[tuple[str, int]] = []  # (path, fd): the copies, same bytes; the first is read
        self._end = 0  # the copies' length
        self._folded_end = 0  # their length after the last fold
        self._dirty = False  # appended since the last sync
        self._over = 0  # pages told stored beyond max_pages at the last fold
        # recorded_*: as of the last fold (open, a re-announcement, a rewrite); the others counters
        self.stats = {"recorded_pages": 0, "recorded_removed": 0, "not_recorded_pages": 0, "record_errors": 0}
        self._failed: set[str] = set()

    # --- open / fold

    def open(self) -> None:
        """Load every copy (dropping a damaged tail), merge them, and open them for appends."""
        from ..engine.files import open_regular

        copies = []
        for path in self.paths:
            try:
                fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
            except OSError as e:
                self._fail(path, "open", e)
                continue
            try:
                size = os.fstat(fd).st_size
                copies.append((path, fd, os.pread(fd, size, 0) if size else b""))
            except OSError as e:
                os.close(fd)
                self._fail(path, "read", e)
        if not copies:
            return
        path, fd, data = copies[0]
        told, gone, end = self._fold(data)
        self._fds, self._end, self._folded_end = [(path, fd)], end, end
        self._use(told, gone)
        if len(copies) > 1:  # every copy made identical: appends land at the same offsets in all of them
            extra: dict[int, bytes] = {}
            for _, _, other in copies[1:]:
                self._merge(self._fold(other, keep_records=True), told, gone, extra)
            self._fds = [(p, f) for p, f, _ in copies]
            self._rewrite(told, gone, extra)
        elif end < len(data):
            log.warning("umbp_nvme: %s: %d bytes after offset %d are torn or damaged; dropped (their pages "
                        "are re-announced without tokens)", path, len(data) - end, end)  # fmt: skip
            try:
                os.ftruncate(fd, end)
            except OSError as e:
                self._drop_copy(0, "truncate", e)

    def _records(self, data: bytes):
        """``(offset, record bytes, payload)`` of each sound record, in order, up to the first
        torn or damaged one; then ``(offset, None, None)``: the end of what is sound."""
        off, n = 0, len(data)
        while off + _HEAD.size <= n:
            size, crc = _HEAD.unpack_from(data, off)
            body = off + _HEAD.size
            if size > RECORD_MAX_BYTES or body + size > n or zlib.crc32(data[body : body + size]) != crc:
                break
            try:
                rec = self._dec.decode(data[body : body + size])
                if not _well_formed(rec):
                    break
            except Exception:  # noqa: BLE001 - a record that decodes to nonsense ends the log
                break
            yield off, _HEAD.size + size, rec
            off = body + size
        yield off, None, None

    def _fold(self, data: bytes, keep_records: bool = False):
        """The records of ``data`` applied in order: ``(told, gone, end)``: told stored (hash ->
        its tokens record's offset << _SHIFT | bytes, or 0; with ``keep_records`` the record's
        bytes instead), told removed (oldest first), and the end of the sound records. Pages told
        removed are the ones that were told stored (the others need no repair)."""
        told: dict[int, object] = {}
        gone: dict[int, None] = {}
        end = 0
        for off, nbytes, rec in self._records(data):
            if rec is None:
                end = off
                break
            kind = rec[0]
            if kind == _KEEP:
                h = int(rec[1])
                told.pop(h, None)
                told[h] = data[off : off + nbytes] if keep_records else off << _SHIFT | nbytes
                gone.pop(h, None)
            elif kind == _SEEN:
                for h in map(int, rec[1]):
                    if h not in told:
                        told[h] = 0
                    gone.pop(h, None)
            else:  # told removed: a rewrite's list as it is, a live one for the pages told stored
                for h in map(int, rec[1]):
                    if told.pop(h, None) is not None or h in gone or kind == _TOMB:
                        gone.pop(h, None)
                        gone[h] = None
                if len(gone) > self.gone_max:  # the oldest forgotten first, as they come
                    gone = dict.fromkeys(list(gone)[len(gone) - self.gone_max :])
        self._over = max(0, len(told) - self.max_pages)
        if self._over:  # the oldest told stored are not kept (counted once a rewrite drops them)
            told = dict(list(told.items())[self._over :])
        return told, gone, end

    def _merge(self, other, told: dict, gone: dict, extra: dict[int, bytes]) -> None:
        """Another copy's state: the hashes the first copy does not know are added as it says,
        and tokens records the first lacks are taken (a page key names its tokens: any copy's are right)."""
        o_told, o_gone, _ = other
        for h, rec in o_told.items():
            if h not in told and h not in gone:
                told[h] = 0
            if rec and told.get(h) == 0:
                extra.setdefault(h, rec)
        for h in o_gone:
            if h not in told and h not in gone:
                gone[h] = None

    def _use(self, told: dict, gone: dict) -> None:
        """A fold's state is the current one: its tokens offsets are the index."""
        self._at = {h: v for h, v in told.items() if v}
        self.stats["recorded_pages"], self.stats["recorded_removed"] = len(told), len(gone)

    def _state(self) -> tuple[dict, dict]:
        """(told stored, told removed) now: the copies read back and folded."""
        if not self._fds:
            return {}, {}
        try:
            data = os.pread(self._fds[0][1], self._end, 0)
        except OSError as e:
            self._drop_copy(0, "read", e)
            return self._state()
        told, gone, _ = self._fold(data)
        self._folded_end = self._end
        self._use(told, gone)
        return told, gone

    # --- the publisher thread's calls

    def keep(self, pages: Iterable[tuple[int, Optional[int], Optional[list]]]) -> None:
        """Record ``(hash, parent hash | None, token ids | None)`` of pages about to be told stored."""
        if not self._fds:
            return
        recs, plain, placed, seen = [], [], [], set()
        pos = self._end
        for h, parent, tokens in pages:
            if not tokens or h in self._at or h in seen:
                if not tokens:
                    plain.append(h)
                continue  # a tokens record stands: a page key names its tokens
            seen.add(h)
            rec = self._record([_KEEP, h, parent, list(tokens)])
            if len(rec) > RECORD_MAX_BYTES:
                plain.append(h)
                continue
            placed.append((h, pos << _SHIFT | len(rec)))
            recs.append(rec)
            pos += len(rec)
        recs += [self._record([_SEEN, part]) for part in _split(plain)]
        if recs and self._append(b"".join(recs)):
            self._at.update(placed)
            self._maybe_rewrite()

    def keep_hashes(self, hashes: list[int]) -> None:
        """Record pages about to be told stored without tokens: one append, no per-page work."""
        if hashes and self._fds and self._append(b"".join([self._record([_SEEN, part]) for part in _split(hashes)])):
            self._maybe_rewrite()

    def forget(self, hashes: list[int]) -> None:
        """Record pages about to be told removed."""
        if hashes and self._fds and self._append(b"".join([self._record([_GONE, part]) for part in _split(hashes)])):
            if self._at:
                pop = self._at.pop
                for h in hashes:
                    pop(h, None)
            self._maybe_rewrite()

    def reconcile(self, held: set, told_removed: bool = True) -> list[int]:
        """A re-announcement of the pages ``held`` (hashes): the pages told stored and not held
        are recorded told removed and returned, with (``told_removed``: for subscribers that may
        have missed frames) the pages lately told removed that are not held either. The log is
        rewritten with its live records, every held page recorded told stored (the re-announcement
        tells them: recording more than was told only ever costs a removal of a page not held)."""
        told, gone = self._state()
        stale = [h for h in told if h not in held]
        for h in stale:
            gone.pop(h, None)
            gone[h] = None
        for h in held:
            gone.pop(h, None)
        if len(gone) > self.gone_max:
            gone = dict.fromkeys(list(gone)[len(gone) - self.gone_max :])
        now = {h: told.get(h, 0) for h in held}
        if len(now) > self.max_pages:  # a store holding more pages than the record keeps
            self._over += len(now) - self.max_pages
            now = dict(list(now.items())[: self.max_pages])
        if self._fds:
            self._rewrite(now, gone)
        return list(gone) if told_removed else stale

    def sync(self) -> None:
        """Make the records appended so far durable (before the batch that announces them)."""
        if not self._dirty:
            return
        self._dirty = False
        for i in range(len(self._fds) - 1, -1, -1):
            try:
                os.fdatasync(self._fds[i][1])
            except OSError as e:
                self._drop_copy(i, "sync", e)

    def get(self, h: int) -> Optional[tuple[list[int], Optional[int]]]:
        """(token ids, parent hash) of a page, or None."""
        at = self._at.get(h)
        if not at or not self._fds:
            return None
        off, nbytes = at >> _SHIFT, at & ((1 << _SHIFT) - 1)
        try:
            raw = os.pread(self._fds[0][1], nbytes, off)
            size, crc = _HEAD.unpack_from(raw, 0)
            body = raw[_HEAD.size :]
            if len(body) != size or zlib.crc32(body) != crc:
                raise ValueError("record changed on disk")
            rec = self._dec.decode(body)
            if rec[0] != _KEEP or rec[1] != h:
                raise ValueError("record of another page")
            return list(rec[3]), rec[2]
        except Exception as e:  # noqa: BLE001 - a damaged record costs that page's tokens, not its record
            self.stats["record_errors"] += 1
            log.debug("umbp_nvme: %s: record of %d unreadable: %r", self.path, h, e)
            del self._at[h]
            return None

    def record_at(self, h: int) -> tuple[int, int] | None:
        """(file offset, record bytes) of page ``h``'s tokens record, None when it has none."""
        at = self._at.get(h)
        return (at >> _SHIFT, at & ((1 << _SHIFT) - 1)) if at else None

    def hashes(self) -> list[int]:
        """The hashes of the pages recorded told stored (the log folded now)."""
        return list(self._state()[0])

    def removed_hashes(self) -> list[int]:
        """The hashes of the pages recorded told removed (the latest ``gone_max``), oldest first."""
        return list(self._state()[1])

    @property
    def copies(self) -> list[str]:
        """The paths of the copies being written."""
        return [p for p, _ in self._fds]

    def __len__(self) -> int:
        return len(self._state()[0])

    # --- file

    def _record(self, payload) -> bytes:
        body = self._enc.encode(payload)
        return _HEAD.pack(len(body), zlib.crc32(body)) + body

    def _append(self, data: bytes) -> bool:
        """``data`` at the end of every copy; a copy that fails is given up. True while one took it."""
        for i in range(len(self._fds) - 1, -1, -1):
            try:
                view = memoryview(data)
                while view:
                    view = view[os.pwrite(self._fds[i][1], view, self._end + len(data) - len(view)) :]
            except OSError as e:
                self._drop_copy(i, "append to", e)
        if not self._fds:
            return False
        self._end += len(data)
        self._dirty = True
        return True

    def _maybe_rewrite(self) -> None:
        """Rewritten with its live records once it doubled since the last fold (after the index
        took what was just appended)."""
        if self._fds and self._end > 2 * self._folded_end + COMPACT_SLACK_BYTES:
            self._rewrite(*self._state())

    def _rewrite(self, told: dict, gone: dict, extra: Optional[dict[int, bytes]] = None) -> None:
        """Every copy rewritten (tmp, fdatasync, rename) with ``told`` and ``gone`` only: tokens
        records (read from the first copy, or ``extra``), then told-stored and told-removed hash lists."""
        from ..engine.files import open_regular

        chunks, at, plain, pos = [], {}, [], 0
        for h, v in told.items():
            rec = extra.get(h) if extra and not v else None
            if v:
                try:
                    rec = os.pread(self._fds[0][1], v & ((1 << _SHIFT) - 1), v >> _SHIFT)
                except OSError as e:
                    self._fail(self._fds[0][0], "read", e)
            if rec:
                at[h] = pos << _SHIFT | len(rec)
                chunks.append(rec)
                pos += len(rec)
            else:
                plain.append(h)
        chunks += [self._record([_SEEN, part]) for part in _split(plain)]
        chunks += [self._record([_TOMB, part]) for part in _split(list(gone))]
        data = b"".join(chunks)
        fds = []
        for path, old in self._fds:
            tmp, fd = path + ".tmp", -1
            try:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                fd = open_regular(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fdatasync(fd)
                os.rename(tmp, path)
                fds.append((path, fd))
            except OSError as e:
                if fd >= 0:
                    os.close(fd)
                self._fail(path, "rewrite", e)
                continue
            finally:
                os.close(old)
        self._fds, self._end, self._folded_end, self._dirty = fds, len(data), len(data), False
        self.stats["not_recorded_pages"] += self._over
        self._over = 0
        self._at = at
        self.stats["recorded_pages"], self.stats["recorded_removed"] = len(told), len(gone)

    def _drop_copy(self, i: int, what: str, e: OSError) -> None:
        path, fd = self._fds.pop(i)
        os.close(fd)
        self._fail(path, what, e)

    def _fail(self, path: str, what: str, e: OSError) -> None:
        self.stats["record_errors"] += 1
        if path not in self._failed:
            self._failed.add(path)
            left = len(self._fds)
            log.error("umbp_nvme: cannot %s %s (%r): %s (logged once; events go on)", what, path, e,
                      f"the {left} other copies of the record go on" if left else
                      "what DISK pages were announced is not recorded for a restart")  # fmt: skip

    def close(self) -> None:
        for _, fd in self._fds:
            os.close(fd)
        self._fds = []
