"""The portable cache archive's format: what `umbp-nvme export` writes (export.py) and `umbp-nvme
warmup` imports.

The format is specified in docs/archive.md. In short, little endian throughout:

    header   magic "UMBPARCH" | version u16 | flags u16 | json_len u32 | JSON | crc32c u32
    record   "REC\\0" | key_len u32 | length u64 | crc u32 | head_crc u32 | key | bytes   (repeated)
    trailer  "END\\0" | 0 u32 | records u64 | payload_bytes u64 | digest u32 | crc u32

Streamable both ways (no seeks, no index at the end): a reader verifies each record's framing
(``head_crc``) and its bytes (``crc``, CRC32C, the same checksum the store keeps per object),
and the trailer proves the stream is complete. A truncated archive is detected, and every
record before the cut is still usable.
"""

from __future__ import annotations

import io
import json
import os
import stat
import struct
import time
from dataclasses import dataclass

from ..keybytes import decode_key, encode_key, printable_key

MAGIC = b"UMBPARCH"
VERSION = 1
REC_TAG = b"REC\0"
END_TAG = b"END\0"
MAX_KEY_BYTES = 64 << 10
MAX_OBJECT_BYTES = 1 << 40
MAX_HEADER_BYTES = 16 << 20
# after a damaged frame, candidates with longer keys are not considered: the store's keys are
# <= 511 bytes, and the cap bounds what bytes crafted to look like frames cost the scan
RESYNC_MAX_KEY_BYTES = 1024

_HEAD = struct.Struct("<8sHHI")  # magic, version, flags, json_len
REC = struct.Struct("<4sIQI")  # tag, key_len, length, crc
U32 = struct.Struct("<I")
_TRAILER = struct.Struct("<4sIQQI")  # tag, 0, records, payload_bytes, digest


def crc32c_impl():
    """The native CRC32C function (records and the digest use it), imported on first use."""
    from .._uring import crc32c

    return crc32c


class ArchiveError(ValueError):
    """The file is not an archive, is damaged, or is of an unsupported version."""


@dataclass
class RecordHead:
    key: str  # keybytes.decode_key of the stored bytes: every byte string is a key
    length: int
    crc: int
    error: str | None = None  # why this record cannot be imported (it must be skipped); framing is intact


class ArchiveWriter:
    """``with ArchiveWriter(f, namespace) as w: w.add(key, data, crc)``; ``close()`` writes the trailer.

    ``f`` is a binary file object opened for writing (a pipe is fine). The caller passes the
    CRC32C it already has (the store's); ``add`` recomputes it when ``crc`` is None.
    """

    def __init__(self, f, namespace: dict | None, *, source: str | None = None, extra: dict | None = None):
        self._f = f
        self._crc32c = crc32c_impl()
        self.records = 0
        self.payload_bytes = 0
        self._digest = 0
        header = {
            "format": "umbp_nvme-archive",
            "version": VERSION,
            "namespace": namespace or {},
            "created_unix": int(time.time()),
            "source": source,
        }
        if extra:
            header.update(extra)
        blob = json.dumps(header, sort_keys=True).encode()
        head = _HEAD.pack(MAGIC, VERSION, 0, len(blob)) + blob
        self._write(head + U32.pack(self._crc32c(head)))
        self._closed = False

    def _write(self, data) -> None:
        mv = memoryview(data)
        while len(mv):
            n = self._f.write(mv)
            if n is None:  # non-blocking raw files only; ours are blocking
                n = 0
            mv = mv[n:]

    def add(self, key: str, data, crc: int | None = None) -> None:
        kb = encode_key(key)  # the store's own key bytes (keybytes): what the reader decodes back
        if not 0 < len(kb) <= MAX_KEY_BYTES:
            raise ValueError(f"archive keys must be 1..{MAX_KEY_BYTES} bytes, got {len(kb)} for {printable_key(key[:80])}")
        mv = memoryview(data).cast("B")
        if crc is None:
            crc = self._crc32c(mv)
        rec = REC.pack(REC_TAG, len(kb), mv.nbytes, crc)
        self._write(rec + U32.pack(self._crc32c(rec + kb)) + kb)
        self._write(mv)
        self.records += 1
        self.payload_bytes += mv.nbytes
        self._digest = self._crc32c(U32.pack(crc), self._digest)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t = _TRAILER.pack(END_TAG, 0, self.records, self.payload_bytes, self._digest)
        self._write(t + U32.pack(self._crc32c(t)))
        self._f.flush()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()


