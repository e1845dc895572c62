"""The batch paths' native steps (issue 36). Get: the key lookup and row gather in one pass
(KeyIndex.take), the destinations resolved and checked in one pass (_uring.pairs_dst), the pins
counted in C (add_at). Put: keys new, distinct and plain in one pass (KeyIndex.fresh), the sources
resolved in one (_uring.pairs_src). Each gives what the Python steps gave, or declines (None /
False / 0) so the checked path explains it; bad arrays raise before anything is written."""

from __future__ import annotations

import numpy as np
import pytest

from umbp_nvme._keyindex import KeyIndex, add_at
from umbp_nvme._uring import pairs_dst, pairs_src
from umbp_nvme.store.keymap import KeyMap
from umbp_nvme.store.memory import FAST_ADDR_MIN, Ranges

COLS = ((np.int32, 3), (np.uint32, 7), (np.uint32, 65536), (np.uint32, 0xFFFFFFF0), (np.uint8, 3), (np.uint64, 2**62))


def _columns(n: int) -> tuple:
    """Row columns as rows.py keeps them (seg, off_4k, len, crc, flags, gen), row r's value distinct per row."""
    return tuple(np.array([base - (r if base > 1000 else 0) + (0 if base > 1000 else r) for r in range(n)], dt)
                 for dt, base in COLS)  # fmt: skip


def _take(m: KeyMap, keys, cols, shift=12):
    return m.take(keys, cols, shift)


def test_take_gathers_each_hits_index_columns_and_row_in_key_order():
    m = KeyMap(seed=5)
    for i, k in enumerate(["a", "b", "c", "\udcc3"]):
        m[k] = 10 + i
    cols = _columns(20)
    got = _take(m, ["c", "zz", "a", 7, "\udcc3", "c"], cols)
    assert got.shape == (8, 4) and got.dtype == np.int64
    rows = [12, 10, 13, 12]
    assert got[0].tolist() == [0, 2, 4, 5]  # the keys that hit, in key order (an int is never a key)
    assert got[7].tolist() == rows
    for j, c in enumerate(cols):
        want = [int(c[r]) << (12 if j == 1 else 0) for r in rows]
        assert got[j + 1].tolist() == want  # uint32 crcs near 2**32 and uint64 generations near 2**62 kept whole
    assert _take(m, ["x", "y"], cols).shape == (8, 0)


def test_take_declines_when_a_hash_has_several_rows():
    m = KeyMap(seed=9)
    m.narrow_hash_for_tests(0)  # every key has one hash
    m["a"], m["b"] = 0, 1
    assert _take(m, ["a"], _columns(2)) is None  # the general path confirms the candidates
    m.forget_row(1)
    assert _take(m, ["a", "b"], _columns(2))[7].tolist() == [0, 0]  # one candidate each: confirmed while reading


def test_take_refuses_bad_columns_and_rows_beyond_them():
    m = KeyMap(seed=1)
    m["a"] = 5
    with pytest.raises(ValueError, match="beyond the columns"):
        _take(m, ["a"], _columns(5))
    with pytest.raises(ValueError, match="6 arrays"):
        _take(m, ["a"], _columns(6)[:5])
    bad = list(_columns(6))
    bad[2] = np.zeros((3, 2), np.uint32)
    with pytest.raises(ValueError, match="1-d integer"):
        _take(m, ["a"], tuple(bad))
    bad[2] = np.zeros(6, np.float32)
    with pytest.raises(ValueError, match="1-d integer"):
        _take(m, ["a"], tuple(bad))
    t = KeyIndex(3)
    with pytest.raises(ValueError, match="8 x 1"):
        t.take(["a"], _columns(6), 12, np.zeros((8, 2), np.int64))
    with pytest.raises(TypeError):
        t.take(("a",), _columns(6), 12, np.zeros((8, 1), np.int64))  # a list only (the get path converts)
    with pytest.raises(ValueError, match="off_shift"):
        t.take(["a"], _columns(6), 40, np.zeros((8, 1), np.int64))
    assert _take(m, ["a"], _columns(6))[7].tolist() == [5]  # every column buffer was released


BASE, SPAN = 1 << 40, 1 << 24


def _dst(bufs, lens, segs=None, *, direct=(True,), align=(4096,), ranges=((BASE, SPAN),)):
    r = Ranges()
    for a, n in ranges:
        r.add(a, n)
    m = len(lens)
    idx = np.arange(m, dtype=np.int64)
    segs = np.zeros(m, np.int64) if segs is None else np.asarray(segs, np.int64)
    out = np.zeros(m, np.uint64)
    starts, ends = np.asarray([a for a, _ in r.ranges], np.int64), np.asarray([e for _, e in r.ranges], np.int64)
    ok = pairs_dst(bufs, idx, np.asarray(lens, np.int64), segs, starts, ends, np.asarray(direct, bool),
                   np.asarray(align, np.int64), FAST_ADDR_MIN, out)  # fmt: skip
    return ok, out


