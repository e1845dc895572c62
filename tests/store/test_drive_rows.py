"""The per-drive stats rows read without the loop (SyncPageStore.drive_rows, for SGLang's scheduler
thread): the same rows stats() builds on the loop after every kind of call, copies, answered while
the loop is blocked; and PageStore.stats_nowait, which they are built from, agreeing with stats()."""

from __future__ import annotations

import copy
import json
import pickle
import threading

import numpy as np
import pytest

from conftest import KiB, payload, small_config
from support.drive_pages import drive_roots as _roots, page_keys as _keys
from umbp_nvme.store import PageStore
from umbp_nvme.store.sync import SyncPageStore

OBJ = 64 * KiB


ROW_FIELDS = ("objects", "bytes_used", "capacity_bytes", "bytes_read", "bytes_written", "errors", "path")


def test_rows_equal_the_loops_rows_after_every_kind_of_call(tmp_path):
    st = SyncPageStore(_roots(tmp_path, 3), small_config(admission_policy="all"))
    try:
        assert len(st.drive_rows()) == 3 and all(r["objects"] == 0 for r in st.drive_rows())
        keys = _keys(200)  # 25 MiB through 3 x 5 MiB drives: evictions
        for lo in range(0, len(keys), 50):
            ks = keys[lo : lo + 50]
            assert st.put_many(ks, [payload(k, OBJ) for k in ks]) == [True] * len(ks)
            assert st.drive_rows() == st.stats()["drives"]
        stored = [k for k in keys if st.exists_many([k])[0]]
        assert st.stats()["evictions"] > 0 and 0 < len(stored) < len(keys)
        assert sum(r["objects"] for r in st.drive_rows()) == len(stored)
        outs = [np.zeros(OBJ, np.uint8) for _ in stored[:20]]
        assert st.get_many(stored[:20], outs) == [True] * 20
        assert all(np.array_equal(o, payload(k, OBJ)) for k, o in zip(stored[:20], outs))
        rows = st.drive_rows()
        assert sum(r["bytes_read"] for r in rows) == 20 * OBJ
        assert rows == st.stats()["drives"]
        assert st.delete_many(stored[:10]) == [True] * 10
        assert sum(r["objects"] for r in st.drive_rows()) == len(stored) - 10
        assert st.flush()
        st.clear()
        assert [r["objects"] for r in st.drive_rows()] == [0, 0, 0]
        assert st.drive_rows() == st.stats()["drives"]
    finally:
        st.close()


def test_rows_are_shared_read_only_and_serialise_as_plain_dicts(tmp_path):
    with SyncPageStore(_roots(tmp_path, 2), small_config()) as st:
        ks = _keys(4)
        assert all(st.put_many(ks, [payload(k, OBJ) for k in ks]))
        rows = st.drive_rows()
        for change in (lambda r: r.__setitem__("objects", -7), lambda r: r.update(objects=-7),
                       lambda r: r.pop("objects"), lambda r: r.clear(), lambda r: r.setdefault("x", 1),
                       lambda r: r.__delitem__("objects"), lambda r: r.popitem()):  # fmt: skip
            with pytest.raises(TypeError, match="read-only snapshot"):
                change(rows[0])
        rows.append({})  # the list is the caller's own
        mine = dict(rows[0])
        mine["objects"] = -7  # a copy is an ordinary dict
        assert st.drive_rows() == st.stats()["drives"] and len(st.drive_rows()) == 2
        assert json.loads(json.dumps(st.drive_rows())) == st.stats()["drives"]
        assert pickle.loads(pickle.dumps(rows[0])) == rows[0] and copy.deepcopy(rows[0]) == rows[0]


def test_one_drive_has_no_rows(store_dir):
    with SyncPageStore(store_dir, small_config()) as st:
        assert st.drive_rows() == []


def test_rows_answer_while_the_loop_is_blocked(tmp_path):
    st = SyncPageStore(_roots(tmp_path, 2), small_config())
    ks = _keys(8)
    assert all(st.put_many(ks, [payload(k, OBJ) for k in ks]))
    want = st.stats()["drives"]
    entered, release = threading.Event(), threading.Event()

    def block():
        entered.set()
        release.wait(60)  # a guard against hanging the run, never reached by a passing test

    st.loop.call_soon_threadsafe(block)
    try:
        assert entered.wait(30)
        got = st.drive_rows()
        assert not release.is_set()  # answered while the loop was still blocked
    finally:
        release.set()
    assert got == want and sum(r["objects"] for r in got) == 16
    st.close()


@pytest.mark.asyncio
async def test_stats_nowait_agrees_with_stats_on_a_writer_and_a_reader(store_dir):
    w = await PageStore.open(store_dir, small_config(admission_policy="all"))
    ks = _keys(30)
    assert all(await w.put_many(ks, [payload(k, OBJ) for k in ks]))
    assert await w.delete_many(ks[:4]) == [True] * 4
    full, quick = w.stats(), w.stats_nowait()
    assert {k: quick[k] for k in ROW_FIELDS if k != "errors"} == {k: full[k] for k in ROW_FIELDS if k != "errors"}
    assert quick["objects"] == 56 and quick["deletes"] == 4
    r = await PageStore.open(store_dir, small_config(), readonly=True)
    assert r.stats_nowait()["objects"] == 56 == r.stats()["objects"]  # counted by its open
    assert all(await w.put_many(_keys(3, "q"), [payload(k, OBJ) for k in _keys(3, "q")]))
    assert r.stats_nowait()["objects"] == 56  # counting reads the index: only object_count() does
    assert r.stats()["objects"] == 62 and r.stats_nowait()["objects"] == 62  # the count stats() got
    await r.close()
    await w.close()
