"""The portable cache archive: what `umbp-nvme export` writes and `umbp-nvme warmup` imports.

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
import struct
import time
from dataclasses import dataclass

MAGIC = b"UMBPARCH"
VERSION = 1
REC_TAG = b"REC\0"
END_TAG = b"END\0"
MAX_KEY_BYTES = 64 << 10
MAX_OBJECT_BYTES = 1 << 40
MAX_HEADER_BYTES = 16 << 20

_HEAD = struct.Struct("<8sHHI")  # magic, version, flags, json_len
_REC = struct.Struct("<4sIQI")  # tag, key_len, length, crc
_U32 = struct.Struct("<I")
_TRAILER = struct.Struct("<4sIQQI")  # tag, 0, records, payload_bytes, digest


def _crc32c():
    from ._uring import crc32c

    return crc32c


class ArchiveError(ValueError):
    """The file is not an archive, is damaged, or is of an unsupported version."""


@dataclass
class RecordHead:
    key: str
    length: int
    crc: int


class ArchiveWriter:
    """``with ArchiveWriter(f, namespace) as w: w.add(key, data, crc)``; ``close()`` writes the trailer.

    ``f`` is a binary file object opened for writing (a pipe is fine). The caller passes the
    CRC32C it already has (the store's); ``add`` recomputes it when ``crc`` is None.
    """

    def __init__(self, f, namespace: dict | None, *, source: str | None = None, extra: dict | None = None):
        self._f = f
        self._crc32c = _crc32c()
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
        self._write(head + _U32.pack(self._crc32c(head)))
        self._closed = False

    def _write(self, data) -> None:
        mv = memoryview(data)
        while len(mv):
            n = self._f.write(mv)
            if n is None:  # non-blocking raw files only; ours are blocking
                n = 0
            mv = mv[n:]

    def add(self, key: str, data, crc: int | None = None) -> None:
        kb = key.encode()
        if not 0 < len(kb) <= MAX_KEY_BYTES:
            raise ValueError(f"archive keys must be 1..{MAX_KEY_BYTES} bytes of UTF-8, got {len(kb)} for {key[:80]!r}")
        mv = memoryview(data).cast("B")
        if crc is None:
            crc = self._crc32c(mv)
        rec = _REC.pack(REC_TAG, len(kb), mv.nbytes, crc)
        self._write(rec + _U32.pack(self._crc32c(rec + kb)) + kb)
        self._write(mv)
        self.records += 1
        self.payload_bytes += mv.nbytes
        self._digest = self._crc32c(_U32.pack(crc), self._digest)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t = _TRAILER.pack(END_TAG, 0, self.records, self.payload_bytes, self._digest)
        self._write(t + _U32.pack(self._crc32c(t)))
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
    ``r.skip()``. ``name`` is used in error messages.
    """

    def __init__(self, f, name: str = "<archive>"):
        self._f = f
        self.name = name
        self._crc32c = _crc32c()
        self.records = 0
        self.payload_bytes = 0
        self._digest = 0
        self._pending: RecordHead | None = None
        self.complete = False
        self.offset = 0
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
        blob = self._read_exact(json_len, "header")
        (crc,) = _U32.unpack(self._read_exact(4, "header"))
        if crc != self._crc32c(fixed + blob):
            raise ArchiveError(f"{name}: header checksum mismatch; the file is damaged")
        try:
            self.header = json.loads(blob)
        except ValueError as e:
            raise ArchiveError(f"{name}: header is not valid JSON ({e})") from None
        self.namespace = self.header.get("namespace") or {}

    @classmethod
    def open(cls, path: str) -> "ArchiveReader":
        f = open(path, "rb", buffering=1 << 20)
        try:
            return cls(f, path)
        except BaseException:
            f.close()
            raise

    def close(self) -> None:
        self._f.close()

    def _read_exact(self, n: int, what: str) -> bytes:
        data = self._f.read(n)
        if data is None or len(data) != n:
            raise ArchiveError(
                f"{self.name} is truncated at byte {self.offset + len(data or b'')} (reading the {what}); "
                f"the {self.records} records before it are intact. Export it again or copy it completely."
            )
        self.offset += n
        return data

    def next(self) -> RecordHead | None:
        if self._pending is not None:
            raise RuntimeError("read_into() or skip() the previous record first")
        tag = self._read_exact(4, "next record")
        if tag == END_TAG:
            rest = self._read_exact(_TRAILER.size - 4 + 4, "trailer")
            t = tag + rest[:-4]
            (crc,) = _U32.unpack(rest[-4:])
            _, _, records, payload, digest = _TRAILER.unpack(t)
            if crc != self._crc32c(t):
                raise ArchiveError(f"{self.name}: trailer checksum mismatch; the file is damaged")
            if (records, payload, digest) != (self.records, self.payload_bytes, self._digest):
                raise ArchiveError(
                    f"{self.name}: trailer says {records} records / {payload} bytes, but the stream held "
                    f"{self.records} / {self.payload_bytes} (or their checksums differ); the file is damaged"
                )
            self.complete = True
            return None
        if tag != REC_TAG:
            raise ArchiveError(f"{self.name}: bad record tag {tag!r} at byte {self.offset - 4}; the file is damaged")
        rest = self._read_exact(_REC.size - 4 + 4, "record header")
        fixed = tag + rest[:-4]
        (head_crc,) = _U32.unpack(rest[-4:])
        _, key_len, length, crc = _REC.unpack(fixed)
        if not 0 < key_len <= MAX_KEY_BYTES or length > MAX_OBJECT_BYTES:
            raise ArchiveError(f"{self.name}: implausible record (key {key_len} bytes, object {length} bytes) at byte {self.offset}")
        kb = self._read_exact(key_len, "record key")
        if head_crc != self._crc32c(fixed + kb):
            raise ArchiveError(f"{self.name}: record header checksum mismatch at byte {self.offset}; the file is damaged")
        self._pending = RecordHead(kb.decode(), length, crc)
        return self._pending

    def _account(self, head: RecordHead) -> None:
        self._pending = None
        self.records += 1
        self.payload_bytes += head.length
        self._digest = self._crc32c(_U32.pack(head.crc), self._digest)

    def read_into(self, buf) -> bool:
        """Read the pending record's bytes into ``buf`` (at least ``length`` bytes); True when its CRC matches."""
        head = self._pending
        if head is None:
            raise RuntimeError("next() first")
        mv = memoryview(buf).cast("B")[: head.length]
        if mv.nbytes < head.length:
            raise ValueError(f"buffer of {mv.nbytes} bytes for a {head.length}-byte record")
        got = 0
        readinto = getattr(self._f, "readinto", None)
        while got < head.length:
            if readinto is not None:
                n = readinto(mv[got:])
            else:
                chunk = self._f.read(head.length - got)
                n = len(chunk or b"")
                mv[got : got + n] = chunk
            if not n:
                raise ArchiveError(
                    f"{self.name} is truncated inside the bytes of record {self.records + 1} ({head.key!r}); "
                    f"the {self.records} records before it are intact"
                )
            got += n
        self.offset += head.length
        self._account(head)
        return self._crc32c(mv) == head.crc

    def skip(self) -> None:
        head = self._pending
        if head is None:
            raise RuntimeError("next() first")
        left = head.length
        try:
            seekable = self._f.seekable()
        except (AttributeError, ValueError):
            seekable = False
        if seekable and left > (1 << 16):
            pos = self._f.tell()
            end = self._f.seek(0, io.SEEK_END)
            if end - pos < left:
                raise ArchiveError(f"{self.name} is truncated inside the bytes of record {self.records + 1} ({head.key!r})")
            self._f.seek(pos + left)
        else:
            while left:
                chunk = self._f.read(min(left, 1 << 20))
                if not chunk:
                    raise ArchiveError(f"{self.name} is truncated inside the bytes of record {self.records + 1} ({head.key!r})")
                left -= len(chunk)
        self.offset += head.length
        self._account(head)

    def __iter__(self):
        """(key, bytes, crc_ok) for every record; for tests and small archives."""
        while True:
            head = self.next()
            if head is None:
                return
            buf = bytearray(head.length)
            ok = self.read_into(buf)
            yield head.key, bytes(buf), ok


def open_for_write(path: str):
    """A binary file for the archive: stdout for "-", else ``path`` (created 0644, replaced atomically by the caller)."""
    if path == "-":
        import sys

        return sys.stdout.buffer
    return open(path, "wb", buffering=1 << 20)


def tmp_path_for(path: str) -> str:
    d, b = os.path.split(os.path.abspath(path))
    return os.path.join(d, f".{b}.partial.{os.getpid()}")


# --- export ----------------------------------------------------------------------------------


def export_store(store_path: str, out: str, *, keys: list[str] | None = None, progress=None) -> dict:
    """Write the store's objects (or only ``keys``) to an archive at ``out`` ("-" = stdout).

    Reads the store read-only (a running writer is fine): each object is read as it lies on disk
    and checked against the store's CRC32C before it goes into the archive; an object the writer
    evicts meanwhile is left out. A file is written under a temporary name and renamed when
    complete, so ``out`` is never a partial archive.
    """
    from .maintenance import StoreReader

    t0 = time.perf_counter()
    summary = {"store": os.path.abspath(store_path), "out": out, "exported": 0, "bytes": 0, "vanished": 0,
               "failed": 0, "missing": 0, "errors": []}
    with StoreReader(store_path) as r:
        recs = r.records(keys)
        if keys is not None:
            summary["missing"] = len(set(keys)) - len(recs)
        tmp = None
        if out == "-":
            f = open_for_write(out)
        else:
            tmp = tmp_path_for(out)
            f = open(tmp, "wb", buffering=1 << 20)
        ok = False
        try:
            w = ArchiveWriter(f, r.namespace, source=r.path, extra={"objects_listed": len(recs)})
            buf = bytearray(max([x.length for x in recs], default=1))
            for rec in recs:
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
                        summary["errors"].append(f"{rec.key!r}: {status} (left out; `umbp-nvme verify --repair` drops it)")
                if progress is not None:
                    progress(rec.length)
            w.close()
            if tmp is not None:
                f.flush()
                os.fsync(f.fileno())
            ok = True
        finally:
            if tmp is not None:
                f.close()
                if ok:
                    os.replace(tmp, out)
                else:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    return summary
