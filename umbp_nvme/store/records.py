"""Index records in the segments: the durable truth the LMDB index caches.

Each segment file holds its slots from the start and, at its tail, a record area: one 256-byte
record per slot (slot index = offset // size class, so a segment's records are dense whatever
its class), 16 to a 4 KiB block; block b is the b-th 4 KiB block from the end of the file. A
class gets as many slots as leave room for their record blocks (``layout.record_slots``), so
the files keep their size and the store its capacity. A strict put writes its objects' records beside their data and one
fdatasync per segment covers both; the LMDB commit after it is not synced. A delete clears the
slot's record (a tombstone) the same way before the slot can be reused.

The writer changes records in memory and writes whole blocks copied from there (O_DIRECT needs
aligned blocks); record_areas.py keeps those blocks, a bounded number of them.

A record says ``CONFIRMED`` only in images written after its data's fdatasync completed: a
rebuild trusts confirmed records and checks the data CRC of the others (the last batch or so
per segment after a crash). Confirmations ride along with the next write to the segment, and
flush/close write the rest.

State: none (the record format and its C helpers).
"""

from __future__ import annotations

import numpy as np

from .layout import SEGMENT_RECORD_BYTES, SLOT_ALIGN_BYTES, record_slots

RECORD_BYTES = SEGMENT_RECORD_BYTES
KEY_INLINE = 208  # key bytes held in a record; longer keys keep a prefix and cannot be rebuilt
PER_BLOCK = SLOT_ALIGN_BYTES // RECORD_BYTES
MAGIC = 0x5552
R_VALID, R_CONFIRMED, R_KEY_TRUNC = 1, 2, 4

RECORD_DTYPE = np.dtype(
    [
        ("rcrc", "<u4"),  # CRC32C of the record's bytes 4..256
        ("magic", "<u2"),
        ("flags", "<u2"),
        ("segment", "<u4"),
        ("length", "<u4"),
        ("offset", "<u8"),
        ("generation", "<u8"),
        ("crc", "<u4"),  # CRC32C of the object bytes
        ("key_crc", "<u4"),  # CRC32C of the whole key
        ("depth", "<i4"),
        ("key_len", "<u2"),
        ("pad", "<u2"),
        ("key", "u1", (KEY_INLINE,)),
    ]
)
assert RECORD_DTYPE.itemsize == RECORD_BYTES


def place(area: np.ndarray, slots: np.ndarray, recs: np.ndarray, confirm: bool) -> list[int]:
    """Records copied into their slots of ``area`` in one C call (native/uring_records.c
    place_records); the blocks touched, ascending. ``confirm``: only where the slot still holds the
    same generation, valid and unconfirmed, and slots outside the area skipped; else every slot
    must lie in the area (ValueError before any copy)."""
    from .._uring import place_records

    out = np.empty(len(slots), np.int64)
    k = place_records(area.view(np.uint8), np.ascontiguousarray(slots, np.int64),
                      np.ascontiguousarray(recs, RECORD_DTYPE).view(np.uint8), confirm, out)  # fmt: skip
    return out[:k].tolist()


def block_offset(segment_bytes: int, blk: int) -> int:
    """File offset of record block ``blk`` (block 0 is the segment's last 4 KiB)."""
    return segment_bytes - (blk + 1) * SLOT_ALIGN_BYTES


