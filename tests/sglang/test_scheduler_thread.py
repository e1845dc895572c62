"""What SGLang's scheduler thread calls on every pass, ``get_stats()`` (docs/sglang.md §2), against
the real sglang==0.5.23 wheel: its answers are right after puts, gets and evictions, each batch
is reported once, it never waits for the store's loop (the per-drive rows come from a snapshot
the loop keeps), and its first call imports nothing."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from support import sglang_env as E

ns = E.require_sglang()

from test_backend_on_real_wheel import get_all, set_all  # noqa: E402

# every page stored (no admission), small drives: 3,000 pages of 8 KiB overflow 2 x 8 MiB
EVICTING = {"admission_policy": "all", "ssd_capacity_bytes": 16 << 20, "ssd_segment_size_bytes": 1 << 20}


def _roots(tmp_path, n) -> str:
    return json.dumps([str(tmp_path / f"nvme{i}" / "l3") for i in range(n)])


def _full_rows(backend) -> list[dict]:
    """The rows stats() builds on the store's loop (every drive's complete stats): the oracle."""
    return backend.store_stats()["store"]["drives"]


def _stored(backend, hashes) -> int:
    """Objects of ``hashes`` the store holds now, asked key by key (not through any counter)."""
    keys = [h + s for h in hashes for s in backend.v1_suffixes]
    return sum(backend.store.exists_many(keys))


def test_stats_are_right_after_puts_gets_and_evictions(tmp_path):
    pool = E.mha_pool(pages=300)
    backend = E.load_backend(E.storage_config(_roots(tmp_path, 2), enable_storage_metrics=True, extra=EVICTING),
                             pool.host)  # fmt: skip
    idx = pool.alloc_pages(128)
    E.fill_random(pool.host, idx, seed=5)
    hashes = E.page_hashes(3000, seed=6)
    acked = 0
    for i in range(0, 3000, 128):
        chunk = hashes[i : i + 128]
        acked += sum(backend.batch_set_v1(chunk, idx[: len(chunk) * E.PAGE_SIZE]))
        if i == 0:  # before any eviction: the rows right after one backup
            got = backend.get_stats()
            assert got.backup_pgs == [128] and len(got.backup_bandwidth) == 1
            assert got.drives == _full_rows(backend)
            assert sum(r["objects"] for r in got.drives) == 256 == _stored(backend, chunk)
    assert acked == 3000
    after_puts = backend.get_stats()
    assert sum(after_puts.backup_pgs) == 3000 - 128 and len(after_puts.backup_pgs) == 23  # each batch once
    full = backend.store_stats()["store"]
    assert full["evictions"] > 0  # the drives overflowed
    assert after_puts.drives == full["drives"]
    assert sum(r["objects"] for r in after_puts.drives) == _stored(backend, hashes) < 6000
    assert all(r["bytes_written"] > 0 and r["state"] == "healthy" for r in after_puts.drives)

    tail = hashes[-100:]  # the newest pages: still stored
    assert get_all(backend, tail, idx[: 100 * E.PAGE_SIZE]) == 100
    after_gets = backend.get_stats()
    assert after_gets.prefetch_pgs == [100] and after_gets.backup_pgs == []
    assert after_gets.drives == _full_rows(backend)
    read = sum(r["bytes_read"] for r in after_gets.drives) - sum(r["bytes_read"] for r in after_puts.drives)
    assert read == 200 * 4096  # 100 pages x (K, V) x 4 KiB, all of it in the rows
    head = hashes[:128]  # the oldest pages: evicted, a prefetch finds none
    assert backend.batch_get_v1(head, idx) == [False] * 128
    assert backend.get_stats().prefetch_pgs == [0]
    backend.close()


def test_a_backup_thread_beside_get_stats_has_each_batch_reported_once(tmp_path):
    pool = E.mha_pool(pages=300)
    backend = E.load_backend(E.storage_config(_roots(tmp_path, 2), enable_storage_metrics=True,
                                              extra={"admission_policy": "all"}), pool.host)  # fmt: skip
    idx = pool.alloc_pages(16)
    E.fill_random(pool.host, idx, seed=7)
    hashes = E.page_hashes(16 * 40, seed=8)
    acked = []

    def backup():
        for i in range(0, len(hashes), 16):
            acked.append(sum(backend.batch_set_v1(hashes[i : i + 16], idx)))

    t = threading.Thread(target=backup)
    t.start()
    seen_pgs, seen_bw = [], 0
    while t.is_alive():
        m = backend.get_stats()
        seen_pgs += m.backup_pgs
        seen_bw += len(m.backup_bandwidth)
    t.join()
    m = backend.get_stats()
    seen_pgs += m.backup_pgs
    seen_bw += len(m.backup_bandwidth)
    assert seen_pgs == acked == [16] * 40 and seen_bw == 40
    backend.close()


@pytest.mark.parametrize("drives", [1, 2, 4])
def test_get_stats_answers_while_the_store_loop_is_blocked(tmp_path, drives):
    """No hop onto the store's loop: with the loop thread stopped dead, get_stats() still returns,
    with every batch and the drives' rows as they were (before: the rows came from a stats() call
    on the loop, given up after 1 s, and were missing)."""
    pool = E.mha_pool(pages=300)
    backend = E.load_backend(E.storage_config(_roots(tmp_path, drives), enable_storage_metrics=True,
                                              extra={"admission_policy": "all"}), pool.host)  # fmt: skip
    idx = pool.alloc_pages(64)
    E.fill_random(pool.host, idx, seed=9)
    hashes = E.page_hashes(64, seed=10)
    assert all(backend.batch_set_v1(hashes, idx))
    rows = _full_rows(backend) if drives > 1 else None
    entered, release = threading.Event(), threading.Event()

    def block():
        entered.set()
        release.wait(60)  # a guard against hanging the run, never reached by a passing test

    backend.store.loop.call_soon_threadsafe(block)
    try:
        assert entered.wait(30)
        got = backend.get_stats()
        assert not release.is_set()  # it answered while the loop was still blocked
    finally:
        release.set()
    assert got.backup_pgs == [64]
    if drives > 1:
        assert got.drives == rows
        assert sum(r["objects"] for r in got.drives) == 128
    else:
        assert not hasattr(got, "drives")
    backend.close()


def test_drive_rows_follow_a_change_made_outside_any_call(tmp_path):
    """A drive the probe re-admits in the background: get_stats() alone (no other call that could
    refresh anything) sees it healthy again."""
    from support.faults import FaultPlan, FaultRule, on_files_under
    from support.waits import until
    from umbp_nvme.sglang.backend import UMBPNvmeStore

    plan = FaultPlan()
    pool = E.mha_pool()
    backend = UMBPNvmeStore(E.storage_config(_roots(tmp_path, 2)), pool.host, engine_factory=plan.engine_factory())
    hashes = E.page_hashes(60, seed=11)
    idx = pool.alloc_pages(60)
    E.fill_random(pool.host, idx, seed=12)
    assert all(backend.batch_set_v1(hashes, idx))
    plan.set_rules([FaultRule("eio", ops=("read",), predicate=on_files_under(backend.store_dirs[1]))])
    backend.batch_get_v1(hashes, idx)
    assert [r["state"] for r in backend.get_stats().drives] == ["healthy", "degraded"]  # right after the call
    plan.clear()
    import asyncio

    assert asyncio.run(until(lambda: backend.get_stats().drives[1]["state"] == "healthy", 30))
    backend.close()


def test_a_followers_rows_count_the_leaders_objects(tmp_path):
    from support.waits import until
    import asyncio

    spec = _roots(tmp_path, 2)
    lpool, fpool = E.mla_pool(), E.mla_pool()
    leader = E.load_backend(E.storage_config(spec, tp_rank=0, tp_size=2, is_mla=True,
                                             extra={"admission_policy": "all"}), lpool.host)  # fmt: skip
    hashes = E.page_hashes(130, seed=13)
    idx = lpool.alloc_pages(130)
    E.fill_random(lpool.host, idx, seed=14)
    assert all(leader.batch_set_v1(hashes[:70], idx[: 70 * E.PAGE_SIZE]))
    follower = E.load_backend(E.storage_config(spec, tp_rank=1, tp_size=2, is_mla=True), fpool.host)
    assert follower.is_mla_follower

    def objects(b):
        return [r["objects"] for r in b.get_stats().drives]

    assert objects(follower) == objects(leader) and sum(objects(leader)) == 70  # counted at open
    assert all(leader.batch_set_v1(hashes[70:], idx[70 * E.PAGE_SIZE :]))
    assert sum(objects(leader)) == 130
    assert asyncio.run(until(lambda: objects(follower) == objects(leader), 30))  # recounted on its loop
    follower.close()
    leader.close()


FIRST_CALL_CHILD = textwrap.dedent(
    """
    import json, sys
    from umbp_nvme.bench import sglang_pools as E
    pool = E.mha_pool()
    backend = E.load_backend(E.storage_config(sys.argv[1], enable_storage_metrics=True), pool.host)
    before = set(sys.modules)
    m = backend.get_stats()
    print(json.dumps({"new": sorted(set(sys.modules) - before), "cls": type(m).__module__}))
    backend.close()
    """
)


def test_the_first_get_stats_imports_nothing(tmp_path):
    """SGLang's StorageMetrics is found when the backend is made (with storage metrics on), not in
    the scheduler's first pass (before: that import cost the first call 65-110 ms)."""
    try:  # 0.5.20's collector imports openai, which a server has and tools/install_sglang.sh's set does not
        importlib.import_module("sglang.srt.observability.metrics_collector")
    except ImportError as e:
        pytest.skip(f"sglang {E.sglang_version()}'s metrics collector does not import in this test install ({e})")
    r = subprocess.run([sys.executable, "-c", FIRST_CALL_CHILD, _roots(tmp_path, 2)], env=E.subprocess_env(),
                       capture_output=True, text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["cls"] == "sglang.srt.observability.metrics_collector"  # SGLang's own class, as it asserts
    assert out["new"] == []