def test_pairs_dst_gives_each_reads_address_when_all_are_registered_big_enough_and_aligned():
    bufs = [(BASE + i * 65536, 65536) for i in range(200)]
    ok, out = _dst(bufs, [65536] * 200)
    assert ok is True and out.tolist() == [b[0] for b in bufs]
    # a buffer larger than its object, an unaligned one on a segment that is not O_DIRECT
    ok, out = _dst([(BASE, 8192), (BASE + 100, 512)], [4096, 512], [0, 1], direct=(True, False), align=(4096, 4096))
    assert ok is True and out.tolist() == [BASE, BASE + 100]


@pytest.mark.parametrize("bufs, lens", [
    ([(BASE, 4096)], [8192]),  # smaller than the object
    ([(BASE + 512, 4096)], [4096]),  # address not aligned for O_DIRECT
    ([(BASE, 4096 + 512)], [4096 + 512]),  # length not aligned for O_DIRECT
    ([(BASE + SPAN - 4096, 8192)], [4096]),  # runs past the registered range
    ([(BASE - 4096, 4096)], [4096]),  # before it
    ([(BASE, 1 << 62)], [4096]),  # a length whose end wraps nothing
    ([(BASE, True)], [1]), ([[BASE, 4096]], [4096]), ([(np.int64(BASE), 4096)], [4096]),
    ([(1024, 4096)], [4096]),  # below FAST_ADDR_MIN: the checked path
])  # fmt: skip
def test_pairs_dst_declines_anything_the_checked_path_must_explain(bufs, lens):
    assert _dst(bufs, lens)[0] is False


def test_pairs_dst_raises_for_bad_arrays_and_indexes_out_of_range():
    with pytest.raises(IndexError, match="out of range"):
        _dst([(BASE, 4096)], [4096], [3])
    with pytest.raises(ValueError, match="one entry per op"):
        pairs_dst([(BASE, 4096)], np.zeros(1, np.int64), np.zeros(2, np.int64), np.zeros(1, np.int64),
                  np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, bool), np.ones(1, np.int64), 4096,
                  np.zeros(1, np.uint64))  # fmt: skip
    with pytest.raises(TypeError, match="direct"):
        pairs_dst([(BASE, 4096)], *(np.zeros(1, np.int64),) * 5, np.ones(1, np.int64), np.ones(1, np.int64), 4096,
                  np.zeros(1, np.uint64))  # fmt: skip


def test_add_at_counts_every_repeat_and_changes_nothing_when_a_row_is_out_of_range():
    c = np.zeros(5, np.int32)
    add_at(c, np.array([1, 3, 1, 1], np.int64), 1)
    assert c.tolist() == [0, 3, 0, 1, 0]
    add_at(c, np.array([1, 3], np.int64), -1)
    assert c.tolist() == [0, 2, 0, 0, 0]
    for rows in ([0, 5], [-1]):
        with pytest.raises(IndexError):
            add_at(c, np.array(rows, np.int64), 1)
    assert c.tolist() == [0, 2, 0, 0, 0]
    with pytest.raises(ValueError):
        add_at(np.zeros(5, np.int64), np.array([0], np.int64), 1)


# --- the put path's one-pass checks (keyindex fresh, _uring.pairs_src) ---


def test_fresh_says_whether_every_key_is_a_new_distinct_short_ascii_str():
    m = KeyMap(seed=4)
    m["old"] = 0
    assert m.fresh([f"k{i}" for i in range(1000)], 8) is True  # more keys than the C side's stack set
    assert m.fresh([], 8) is True
    for bad in (["a", "old"], ["a", "b", "a"], ["a", ""], ["a", "x" * 9], ["a", "é"], ["a", b"b"], ["a", 7],
                ["\udcc3"]):  # fmt: skip
        assert m.fresh(bad, 8) is False, bad
    with pytest.raises(TypeError):
        m.fresh(("a",), 8)


def test_fresh_declines_two_new_keys_with_one_hash():
    m = KeyMap(seed=4)
    m.narrow_hash_for_tests(0)  # every key has one hash: the checked path tells them apart
    assert m.fresh(["a"], 8) is True and m.fresh(["a", "b"], 8) is False


def _src(bufs, max_bytes=1 << 20, align=4096):
    r = Ranges()
    r.add(BASE, SPAN)
    a, n = np.zeros(len(bufs), np.uint64), np.zeros(len(bufs), np.int64)
    starts, ends = np.asarray([s for s, _ in r.ranges], np.int64), np.asarray([e for _, e in r.ranges], np.int64)
    code = pairs_src(bufs, starts, ends, FAST_ADDR_MIN, max_bytes, align, a, n)
    return code, a.tolist(), n.tolist()


def test_pairs_src_gives_addresses_and_lengths_and_says_whether_all_are_aligned():
    bufs = [(BASE + i * 8192, 8192) for i in range(300)]
    assert _src(bufs) == (2, [b[0] for b in bufs], [8192] * 300)
    assert _src([(BASE, 8192), (BASE + 8192, 100)])[0] == 1  # a short last page: staged for O_DIRECT
    assert _src([(BASE + 512, 4096)])[0] == 1