def block_buffer(n: int, zero: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Room for ``n`` 4 KiB blocks that O_DIRECT takes: (the allocation, which must live until the
    kernel is done with it; its 4 KiB-aligned view; each block's address)."""
    raw = (np.zeros if zero else np.empty)((n + 1) * SLOT_ALIGN_BYTES, np.uint8)
    pad = -raw.ctypes.data % SLOT_ALIGN_BYTES
    view = raw[pad : pad + n * SLOT_ALIGN_BYTES]
    return raw, view, np.uint64(view.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(SLOT_ALIGN_BYTES)


def area_blocks(segment_bytes: int, cls: int) -> int:
    return -(-record_slots(segment_bytes, cls) // PER_BLOCK)


def slot_index(offs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    cls = (-(-lens.astype(np.int64) // SLOT_ALIGN_BYTES)) * SLOT_ALIGN_BYTES
    return offs.astype(np.int64) // cls


def seal(recs: np.ndarray) -> None:
    """Set each record's own CRC (over its bytes 4..256), in one C call."""
    from .._uring import crc32c_many

    n = len(recs)
    if not n:
        return
    recs = np.ascontiguousarray(recs)
    base = np.uint64(recs.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(RECORD_BYTES) + np.uint64(4)
    out = np.empty(n, np.uint32)
    crc32c_many(base, np.full(n, RECORD_BYTES - 4, np.int64), out)
    recs["rcrc"] = out


def record_crcs(recs: np.ndarray) -> np.ndarray:
    """What each record's ``rcrc`` should be (records contiguous)."""
    from .._uring import crc32c_many

    n = len(recs)
    out = np.empty(n, np.uint32)
    if n:
        base = np.uint64(recs.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(RECORD_BYTES) + np.uint64(4)
        crc32c_many(base, np.full(n, RECORD_BYTES - 4, np.int64), out)
    return out


def make_records(segs, offs, lens, gens, crcs, depths, key_crcs, enc_keys: list[bytes], flags: int) -> np.ndarray:
    """Sealed records (RECORD_DTYPE) for objects; keys over KEY_INLINE bytes keep a prefix (R_KEY_TRUNC)."""
    n = len(enc_keys)
    r = np.zeros(n, RECORD_DTYPE)
    r["magic"] = MAGIC
    r["segment"], r["length"], r["offset"] = segs, lens, offs
    r["generation"], r["crc"], r["depth"], r["key_crc"] = gens, crcs, depths, key_crcs
    klen = np.fromiter(map(len, enc_keys), np.int64, n)
    r["key_len"] = np.minimum(klen, 0xFFFF)
    r["flags"] = flags | np.where(klen > KEY_INLINE, R_KEY_TRUNC, 0)
    if n:  # numpy's fixed-width bytes: cut at KEY_INLINE, zero-padded, in one C pass
        r["key"] = np.array(enc_keys, dtype=f"S{KEY_INLINE}").view(np.uint8).reshape(n, KEY_INLINE)
    seal(r)
    return r


def batch_records(enc_keys: list[bytes], segs, offs, lens, depths, crcs, gen: int, index_dtype, confirmed: bool):
    """A put batch's (LMDB values as ``index_dtype`` records, sealed segment records, their confirmed
    copies or None) in one C pass (native/uring_records.c); the same bytes as make_records and
    confirmed_copy with ``R_VALID``, and index records with FLAG_CRC | FLAG_KEYCRC and group = generation."""
    from .._uring import put_records

    n = len(enc_keys)
    out48 = np.empty(n, index_dtype)
    recs = np.empty(n, RECORD_DTYPE)
    conf = np.empty(n, RECORD_DTYPE) if confirmed else None
    put_records(enc_keys if type(enc_keys) is list else list(enc_keys), np.ascontiguousarray(segs, np.int64),
                np.ascontiguousarray(offs, np.int64), np.ascontiguousarray(lens, np.int64),
                np.ascontiguousarray(depths, np.int32), np.ascontiguousarray(crcs, np.uint32), int(gen),
                out48.view(np.uint8), recs.view(np.uint8), None if conf is None else conf.view(np.uint8))  # fmt: skip
    return out48, recs, conf


def record_values(recs: np.ndarray) -> list[bytes]:
    """Each record's bytes (the index's LMDB values), cut in C rather than by slicing a blob per record."""
    return np.ascontiguousarray(recs).view(np.dtype((np.void, recs.dtype.itemsize))).tolist()


def confirmed_copy(recs: np.ndarray) -> np.ndarray:
    """The records as they read once their data's fdatasync completed (R_CONFIRMED, sealed): made
    while the data is in flight, so confirming costs a copy after the sync."""
    c = np.array(recs, RECORD_DTYPE, copy=True)
    c["flags"] |= R_CONFIRMED
    seal(c)
    return c


def area_of(segment_bytes: int, recs: np.ndarray) -> tuple[np.ndarray, int]:
    """One segment's whole record area holding ``recs`` (all of one size class), and that class."""
    if not len(recs):
        return np.zeros(0, RECORD_DTYPE), 0
    cls = -(-int(recs["length"][0]) // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES
    area = np.zeros(record_slots(segment_bytes, cls), RECORD_DTYPE)
    place(area, slot_index(recs["offset"], recs["length"]), recs, False)
    return area, cls
