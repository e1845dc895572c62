"""Each announced page's token ids and parent, kept beside the store: a restart re-announces with them.

Dynamo's KV indexer drops a DISK ``BlockStored`` without ``token_ids``; the backend learns tokens
only from the engine's stream (kv_relay.py), which a restarted node no longer has for the pages
it already holds. So the publisher thread (never the data path) appends, for each page it
announces with tokens, one record to ``kv_tokens.log`` in the store directory, and a removal
record when the page leaves; the re-announcement at open reads them back.

The file is an append-only log of records ``[u32 payload bytes][u32 crc32][msgpack payload]``:
``[0, hash, parent hash | None, [tokens]]`` (kept) or ``[1, [hash, ...]]`` (dropped). Reading
stops at the first torn or damaged record (what follows is lost: those pages are re-announced
without tokens, which Dynamo skips; never a wrong token, because a page key is the hash of its
token chain). Nothing is fsynced: losing the tail costs tokens, not correctness. Memory holds
only hash -> offset; the log is rewritten (tmp + rename) once it is over twice its live records
plus ``COMPACT_SLACK_BYTES``, and keeps at most ``max_pages`` pages (the rest are counted).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Iterable, Optional

log = logging.getLogger(__name__)

FILE_NAME = "kv_tokens.log"
MAX_PAGES_DEFAULT = 1_000_000  # ~100 MB of index in memory at most (hash -> offset)
COMPACT_SLACK_BYTES = 4 << 20
RECORD_MAX_BYTES = 1 << 20  # a page of 64K tokens; a longer length field is damage
_HEAD = struct.Struct("<II")
_KEEP, _DROP = 0, 1


class TokenLog:
    """Single-threaded (the publisher's thread). Every method catches I/O errors: a log that
    cannot be written stops keeping tokens (logged once, counted) and the events go on."""

    def __init__(self, path: str, max_pages: int = MAX_PAGES_DEFAULT):
        import msgspec

        self.path = path
        self.max_pages = int(max_pages)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder()
        self._at: dict[int, tuple[int, int]] = {}  # hash -> (offset, record bytes)
        self._live_bytes = 0
        self._fd = -1
        self.stats = {"token_pages_kept": 0, "token_pages_not_kept": 0, "token_log_errors": 0}
        self._failed = False

    # --- open / load

    def open(self) -> None:
        """Load what the log holds (dropping a damaged tail) and open it for appends."""
        from ..engine.files import open_regular

        try:
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        except OSError as e:
            self._fail("open", e)
            return
        try:
            size = os.fstat(fd).st_size
            data = os.pread(fd, size, 0) if size else b""
            end = self._load(data)
            if end < size:
                log.warning("umbp_nvme: %s: %d bytes after offset %d are torn or damaged; dropped (their pages "
                            "are re-announced without tokens)", self.path, size - end, end)  # fmt: skip
                os.ftruncate(fd, end)
            os.lseek(fd, end, os.SEEK_SET)
        except OSError as e:
            os.close(fd)
            self._fail("read", e)
            return
        self._fd = fd
        self.stats["token_pages_kept"] = len(self._at)

    def _load(self, data: bytes) -> int:
        """Index the records in ``data``; the offset just past the last sound one."""
        off, n = 0, len(data)
        while off + _HEAD.size <= n:
            size, crc = _HEAD.unpack_from(data, off)
            body = off + _HEAD.size
            if size > RECORD_MAX_BYTES or body + size > n or zlib.crc32(data[body : body + size]) != crc:
                break
            try:
                rec = self._dec.decode(data[body : body + size])
                if rec[0] == _KEEP:
                    self._index(int(rec[1]), off, _HEAD.size + size)
                elif rec[0] == _DROP:
                    for h in rec[1]:
                        self._unindex(int(h))
                else:
                    break
            except Exception:  # noqa: BLE001 - a record that decodes to nonsense ends the log
                break
            off = body + size
        return off

    def _index(self, h: int, off: int, nbytes: int) -> None:
        self._unindex(h)
        self._at[h] = (off, nbytes)
        self._live_bytes += nbytes

    def _unindex(self, h: int) -> None:
        old = self._at.pop(h, None)
        if old is not None:
            self._live_bytes -= old[1]

    # --- the publisher thread's calls

    def keep(self, pages: Iterable[tuple[int, Optional[int], list]]) -> None:
        """Record ``(hash, parent hash | None, token ids)`` of pages just announced."""
        if self._fd < 0:
            return
        out, new, pos = [], [], os.lseek(self._fd, 0, os.SEEK_CUR)
        for h, parent, tokens in pages:
            if h in self._at:
                continue  # a page key names its tokens: the record already says it
            if len(self._at) + len(new) >= self.max_pages:
                self.stats["token_pages_not_kept"] += 1
                continue
            rec = self._record([_KEEP, h, parent, list(tokens)])
            new.append((h, pos, len(rec)))
            out.append(rec)
            pos += len(rec)
        if out and self._append(b"".join(out)):
            for h, off, nbytes in new:
                self._index(h, off, nbytes)
            self.stats["token_pages_kept"] = len(self._at)

    def drop(self, hashes: Iterable[int]) -> None:
        """Forget pages that left the store."""
        if self._fd < 0:
            return
        gone = [h for h in hashes if h in self._at]
        if not gone:
            return
        if self._append(self._record([_DROP, gone])):
            for h in gone:
                self._unindex(h)
            self.stats["token_pages_kept"] = len(self._at)
            self._maybe_compact()

    def get(self, h: int) -> Optional[tuple[list[int], Optional[int]]]:
        """(token ids, parent hash) of a page, or None."""
        at = self._at.get(h)
        if at is None or self._fd < 0:
            return None
        try:
            raw = os.pread(self._fd, at[1], at[0])
            size, crc = _HEAD.unpack_from(raw, 0)
            body = raw[_HEAD.size :]
            if len(body) != size or zlib.crc32(body) != crc:
                raise ValueError("record changed on disk")
            rec = self._dec.decode(body)
            if rec[0] != _KEEP or rec[1] != h:
                raise ValueError("record of another page")
            return list(rec[3]), rec[2]
        except Exception as e:  # noqa: BLE001 - a damaged record costs that page's tokens
            self.stats["token_log_errors"] += 1
            log.debug("umbp_nvme: %s: record of %d unreadable: %r", self.path, h, e)
            self._unindex(h)
            return None

    def retain(self, hashes: set) -> None:
        """Forget every page not in ``hashes`` (the store lost them while no one recorded it)."""
        stale = [h for h in self._at if h not in hashes]
        if stale:
            self.drop(stale)

    def record_at(self, h: int) -> tuple[int, int] | None:
        """(file offset, record bytes) of page ``h``'s record in the log, None when not kept."""
        return self._at.get(h)

    def hashes(self) -> list[int]:
        """The hashes of the pages kept."""
        return list(self._at)

    @property
    def live_bytes(self) -> int:
        """Bytes of the log's records still in use (the file is rewritten once mostly dead)."""
        return self._live_bytes

    def __len__(self) -> int:
        return len(self._at)

    # --- file

    def _record(self, payload) -> bytes:
        body = self._enc.encode(payload)
        return _HEAD.pack(len(body), zlib.crc32(body)) + body

    def _append(self, data: bytes) -> bool:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            return True
        except OSError as e:
            self._fail("append to", e)
            return False

    def _maybe_compact(self) -> None:
        size = os.lseek(self._fd, 0, os.SEEK_CUR)
        if size <= 2 * self._live_bytes + COMPACT_SLACK_BYTES:
            return
        tmp = self.path + ".tmp"
        from ..engine.files import open_regular

        fd = -1
        try:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            fd = open_regular(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC)
            at, pos, chunks = {}, 0, []
            for h, (off, nbytes) in self._at.items():
                chunks.append(os.pread(self._fd, nbytes, off))
                at[h] = (pos, nbytes)
                pos += nbytes
            view = memoryview(b"".join(chunks))
            while view:
                view = view[os.write(fd, view) :]
            os.rename(tmp, self.path)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            self._fail("compact", e)
            return
        os.close(self._fd)
        self._fd, self._at, self._live_bytes = fd, at, pos

    def _fail(self, what: str, e: OSError) -> None:
        self.stats["token_log_errors"] += 1
        if not self._failed:
            self._failed = True
            log.error("umbp_nvme: cannot %s %s (%r): tokens of new DISK pages are not kept for a restart "
                      "(logged once; events go on)", what, self.path, e)  # fmt: skip
        if what != "compact" and self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
