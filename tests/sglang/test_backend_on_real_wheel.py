"""UMBPNvmeStore against the real sglang==0.5.23 wheel: loaded by SGLang's factory, driven with
SGLang's own host pools and page hashes, asserting bytes and counts (docs/sglang.md)."""

from __future__ import annotations

import os
import threading

import pytest

from support import sglang_env as E
from support.held_loop import loop_held

ns = E.require_sglang()
torch = ns.torch

from umbp_nvme.errors import NamespaceMismatchError  # noqa: E402
from umbp_nvme.sglang.backend import UMBPNvmeStore  # noqa: E402

LAYOUTS = ["page_first", "page_first_direct", "page_head"]


def set_all(backend, hashes, idx, page_size=E.PAGE_SIZE, start=0):
    """Back up pages in chunks of 128 as the controller does; returns pages written."""
    done = 0
    for i in range(0, len(hashes), 128):
        keys = hashes[i : i + 128]
        ok = backend.batch_set_v1(keys, idx[i * page_size : (i + len(keys)) * page_size], E.extra_info(hashes[:i]))
        assert isinstance(ok, list) and len(ok) == len(keys)
        if not all(ok):
            break
        done += len(keys)
    return done


def get_all(backend, hashes, idx, page_size=E.PAGE_SIZE):
    """Prefetch pages in chunks of 128; returns the count of leading pages loaded."""
    done = 0
    for i in range(0, len(hashes), 128):
        keys = hashes[i : i + 128]
        ok = backend.batch_get_v1(keys, idx[i * page_size : (i + len(keys)) * page_size], E.extra_info(hashes[:i]))
        assert isinstance(ok, list) and len(ok) == len(keys)
        lead = next((j for j, v in enumerate(ok) if not v), len(ok))
        done += lead
        if lead < len(keys):
            break
    return done


def hit_pages(backend, hashes):
    """The controller's hit query: batch_exists per 128-page chunk, stop at the first short one."""
    hit = 0
    for i in range(0, len(hashes), 128):
        chunk = hashes[i : i + 128]
        n = backend.batch_exists(chunk, E.extra_info(hashes[:i]))
        hit += n
        if n < len(chunk):
            break
    return hit


def loaded(root, pages, seed, *, fill_seed=None, layout="page_first", **cfg):
    """An MHA host pool, a backend on it, and `pages` pages of random bytes (fill_seed, default
    seed) with their hashes (seed): returns (pool, backend, hashes, idx, written)."""
    pool = E.mha_pool(layout)
    backend = E.load_backend(E.storage_config(root, layout=layout, **cfg), pool.host)
    hashes = E.page_hashes(pages, seed=seed)
    idx = pool.alloc_pages(pages)
    written = E.fill_random(pool.host, idx, seed=seed if fill_seed is None else fill_seed)
    return pool, backend, hashes, idx, written


# -- loading ----------------------------------------------------------------------------------


def test_factory_builds_it_from_the_dynamic_config_without_touching_disk(root):
    pool = E.mha_pool()
    cfg = E.storage_config(root)
    backend = ns.StorageBackendFactory.create_backend("dynamic", cfg, pool.host)
    try:
        assert isinstance(backend, UMBPNvmeStore) and isinstance(backend, ns.HiCacheStorage)
        assert backend.mem_pool_host is None  # the loader passed {} as the second argument
        assert not os.path.exists(root)
        backend.register_mem_pool_host(pool.host)
        assert os.path.isdir(root)
    finally:
        backend.close()


def test_layer_first_layout_is_refused(root):
    pool = E.mha_pool("layer_first")
    backend = ns.StorageBackendFactory.create_backend("dynamic", E.storage_config(root, layout="layer_first"), pool.host)
    with pytest.raises(ValueError, match="UMBP store only supports page_first, page_first_direct, or page_head layout"):
        backend.register_mem_pool_host(pool.host)
    backend.close()