@pytest.mark.parametrize("bufs", [
    [(BASE, (1 << 20) + 1)],  # over max_bytes
    [(BASE + SPAN - 4096, 8192)], [(BASE, 1)], [(BASE, True)], [(1024, 4096)], [[BASE, 4096]], "ab",
])  # fmt: skip
def test_pairs_src_declines_what_the_checked_path_must_explain(bufs):
    assert _src(bufs)[0] == 0


def test_pairs_src_refuses_bad_arrays():
    with pytest.raises(ValueError, match="one entry per buffer"):
        pairs_src([(BASE, 4096)], np.zeros(1, np.int64), np.zeros(1, np.int64), 4096, 1 << 20, 4096,
                  np.zeros(2, np.uint64), np.zeros(1, np.int64))  # fmt: skip
    with pytest.raises(ValueError, match="align"):
        pairs_src([(BASE, 4096)], np.zeros(1, np.int64), np.zeros(1, np.int64), 4096, 1 << 20, 0,
                  np.zeros(1, np.uint64), np.zeros(1, np.int64))  # fmt: skip


def test_scatter_writes_each_columns_values_at_the_rows_and_checks_everything_first():
    from umbp_nvme._keyindex import scatter

    a, b, c = np.zeros(6, np.int32), np.zeros(6, np.uint64), np.zeros(6, bool)
    scatter(np.array([4, 1], np.int64), (a, b, c), (np.array([7, -3], np.int64), 2**62 + 5, 1))
    assert a.tolist() == [0, -3, 0, 0, 7, 0] and b.tolist() == [0, 2**62 + 5, 0, 0, 2**62 + 5, 0]
    assert c.tolist() == [False, True, False, False, True, False]
    for rows, vals in (([6], (1, 1, 1)), ([0], (np.zeros(2, np.int64), 1, 1)), ([0], (1.5, 1, 1))):
        with pytest.raises((IndexError, ValueError, TypeError)):
            scatter(np.array(rows, np.int64), (a, b, c), vals)
    assert a.tolist() == [0, -3, 0, 0, 7, 0]  # nothing written by a refused call
    ro = np.zeros(6, np.int32)
    ro.flags.writeable = False
    with pytest.raises((BufferError, ValueError, TypeError)):
        scatter(np.array([0], np.int64), (ro,), (1,))


def test_a_row_tables_fill_sets_every_column_of_the_published_rows():
    from umbp_nvme.store.rows import RowTable

    t = RowTable([], np.zeros(0), lambda s, o: None)
    rows = t.new(3)
    t.fill(rows, np.array([2, 2, 5]), np.array([0, 8192, 1 << 40]), np.array([10, 20, 30]),
           np.array([1, 2, 0xFFFFFFFF], np.uint32), 3, 77, np.array([0, 1, 2], np.int32))  # fmt: skip
    assert t.seg[rows].tolist() == [2, 2, 5] and t.off[rows].tolist() == [0, 8192, 1 << 40]
    assert t.len[rows].tolist() == [10, 20, 30] and t.crc[rows].tolist() == [1, 2, 0xFFFFFFFF]
    assert t.flags[rows].tolist() == [3] * 3 and t.gen[rows].tolist() == [77] * 3 and t.used(rows).tolist() == [77] * 3
    assert t.depth[rows].tolist() == [0, 1, 2] and t.live[rows].all() and not t.pins[rows].any()
    one = np.ones(1, np.int64)
    with pytest.raises(ValueError, match="multiple of 2"):
        t.fill(rows[:1], one * 9, one * 100, one, one, 3, 78, one)  # an offset not 4 KiB-aligned
    assert t.seg[rows].tolist() == [2, 2, 5] and t.gen[rows].tolist() == [77] * 3  # nothing written
    recs = np.zeros(3, [("crc", np.uint32), ("depth", np.int32)])
    recs["crc"], recs["depth"] = [5, 6, 7], [9, 8, 7]
    t.fill(rows, np.array([1, 1, 1]), np.zeros(3, np.int64), np.ones(3, np.int64), recs["crc"], 3, 79, recs["depth"])
    assert t.crc[rows].tolist() == [5, 6, 7] and t.depth[rows].tolist() == [9, 8, 7]  # strided fields read as they are


def test_set_rows_holds_exactly_the_keys_longer_than_a_record_keeps_from_the_tables_count():
    m = KeyMap(seed=2, held_over=8)  # as rows.py's map: keys over held_over bytes stay in memory
    m.set_rows(["short", "x" * 9, "\u00e9" * 5, "y" * 8], np.arange(4, dtype=np.int64))  # é: 2 bytes a char
    assert m.held(np.arange(4, dtype=np.int64)).tolist() == [False, True, True, False]
    m.set_rows(["a", "b"], np.array([1, 2], np.int64))  # the rows' new keys are short: no longer held
    assert m.held(np.arange(4, dtype=np.int64)).tolist() == [False, False, False, False]
    assert m.candidates(["a", "b", "short", "x" * 9]).tolist() == [1, 2, 0, -1]  # row 1 now holds "a"
