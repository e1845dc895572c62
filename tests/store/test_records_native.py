"""_uring.records_name: the native check that a segment record names its row's object and the
caller's key (a get's hash hit confirmed, store/row_keys.py)."""

from __future__ import annotations

import numpy as np
import pytest

from umbp_nvme import _uring
from umbp_nvme.store.records import KEY_INLINE, MAGIC, R_VALID, RECORD_DTYPE, make_records


def test_the_c_layout_is_records_dtype():
    f = RECORD_DTYPE.fields
    assert RECORD_DTYPE.itemsize == 256 and KEY_INLINE == 208 and MAGIC == 0x5552 and R_VALID == 1
    assert {k: f[k][1] for k in ("magic", "flags", "segment", "offset", "generation", "key_len", "key")} == {
        "magic": 4, "flags": 6, "segment": 8, "offset": 16, "generation": 24, "key_len": 44, "key": 48}  # fmt: skip


def _recs(keys: list[bytes]):
    n = len(keys)
    segs = np.arange(n, dtype=np.int64) + 3
    offs = np.arange(n, dtype=np.int64) * 65536
    gens = np.arange(n, dtype=np.uint64) + 100
    recs = make_records(segs, offs, np.full(n, 65536), gens, np.zeros(n, np.uint32), np.zeros(n, np.int32),
                        np.zeros(n, np.uint32), keys, R_VALID)  # fmt: skip
    return recs, segs, offs, gens


def _name(recs, keys, segs, offs, gens):
    out = np.full(len(keys), 9, np.uint8)
    und = _uring.records_name(recs, keys, segs, offs, gens, out)
    return und, out.tolist()


def test_each_field_and_each_key_byte_decides():
    stored = [b"page/0", b"page/1", b"x" * KEY_INLINE, b"ab"]
    recs, segs, offs, gens = _recs(stored)
    assert _name(recs, ["page/0", b"page/1", "x" * KEY_INLINE, "ab"], segs, offs, gens) == (0, [1, 1, 1, 1])
    # another key of the same length, a prefix, a longer key, the key with a NUL after it
    assert _name(recs, ["page/9", "page/", "x" * KEY_INLINE + "x", "ab\x00"], segs, offs, gens)[1] == [0, 0, 0, 0]
    for field, bad in (("segment", segs + 1), ("offset", offs + 4096), ("generation", gens + 1)):
        args = {"segment": segs, "offset": offs, "generation": gens, field: bad}
        assert _name(recs, ["page/0", "page/1", "x" * KEY_INLINE, "ab"], args["segment"], args["offset"],
                     args["generation"])[1] == [0, 0, 0, 0], field  # fmt: skip
    r2 = recs.copy()
    r2["magic"][0] = 0
    r2["flags"][1] = 0  # not valid
    r2["key_len"][3] = 3
    assert _name(r2, ["page/0", "page/1", "x" * KEY_INLINE, "ab"], segs, offs, gens)[1] == [0, 0, 1, 0]


def test_keys_that_are_not_plain_are_not_matched_or_left_to_the_caller():
    recs, segs, offs, gens = _recs([b"k\xc3\xa9", b"a", b"b", b"c"])
    # a non-ASCII str: undecided (2); None, an int, an empty key: never a match
    und, out = _name(recs, ["k\u00e9", None, 7, ""], segs, offs, gens)
    assert und == 1 and out == [2, 0, 0, 0]
    assert _name(recs, [b"k\xc3\xa9", None, 7, ""], segs, offs, gens) == (0, [1, 0, 0, 0])  # its bytes match


def test_bad_inputs_are_refused_before_writing():
    recs, segs, offs, gens = _recs([b"a", b"b"])
    out = np.full(2, 9, np.uint8)
    with pytest.raises(TypeError, match="keys must be a list"):
        _uring.records_name(recs, ("a", "b"), segs, offs, gens, out)
    with pytest.raises(ValueError, match="record bytes"):
        _uring.records_name(recs[:1], ["a", "b"], segs, offs, gens, out)  # short records
    with pytest.raises(ValueError, match="record bytes"):
        _uring.records_name(recs, ["a", "b"], segs[:1], offs, gens, out)
    with pytest.raises(ValueError, match="record bytes"):
        _uring.records_name(recs, ["a", "b"], segs, offs, gens, np.zeros(3, np.uint8))
    with pytest.raises(TypeError, match="segs must have format"):
        _uring.records_name(recs, ["a", "b"], segs.astype(np.int32), offs, gens, out)
    with pytest.raises(TypeError, match="writable"):
        _uring.records_name(recs, ["a", "b"], segs, offs, gens, np.frombuffer(bytes(2), np.uint8))
    assert out.tolist() == [9, 9]
    assert _name(recs[:0], [], segs[:0], offs[:0], gens[:0]) == (0, [])
