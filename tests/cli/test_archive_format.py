"""The archive format (docs/archive.md): round trip, streaming, and damage detection."""

from __future__ import annotations

import io
import struct

import pytest

from umbp_nvme.cli.archive import MAGIC, ArchiveError, ArchiveReader, ArchiveWriter


def _archive(records, namespace=None) -> bytes:
    f = io.BytesIO()
    with ArchiveWriter(f, namespace or {"model": "m"}) as w:
        for k, v in records:
            w.add(k, v)
    return f.getvalue()


RECORDS = [("a_0_k", b"x" * 5000), ("a_0_v", bytes(range(256)) * 3), ("h__k", b""), ("ü_0_k", b"\x00\xff" * 10)]


def test_round_trip_keeps_keys_bytes_order_and_namespace():
    data = _archive(RECORDS, {"model": "org/m", "page_size": 64})
    r = ArchiveReader(io.BytesIO(data))
    assert r.namespace == {"model": "org/m", "page_size": 64}
    assert [(k, v) for k, v, ok in r] == RECORDS
    assert r.complete and r.records == len(RECORDS)


def test_reads_from_a_non_seekable_stream_and_skips_records():
    data = _archive(RECORDS)

    class Pipe(io.RawIOBase):
        def __init__(self, b):
            self._b = io.BytesIO(b)

        def readable(self):
            return True

        def readinto(self, mv):
            chunk = self._b.read(min(len(mv), 777))  # short reads, like a pipe
            mv[: len(chunk)] = chunk
            return len(chunk)

    r = ArchiveReader(io.BufferedReader(Pipe(data), 1024))
    got = []
    while (h := r.next()) is not None:
        if h.key.endswith("_v"):
            r.skip()
        else:
            buf = bytearray(h.length)
            assert r.read_into(buf)
            got.append(h.key)
    assert got == ["a_0_k", "h__k", "ü_0_k"] and r.complete


def test_flipped_payload_byte_fails_that_records_crc_only():
    data = bytearray(_archive(RECORDS))
    pos = data.index(b"x" * 5000) + 1234
    data[pos] ^= 0x01
    r = ArchiveReader(io.BytesIO(bytes(data)))
    oks = {k: ok for k, v, ok in r}
    assert oks == {"a_0_k": False, "a_0_v": True, "h__k": True, "ü_0_k": True}


def test_truncated_archive_is_detected_after_the_intact_records():
    data = _archive(RECORDS)
    r = ArchiveReader(io.BytesIO(data[:-10]))  # the trailer is cut
    seen = []
    with pytest.raises(ArchiveError, match="truncated"):
        for k, v, ok in r:
            seen.append(k)
    assert seen == [k for k, _ in RECORDS]


def test_trailer_count_mismatch_is_damage():
    a = _archive(RECORDS[:2])
    b = _archive(RECORDS[:3])
    # splice b's trailer onto a: a valid trailer that does not describe this stream
    trailer = b[-32:]
    with pytest.raises(ArchiveError, match="trailer"):
        list(ArchiveReader(io.BytesIO(a[:-32] + trailer)))


def test_not_an_archive_and_future_version_are_refused_with_what_to_do():
    with pytest.raises(ArchiveError, match="not a umbp_nvme archive"):
        ArchiveReader(io.BytesIO(b"PK\x03\x04" + b"\0" * 64), "x.zip")
    data = bytearray(_archive(RECORDS))
    data[8:10] = struct.pack("<H", 99)
    with pytest.raises(ArchiveError, match="version 99"):
        ArchiveReader(io.BytesIO(bytes(data)))
    assert bytes(data[:8]) == MAGIC


def test_damaged_header_is_refused():
    data = bytearray(_archive(RECORDS))
    data[20] ^= 0xFF  # inside the JSON header
    with pytest.raises(ArchiveError, match="header"):
        ArchiveReader(io.BytesIO(bytes(data)))
