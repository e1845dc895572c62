"""Key checksums: a record carries its key's CRC32C, so a key renamed on disk is never served as its own."""

from __future__ import annotations

import numpy as np


def key_crcs(keys: list[bytes]) -> np.ndarray:
    """CRC32C of each key's bytes (uint32), in one C call (each key read in place)."""
    from .._uring import crc32c_each, crc32c_many

    n = len(keys)
    out = np.zeros(n, np.uint32)
    if not n:
        return out
    if type(keys) is list:
        try:  # crc32c_each checks every key before it writes a CRC
            crc32c_each(keys, out)
            return out
        except TypeError:  # a key that is not bytes (bytearray, memoryview): the joined path below
            pass
    lens = np.fromiter(map(len, keys), np.int64, n)
    buf = np.frombuffer(b"".join(keys) or b"\0", np.uint8)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.uint64)
    crc32c_many(np.uint64(buf.ctypes.data) + starts, lens, out)
    return out