# -- v1 data path ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mha_pages_round_trip_byte_exact(root, layout):
    pool, backend, hashes, idx, written = loaded(root, 200, seed=0, fill_seed=1, layout=layout)
    assert set_all(backend, hashes, idx) == 200
    E.zero_pages(pool.host, idx)
    assert hit_pages(backend, hashes) == 200
    assert get_all(backend, hashes, idx) == 200
    assert E.read_pages(pool.host, idx) == written
    backend.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_mla_pages_round_trip_byte_exact(root, layout):
    pool = E.mla_pool(layout)
    backend = E.load_backend(E.storage_config(root, layout=layout, is_mla=True), pool.host)
    hashes = E.page_hashes(130, seed=3)
    idx = pool.alloc_pages(130)
    written = E.fill_random(pool.host, idx, seed=2)
    assert set_all(backend, hashes, idx) == 130
    assert backend.exists(hashes[0]) and backend.store.exists_many([hashes[0] + "__k"]) == [True]  # UMBP's h__k
    E.zero_pages(pool.host, idx)
    assert get_all(backend, hashes, idx) == 130
    assert E.read_pages(pool.host, idx) == written
    backend.close()


def test_re_set_keeps_the_first_bytes(root):
    pool, backend, hashes, idx, first = loaded(root, 8, seed=0, fill_seed=10)
    assert all(backend.batch_set_v1(hashes, idx))
    E.fill_random(pool.host, idx, seed=11)
    assert all(backend.batch_set_v1(hashes, idx))  # a re-put is a successful no-op
    E.zero_pages(pool.host, idx)
    assert all(backend.batch_get_v1(hashes, idx))
    assert E.read_pages(pool.host, idx) == first
    backend.close()


def test_partial_prefixes_count_whole_pages_from_the_start(root):
    pool, backend, hashes, idx, _ = loaded(root, 20, seed=4)
    assert all(backend.batch_set_v1(hashes[:10], idx[: 10 * E.PAGE_SIZE]))
    assert backend.batch_exists(hashes) == 10
    # Only K of page 10: a page needs all of its objects (docs/sglang.md §5: 21 // 2 == 10).
    k_ptr, k_size = E.page_objects(pool.host, idx[10 * E.PAGE_SIZE : 11 * E.PAGE_SIZE])[0]
    assert backend.store.put_many([hashes[10] + "_0_k"], [(k_ptr, k_size)]) == [True]
    assert backend.batch_exists(hashes) == 10
    assert backend.batch_exists(hashes[1:]) == 9  # chained keys: a later start still counts leading pages
    res = backend.batch_get_v1(hashes[8:14], idx[8 * E.PAGE_SIZE : 14 * E.PAGE_SIZE])
    assert res == [True, True, False, False, False, False]
    backend.close()


def test_batch_v1_never_raises_and_never_returns_none(root):
    pool = E.mha_pool()
    backend = E.load_backend(E.storage_config(root), pool.host)
    hashes = E.page_hashes(4)
    idx = pool.alloc_pages(4)
    assert backend.batch_set_v1(hashes, idx[: 3 * E.PAGE_SIZE]) == [False] * 4  # index count mismatch
    assert backend.batch_get_v1(hashes, None) == [False] * 4
    assert backend.batch_get_v1([], idx[:0]) == []
    backend.close()
    assert backend.batch_set_v1(hashes, idx) == [False] * 4  # closed
    assert backend.batch_get_v1(hashes, idx) == [False] * 4
    assert backend.batch_exists(hashes) == 0
    backend.close()  # idempotent


def test_pages_persist_across_close_and_reopen(root):
    pool = E.mha_pool()
    hashes = E.page_hashes(40, seed=5)
    idx = pool.alloc_pages(40)
    written = E.fill_random(pool.host, idx, seed=5)
    backend = E.load_backend(E.storage_config(root), pool.host)
    assert set_all(backend, hashes, idx) == 40
    backend.close()
    E.zero_pages(pool.host, idx)
    again = E.load_backend(E.storage_config(root), pool.host)
    assert hit_pages(again, hashes) == 40
    assert get_all(again, hashes, idx) == 40
    assert E.read_pages(pool.host, idx) == written
    again.close()


