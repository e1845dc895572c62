"""A writer's row columns (store/rows.py, issue 36): reserved for every slot of the store as
anonymous mappings, so rows cost memory only once written and filling never copies a column;
a put leaves ``tick`` untouched and ``used`` (the LRU order) reads its generation."""

from __future__ import annotations

import numpy as np

from umbp_nvme.store.rows import RowTable


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def _fill(t: RowTable, k: int, gen: int) -> np.ndarray:
    rows = t.new(k)
    t.fill(rows, np.zeros(k, np.int64), np.arange(k, dtype=np.int64) << 12, np.full(k, 4096), np.zeros(k, np.uint32),
           3, gen, np.full(k, -1, np.int32))  # fmt: skip
    return rows


def test_room_for_every_slot_costs_only_the_rows_written_and_is_never_copied():
    slots = 4_000_000  # 168 MB of columns were they written
    before = rss_anon()
    t = RowTable([], np.zeros(0), lambda s, o: None, slots)
    assert rss_anon() - before < 4 << 20  # reserved, not resident
    cols = [t.seg, t.gen, t.tick, t.pins, t.live]
    assert all(len(c) >= slots for c in cols)
    _fill(t, 100_000, 7)  # 100 K rows: ~4.2 MB written
    assert all(a is b for a, b in zip(cols, [t.seg, t.gen, t.tick, t.pins, t.live]))  # no column grew
    grown = rss_anon() - before
    assert grown < 100_000 * 48 + (4 << 20)  # the rows' pages, not the reserve's
    assert not t.tick[:100_000].any() and not t.pins[:100_000].any()  # a put writes neither


def test_used_is_the_put_until_a_hit_or_re_put_stamps_tick_and_a_reused_row_starts_again():
    freed = []
    t = RowTable([], np.zeros(0), lambda s, o: freed.append((s, o)), 4096)
    rows = _fill(t, 4, 10)
    assert t.used(rows).tolist() == [10] * 4
    t.tick[rows[1]] = 15  # a hit
    assert t.used(rows).tolist() == [10, 15, 10, 10]
    t.live[rows[1]] = False
    t.release([int(rows[1])])
    again = _fill(t, 1, 20)  # the freed row, reused by a later put
    assert again.tolist() == [int(rows[1])] and t.used(again).tolist() == [20]
    assert int(t.tick[again[0]]) == 0  # the old key's hit does not follow the row
