"""SyncPageStore: the store on a private loop thread, safe from many threads."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from conftest import KiB, payload, small_config
from support.held_loop import loop_held
from umbp_nvme.errors import StoreLockedError
from umbp_nvme.store.sync import SyncPageStore


def test_sync_calls_from_many_threads(store_dir):
    st = SyncPageStore(store_dir, small_config())
    errors = []

    def worker(w):
        try:
            keys = [f"t{w}-{i}" for i in range(16)]
            data = [payload(k, 8 * KiB + w) for k in keys]
            assert st.put_many(keys, data) == [True] * 16
            assert st.exists_prefix(keys) == 16
            outs = [np.zeros(len(d), np.uint8) for d in data]
            assert st.get_many(keys, outs) == [True] * 16
            assert all(bytes(o) == bytes(d) for o, d in zip(outs, data))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert st.stats()["objects"] == 8 * 16
    st.close()


def test_exists_answer_on_the_calling_thread_while_the_loop_is_busy(store_dir):
    """The exists calls never hop onto the store's loop: they answer while it is held (a hop would
    wait for it). Their speed is the benchmarks' (bench store: exists_us)."""
    st = SyncPageStore(store_dir, small_config())
    keys = [f"{i:064x}_{r}" for i in range(128) for r in ("k",)]
    assert st.put_many(keys, [payload(k, 4096) for k in keys]) == [True] * 128
    with loop_held(st.loop) as freed:
        assert st.exists_prefix(keys) == 128
        assert st.exists_prefix(keys[:5] + ["absent_k"] + keys[5:]) == 5
        assert st.exists_many(keys[:3] + ["absent_k"]) == [True, True, True, False]
        assert not freed.is_set()  # answered while the loop was still held
    st.close()


def test_close_stops_the_loop_thread_and_later_calls_fail_softly(store_dir):
    before = set(threading.enumerate())
    st = SyncPageStore(store_dir, small_config())
    st.put_many(["k"], [payload("k", 4096)])
    (thread,) = [t for t in threading.enumerate() if t not in before and t.name == "umbp-store-loop"]
    st.close()
    st.close()
    assert not thread.is_alive()
    assert st.put_many(["x"], [payload("x", 4096)]) == [False]
    st2 = SyncPageStore(store_dir, small_config())  # lock released
    assert st2.exists_many(["k"]) == [True]
    st2.close()


def test_open_errors_surface_and_leave_no_thread(store_dir):
    st = SyncPageStore(store_dir, small_config())
    before = set(threading.enumerate())
    with pytest.raises(StoreLockedError):
        SyncPageStore(store_dir, small_config())
    new = [t for t in threading.enumerate() if t not in before]
    assert not [t for t in new if t.name == "umbp-store-loop"]  # its loop thread was joined before the raise
    for t in new:  # anything else it started (an executor worker) ends by itself
        t.join(5)
    assert not [t for t in new if t.is_alive()]
    st.close()


def test_readonly_follower_via_sync_wrapper(store_dir):
    st = SyncPageStore(store_dir, small_config())
    ro = SyncPageStore(store_dir, small_config(), readonly=True)
    st.put_many(["a", "b"], [payload("a", 4096), payload("b", 4096)])
    assert ro.exists_prefix(["a", "b", "c"]) == 2
    out = np.zeros(4096, np.uint8)
    assert ro.get_many(["b"], [out]) == [True] and bytes(out) == bytes(payload("b", 4096))
    ro.close()
    st.close()