def test_a_store_made_for_another_layout_is_refused(root):
    first = E.load_backend(E.storage_config(root), E.mha_pool("page_first").host)
    first.close()
    other = ns.StorageBackendFactory.create_backend("dynamic", E.storage_config(root, layout="page_head"), None)
    with pytest.raises(NamespaceMismatchError, match="layout"):
        other.register_mem_pool_host(E.mha_pool("page_head").host)
    other.close()


def test_tp2_ranks_use_their_own_directories_and_suffixes(root):
    pools = [E.mha_pool() for _ in range(2)]
    backends = [E.load_backend(E.storage_config(root, tp_rank=r, tp_size=2), pools[r].host) for r in range(2)]
    assert [os.path.basename(b.store_dir) for b in backends] == ["tp0", "tp1"]
    hashes = E.page_hashes(12, seed=6)
    data = []
    for r, (b, p) in enumerate(zip(backends, pools)):
        idx = p.alloc_pages(12)
        data.append((idx, E.fill_random(p.host, idx, seed=100 + r)))
        assert all(b.batch_set_v1(hashes, idx))
        assert b.store.exists_many([hashes[0] + f"_{r}_k", hashes[0] + f"_{r}_v"]) == [True, True]
    for (idx, written), b, p in zip(data, backends, pools):
        E.zero_pages(p.host, idx)
        assert all(b.batch_get_v1(hashes, idx))
        assert E.read_pages(p.host, idx) == written
        b.close()


def test_pp2_stages_use_their_own_directories_and_suffixes(root):
    pools = [E.mha_pool() for _ in range(2)]
    backends = [E.load_backend(E.storage_config(root, pp_rank=s, pp_size=2), pools[s].host) for s in range(2)]
    assert [os.path.basename(b.store_dir) for b in backends] == ["pp0", "pp1"]
    hashes = E.page_hashes(6, seed=7)
    for s, (b, p) in enumerate(zip(backends, pools)):
        idx = p.alloc_pages(6)
        written = E.fill_random(p.host, idx, seed=200 + s)
        assert all(b.batch_set_v1(hashes, idx))
        assert b.store.exists_many([hashes[0] + f"_0_{s}_k"]) == [True]
        E.zero_pages(p.host, idx)
        assert all(b.batch_get_v1(hashes, idx))
        assert E.read_pages(p.host, idx) == written
        b.close()


def test_legacy_flat_pages_round_trip_and_never_collide_with_v1_keys(root):
    pool = E.mha_pool()
    backend = E.load_backend(E.storage_config(root, interface_v1=False), pool.host)
    hashes = E.page_hashes(5, seed=8)
    idx = pool.alloc_pages(5)
    E.fill_random(pool.host, idx, seed=8)
    pages = [pool.host.get_data_page(idx[i * E.PAGE_SIZE], flat=True).clone() for i in range(5)]
    assert backend.batch_set(hashes, pages) is True
    assert backend.batch_set([], []) is False
    assert backend.batch_exists(hashes) == 5 and backend.exists(hashes[0])
    out = backend.batch_get(hashes + ["0" * 64], [pool.host.get_dummy_flat_data_page() for _ in range(6)])
    assert out[5] is None
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out[:5], pages))  # bytes: random bf16 has NaNs
    assert backend.get(hashes[0], pool.host.get_dummy_flat_data_page()) is not None
    assert backend.store.exists_many([hashes[0] + "_0_k"]) == [False]  # flat keys are not v1 keys
    backend.close()
    v1 = E.load_backend(E.storage_config(str(root) + "-v1"), pool.host)
    assert v1.batch_exists(hashes) == 0
    v1.close()