class ArchiveReader:
    """Sequential reader. ``header`` is the parsed JSON header (``namespace`` inside).

    Loop: ``head = r.next()`` (None at the verified trailer), then exactly one of
    ``r.read_into(buffer)`` (returns True when the bytes match the record's CRC32C) or
    ``r.skip()``; a head with ``error`` set (empty key, larger than ``max_object_bytes``) must be
    skipped. ``name`` is used in error messages.

    Nothing the file declares is trusted before it is checked: a record's size is compared with
    the bytes left in the file (when it is a regular file) and ``max_object_bytes`` before anyone
    allocates for it, and a record whose framing checksum fails is passed over by scanning for the
    next intact frame (``damaged`` counts such regions). After an ArchiveError from ``next``,
    ``read_into`` or ``skip`` the stream is unusable (``fatal`` holds the reason): the records
    read before it stay valid.
    """

    def __init__(self, f, name: str = "<archive>", *, max_object_bytes: int = MAX_OBJECT_BYTES):
        self._f = f
        self.name = name
        self.max_object_bytes = max_object_bytes
        self._crc32c = crc32c_impl()
        self.records = 0
        self.payload_bytes = 0
        self._digest = 0
        self._pending: RecordHead | None = None
        self._back = b""  # bytes read ahead while resynchronising, consumed before the file ...
        self._bpos = 0  # ... from here (an index, so consuming it never copies the rest)
        self.complete = False
        self.damaged = 0  # damaged regions passed over (each lost at least one record)
        self.fatal: str | None = None
        self.resync_notes: list[str] = []  # damaged regions the last next() passed over
        self.offset = 0
        self._end = self._file_end()
        fixed = self._read_exact(_HEAD.size, "header")
        magic, version, _flags, json_len = _HEAD.unpack(fixed)
        if magic != MAGIC:
            raise ArchiveError(
                f"{name} is not a umbp_nvme archive (magic {magic!r}, expected {MAGIC!r}); "
                "give a file written by `umbp-nvme export`"
            )
        if version != VERSION:
            raise ArchiveError(
                f"{name} is archive format version {version}; this umbp_nvme reads version {VERSION}. "
                "Upgrade umbp_nvme on this node or export again with the same version."
            )
        if json_len > MAX_HEADER_BYTES:
            raise ArchiveError(f"{name}: header of {json_len} bytes is implausibly large; the file is damaged")
        self._check_left(json_len + 4, "header")
        blob = self._read_exact(json_len, "header")
        (crc,) = U32.unpack(self._read_exact(4, "header"))
        if crc != self._crc32c(fixed + blob):
            raise ArchiveError(f"{name}: header checksum mismatch; the file is damaged")
        try:
            self.header = json.loads(blob)
        except (ValueError, RecursionError) as e:  # RecursionError: checksummed but nested 1e6 deep
            raise ArchiveError(f"{name}: header is not valid JSON ({e})") from None
        if not isinstance(self.header, dict) or not isinstance(self.header.get("namespace") or {}, dict):
            raise ArchiveError(f"{name}: header is not a JSON object with an object \"namespace\"; the file is damaged")
        self.namespace = self.header.get("namespace") or {}

    @classmethod
    def open(cls, path: str, **kw) -> "ArchiveReader":
        """``path`` "-" reads stdin (a pipe: sizes are then bounded by ``max_object_bytes`` alone)."""
        if path == "-":
            import sys

            return cls(sys.stdin.buffer, "<stdin>", **kw)
        f = open(path, "rb", buffering=1 << 20)
        try:
            return cls(f, path, **kw)
        except BaseException:
            f.close()
            raise

    def close(self) -> None:
        self._f.close()

    def _file_end(self) -> int | None:
        """Bytes from where reading starts to the end of a regular (or in-memory) file; None for streams."""
        try:
            st = os.fstat(self._f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return None
            return st.st_size - self._f.tell()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            pass
        try:  # in-memory files (BytesIO): seekable without a descriptor
            if self._f.seekable():
                pos = self._f.tell()
                end = self._f.seek(0, io.SEEK_END)
                self._f.seek(pos)
                return end - pos
        except (AttributeError, OSError, ValueError):
            pass
        return None

    @property
    def bytes_left(self) -> int | None:
        """Bytes not read yet, when the archive is a regular file; None for a pipe."""
        return None if self._end is None else max(0, self._end - self.offset)

    def _check_left(self, n: int, what: str) -> None:
        """Refuse a declared size the file cannot hold, before anything is allocated for it."""
        if self._end is not None and n > self._end - self.offset:
            self._die(
                f"{self.name} is truncated: the {what} at byte {self.offset} declares {n} bytes but only "
                f"{max(0, self._end - self.offset)} remain; the {self.records} records before it are intact. "
                "Export it again or copy it completely."
            )

    def _die(self, msg: str):
        self.fatal = msg
        self._pending = None
        raise ArchiveError(msg)

    def _take_back(self, n: int) -> bytes:
        """Up to n of the bytes read ahead (b"" when there are none)."""
        if not self._back:
            return b""
        out = self._back[self._bpos : self._bpos + n]
        self._bpos += len(out)
        if self._bpos >= len(self._back):
            self._back, self._bpos = b"", 0
        return out

    def _read(self, n: int) -> bytes:
        """Up to n bytes (fewer only at end of file)."""
        out = self._take_back(n)
        while len(out) < n:
            chunk = self._f.read(n - len(out))
            if not chunk:
                break
            out += chunk
        return out

    def _read_exact(self, n: int, what: str) -> bytes:
        if self.fatal is not None:
            raise ArchiveError(self.fatal)
        data = self._read(n)
        if len(data) != n:
            at = self.offset + len(data)
            self._die(
                f"{self.name} is truncated at byte {at} (reading the {what}); "
                f"the {self.records} records before it are intact. Export it again or copy it completely."
            )
        self.offset += n
        return data

    def _frame_at(self, buf: bytes, i: int) -> int | None:
        """Length of a checksum-valid record or trailer frame at buf[i:], 0 if buf is too short to
        tell, None if there is none there."""
        tag = buf[i : i + 4]
        if tag == END_TAG:
            if len(buf) - i < _TRAILER.size + 4:
                return 0
            t = buf[i : i + _TRAILER.size]
            return _TRAILER.size + 4 if U32.unpack_from(buf, i + _TRAILER.size)[0] == self._crc32c(t) else None
        if tag == REC_TAG:
            if len(buf) - i < REC.size + 4:
                return 0
            _, key_len, _, _ = REC.unpack_from(buf, i)
            if key_len > RESYNC_MAX_KEY_BYTES:
                return None
            need = REC.size + 4 + key_len
            if len(buf) - i < need:
                return 0
            fixed = buf[i : i + REC.size]
            kb = buf[i + REC.size + 4 : i + need]
            return need if U32.unpack_from(buf, i + REC.size)[0] == self._crc32c(fixed + kb) else None
        return None

    def _resync(self, start: int, window: bytes, why: str) -> None:
        """A frame at byte ``start`` is damaged (``window`` = the bytes read from there): scan for the
        next checksum-valid frame and continue from it. The records in between are lost; the
        checksums make a false match about 2**-32 per candidate. Linear in the bytes scanned: each
        tag is searched for once per position, and a candidate costs at most a CRC over
        RESYNC_MAX_KEY_BYTES (bytes crafted to be all candidates cannot make it quadratic)."""
        self.damaged += 1
        buf = window
        base = start  # file offset of buf[0]
        i = 1
        nxt = {REC_TAG: -2, END_TAG: -2}  # next position of each tag at or after i; -1 none in buf; -2 unknown
        eof = False
        while True:
            for tag, pos in nxt.items():
                if pos == -2 or 0 <= pos < i:
                    nxt[tag] = buf.find(tag, i)
            hits = [j for j in nxt.values() if j >= 0]
            if hits:
                j = min(hits)
                n = self._frame_at(buf, j)
                if n is None or (n == 0 and eof):  # not a frame, or one the end of the file cuts
                    i = j + 1
                    continue
                if n:
                    self._back, self._bpos = buf[j:] + self._back[self._bpos :], 0
                    self.offset = base + j
                    self.resync_notes.append(
                        f"{self.name}: {why} at byte {start}; skipped {base + j - start} bytes "
                        f"to the next intact frame at byte {base + j} (the records in between are lost)"
                    )
                    return
            else:
                j = max(i, len(buf) - 3)  # a tag may straddle the next chunk
            # keep buf[j:] and read more
            more = b"" if eof else self._read(1 << 20)
            if not more and (eof or not hits):
                self.offset = base + len(buf)
                self._die(
                    f"{self.name}: {why} at byte {start}, and no intact record follows it up to the end "
                    f"(byte {base + len(buf)}); the {self.records} records before it are intact"
                )
            if not more:  # a candidate waits for bytes that will not come: judge the rest as is
                eof = True
                continue
            base += j
            buf = buf[j:] + more
            i = 0
            nxt = {REC_TAG: -2, END_TAG: -2}

    def next(self) -> RecordHead | None:
        if self.fatal is not None:
            raise ArchiveError(self.fatal)
        if self._pending is not None:
            raise RuntimeError("read_into() or skip() the previous record first")
        self.resync_notes = []
        while True:
            start = self.offset
            if self._end is not None and start == self._end:
                self._die(
                    f"{self.name} is truncated at byte {start}: it ends without its trailer; the {self.records} "
                    "records before it are intact. Export it again or copy it completely."
                )
            tag = self._read_exact(4, "next record")
            if tag == END_TAG:
                rest = self._read_exact(_TRAILER.size - 4 + 4, "trailer")
                t = tag + rest[:-4]
                (crc,) = U32.unpack(rest[-4:])
                if crc != self._crc32c(t):
                    self._resync(start, tag + rest, "trailer checksum mismatch")
                    continue
                _, _, records, payload, digest = _TRAILER.unpack(t)
                if (records, payload, digest) != (self.records, self.payload_bytes, self._digest) and not self.damaged:
                    self._die(
                        f"{self.name}: trailer says {records} records / {payload} bytes, but the stream held "
                        f"{self.records} / {self.payload_bytes} (or their checksums differ); the file is damaged"
                    )
                self.complete = True  # after a damaged region the counts differ by design; it was reported
                return None
            if tag != REC_TAG:
                self._resync(start, tag, f"bad record tag {tag!r}")
                continue
            rest = self._read_exact(REC.size - 4 + 4, "record header")
            fixed = tag + rest[:-4]
            (head_crc,) = U32.unpack(rest[-4:])
            _, key_len, length, crc = REC.unpack(fixed)
            if key_len > MAX_KEY_BYTES:
                self._resync(start, tag + rest, f"implausible key length {key_len}")
                continue
            self._check_left(key_len, "record key")
            kb = self._read_exact(key_len, "record key")
            if head_crc != self._crc32c(fixed + kb):
                self._resync(start, tag + rest + kb, "record header checksum mismatch")
                continue
            # the frame is intact from here: the sizes are what the writer wrote
            self._check_left(length, f"record {self.records + 1}")
            key = decode_key(kb)
            err = None
            if not kb:
                err = f"{self.name}: record {self.records + 1} at byte {start} has an empty key"
            elif length > self.max_object_bytes:
                err = (f"{self.name}: record {printable_key(key)} is {length} bytes, over the largest object "
                       f"this store takes ({self.max_object_bytes} bytes)")
            self._pending = RecordHead(key, length, crc, err)
            return self._pending

    def _account(self, head: RecordHead) -> None:
        self._pending = None
        self.records += 1
        self.payload_bytes += head.length
        self._digest = self._crc32c(U32.pack(head.crc), self._digest)

    def _truncated_in(self, head: RecordHead) -> None:
        self._die(
            f"{self.name} is truncated inside the bytes of record {self.records + 1} ({printable_key(head.key)}); "
            f"the {self.records} records before it are intact"
        )

    def read_into(self, buf) -> bool:
        """Read the pending record's bytes into ``buf`` (at least ``length`` bytes); True when its CRC matches."""
        head = self._pending
        if head is None:
            raise RuntimeError("next() first")
        mv = memoryview(buf).cast("B")[: head.length]
        if mv.nbytes < head.length:
            raise ValueError(f"buffer of {mv.nbytes} bytes for a {head.length}-byte record")
        back = self._take_back(head.length)
        mv[: len(back)] = back
        got = len(back)
        readinto = getattr(self._f, "readinto", None)
        while got < head.length:
            if readinto is not None:
                n = readinto(mv[got:])
            else:
                chunk = self._f.read(head.length - got)
                n = len(chunk or b"")
                mv[got : got + n] = chunk
            if not n:
                self.offset += got
                self._truncated_in(head)
            got += n
        self.offset += head.length
        self._account(head)
        return self._crc32c(mv) == head.crc

    def skip(self) -> None:
        head = self._pending
        if head is None:
            raise RuntimeError("next() first")
        left = head.length - len(self._take_back(head.length))
        try:
            seekable = self._f.seekable()
        except (AttributeError, ValueError):
            seekable = False
        if seekable and left > (1 << 16):
            pos = self._f.tell()
            end = self._f.seek(0, io.SEEK_END)
            if end - pos < left:
                self._truncated_in(head)
            self._f.seek(pos + left)
        else:
            while left:
                chunk = self._f.read(min(left, 1 << 20))
                if not chunk:
                    self._truncated_in(head)
                left -= len(chunk)
        self.offset += head.length
        self._account(head)

    def __iter__(self):
        """(key, bytes, crc_ok) for every record; for tests and small archives."""
        while True:
            head = self.next()
            if head is None:
                return
            if head.error is not None:
                self.skip()
                continue
            buf = bytearray(head.length)
            ok = self.read_into(buf)
            yield head.key, bytes(buf), ok