def test_batch_exists_answers_on_the_calling_thread_while_the_loop_is_busy(root):
    """SGLang's prefetch thread asks batch_exists on every request: it never hops onto the store's
    loop (it answers while that loop is held). Its cost per call is bench hicache's (exists_us)."""
    _pool, backend, hashes, idx, _ = loaded(root, 128, seed=9)
    assert all(backend.batch_set_v1(hashes, idx))
    with loop_held(backend.store.loop) as freed:
        assert backend.batch_exists(hashes) == 128
        assert backend.batch_exists(hashes[:7] + E.page_hashes(1, seed=99) + hashes[7:]) == 7
        assert not freed.is_set()  # answered while the loop was still held
    backend.close()


def test_get_stats_reports_pages_and_bandwidth_then_clears(root):
    _pool, backend, hashes, idx, _ = loaded(root, 10, seed=12, enable_storage_metrics=True)
    backend.batch_set_v1(hashes, idx)
    backend.batch_get_v1(hashes, idx)
    stats = backend.get_stats()
    assert stats.backup_pgs == [10] and stats.prefetch_pgs == [10]
    assert stats.backup_bandwidth[0] > 0 and stats.prefetch_bandwidth[0] > 0
    again = backend.get_stats()
    assert again.backup_pgs == [] and again.prefetch_pgs == []
    backend.close()


def test_three_controller_threads_at_once_are_byte_exact(root):
    """Prefetch (batch_exists), IO (batch_get_v1) and backup (batch_set_v1) threads together."""
    pool = E.mha_pool(pages=600)
    backend = E.load_backend(E.storage_config(root), pool.host)
    seqs = [E.page_hashes(64, seed=50 + s) for s in range(6)]
    idxs = [pool.alloc_pages(64) for _ in range(6)]
    data = [E.fill_random(pool.host, idxs[s], seed=50 + s) for s in range(6)]
    for s in range(3):  # already stored before the threads start: read while others write
        assert all(backend.batch_set_v1(seqs[s], idxs[s]))
    errors = []
    read_back = {}

    def backup():
        for s in range(3, 6):
            for i in range(0, 64, 16):
                if not all(backend.batch_set_v1(seqs[s][i : i + 16], idxs[s][i * E.PAGE_SIZE : (i + 16) * E.PAGE_SIZE])):
                    errors.append(("set", s, i))

    def prefetch():
        for _ in range(50):
            for s in range(3):
                if backend.batch_exists(seqs[s]) != 64:
                    errors.append(("exists", s))

    def io():
        for s in range(3):
            E.zero_pages(pool.host, idxs[s])
            if not all(backend.batch_get_v1(seqs[s], idxs[s])):
                errors.append(("get", s))
            read_back[s] = E.read_pages(pool.host, idxs[s])

    threads = [threading.Thread(target=f) for f in (backup, prefetch, io)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for s in range(3):
        assert read_back[s] == data[s]
    for s in range(3, 6):
        E.zero_pages(pool.host, idxs[s])
        assert all(backend.batch_get_v1(seqs[s], idxs[s]))
        assert E.read_pages(pool.host, idxs[s]) == data[s]
    backend.close()


# -- v2 side pools -------------------------------------------------------------------------------


def transfer(name, pool, hashes, idx, policy="all_pages"):
    return ns.PoolTransfer(name=ns.PoolName(name), host_indices=idx, keys=list(hashes), hit_policy=ns.PoolHitPolicy(policy))


def test_side_pools_round_trip_byte_exact_in_one_call(hybrid):
    backend, kv, swa, mamba = hybrid
    hashes = E.page_hashes(10, seed=20)
    s_idx, m_idx = swa.alloc_pages(10), mamba.alloc_pages(10)
    s_data, m_data = E.fill_random(swa.host, s_idx, 21), E.fill_random(mamba.host, m_idx, 22)
    res = backend.batch_set_v2([transfer("swa", swa, hashes, s_idx), transfer("mamba", mamba, hashes, m_idx)])
    assert res == {ns.PoolName.SWA: [True] * 10, ns.PoolName.MAMBA: [True] * 10}
    assert res["swa"] == [True] * 10  # str-enum keys read with plain strings
    assert backend.store.exists_many([f"{E.MODEL.replace('/', '-')}_{hashes[0]}_0_swa_k"]) == [True]
    E.zero_pages(swa.host, s_idx)
    E.zero_pages(mamba.host, m_idx)
    got = backend.batch_get_v2([transfer("swa", swa, hashes, s_idx), transfer("mamba", mamba, hashes, m_idx)])
    assert ns.count_pool_hits(got) == {ns.PoolName.SWA: 10, ns.PoolName.MAMBA: 10}
    assert E.read_pages(swa.host, s_idx) == s_data and E.read_pages(mamba.host, m_idx) == m_data


def test_exists_v2_all_pages_and_trailing_pages(hybrid):
    backend, kv, swa, mamba = hybrid
    hashes = E.page_hashes(12, seed=30)
    k_idx, s_idx, m_idx = kv.alloc_pages(12), swa.alloc_pages(12), mamba.alloc_pages(12)
    for p, i in ((kv, k_idx), (swa, s_idx), (mamba, m_idx)):
        E.fill_random(p.host, i, 31)
    assert all(backend.batch_set_v1(hashes, k_idx))
    # SWA for the first 9 pages only; Mamba state only for pages 5 and 8 (trailing windows of 1).
    assert all(backend.batch_set_v2([transfer("swa", swa, hashes[:9], s_idx[: 9 * E.PAGE_SIZE])])["swa"])
    for p in (4, 7):
        assert backend.batch_set_v2([transfer("mamba", mamba, [hashes[p]], m_idx[p : p + 1])])["mamba"] == [True]
    r = backend.batch_exists_v2(hashes, [transfer("swa", swa, hashes, None), transfer("mamba", mamba, [hashes[0]], None, "trailing_pages")])
    assert isinstance(r, ns.PoolTransferResult)
    assert r.kv_hit_pages == 8
    assert r.extra_pool_hit_pages == {ns.PoolName.KV: 12, ns.PoolName.SWA: 9, ns.PoolName.MAMBA: 8}
    assert r.restorable_prefix_pages == [5, 8]
    only_kv = backend.batch_exists_v2(hashes, [])
    assert only_kv.kv_hit_pages == 12


def test_unregistered_pool_raises_umbp_error_in_exists_get_and_set(hybrid):
    backend, kv, swa, mamba = hybrid
    hashes = E.page_hashes(2, seed=40)
    idx = kv.alloc_pages(2)
    assert all(backend.batch_set_v1(hashes, idx))  # with no KV hit, exists_v2 never reaches the pools
    for call in (
        lambda: backend.batch_exists_v2(hashes, [transfer("indexer", kv, hashes, idx)]),
        lambda: backend.batch_get_v2([transfer("indexer", kv, hashes, idx)]),
        lambda: backend.batch_set_v2([transfer("indexer", kv, hashes, idx)]),
    ):
        with pytest.raises(ValueError, match=r"^Unregistered UMBP hybrid pool: indexer\b"):
            call()
    with pytest.raises(ValueError, match=r"^Unregistered UMBP hybrid pool: kv\b"):
        backend.batch_get_v2([transfer("kv", kv, hashes, idx)])  # KV is never a side pool


def test_v2_index_count_mismatch_raises_and_missing_keys_are_false(hybrid):
    backend, kv, swa, mamba = hybrid
    hashes = E.page_hashes(3, seed=41)
    s_idx = swa.alloc_pages(3)
    with pytest.raises(ValueError, match="UMBP v2 pool swa has 3 keys for 32 indices with page_size=16"):
        backend.batch_set_v2([transfer("swa", swa, hashes, s_idx[: 2 * E.PAGE_SIZE])])
    assert backend.batch_get_v2([transfer("swa", swa, hashes, None)]) == {ns.PoolName.SWA: [False] * 3}
    assert backend.batch_get_v2([transfer("swa", swa, hashes, s_idx)]) == {ns.PoolName.SWA: [False] * 3}
