"""Cross-process and controller-shaped runs against the real sglang==0.5.23 wheel.

MLA with TP 2: the leader (TP 0, SGLang's storage writer) writes the shared store in this
process; the follower (TP 1) is another process that opens it read-only and must see the
leader's pages while both run, byte for byte, without ever writing them.
"""

from __future__ import annotations

import os

import pytest

from support import sglang_env as E
from support.sglang_follower import Follower

ns = E.require_sglang()


@pytest.mark.timeout(240)
def test_mla_follower_process_reads_what_the_leader_writes_while_running(tmp_path):
    root = str(tmp_path / "l3")
    follower = Follower(root)  # starts before the leader has created the store
    try:
        assert follower.read() == ["started", "0", "True"]
        pool, mamba = E.mla_pool(), E.mamba_pool()
        cfg = E.storage_config(root, tp_rank=0, tp_size=2, is_mla=True)
        leader = E.load_backend(cfg, pool.host, {"mamba": mamba.host})
        assert leader.store_dir == os.path.abspath(root)  # one shared directory for MLA TP ranks
        hashes = E.page_hashes(128, seed=60)
        idx = pool.alloc_pages(128)
        E.fill_random(pool.host, idx[: 64 * E.PAGE_SIZE], 61)
        assert all(leader.batch_set_v1(hashes[:64], idx[: 64 * E.PAGE_SIZE], E.extra_info([])))
        assert follower.send("check 64 61") == ["checked", "64", "64", "True", "[True,", "True]", "0"]
        # New pages written while the follower runs become visible to it.
        E.fill_random(pool.host, idx, 62)
        leader.batch_set_v1(hashes[64:], idx[64 * E.PAGE_SIZE :], E.extra_info(hashes[:64]))
        reply = follower.send("check 128 62")
        assert reply[:3] == ["checked", "128", "128"]
        # pages 0..63 keep the bytes first written (seed 61), so a seed-62 compare must fail there
        assert reply[3] == "False"
        assert follower.send("mamba") == ["mamba", "True", "True", "True"]
        leader.close()
    finally:
        follower.stop()


def test_mla_second_writer_on_the_shared_directory_is_refused(tmp_path):
    from umbp_nvme.errors import StoreLockedError

    root = str(tmp_path / "l3")
    leader = E.load_backend(E.storage_config(root, tp_rank=0, tp_size=2, is_mla=True), E.mla_pool().host)
    other = ns.StorageBackendFactory.create_backend("dynamic", E.storage_config(root, tp_rank=0, tp_size=2, is_mla=True), None)
    with pytest.raises(StoreLockedError, match="locked by pid"):
        other.register_mem_pool_host(E.mla_pool().host)
    other.close()
    leader.close()


def test_controller_flow_with_side_pools_and_trailing_mamba(tmp_path):
    """The hybrid controller's order: v2 hit query, v1 KV load, then side pools with trailing keys."""
    root = str(tmp_path / "l3")
    kv, swa, mamba = E.mha_pool(pages=400), E.swa_pool(pages=400), E.mamba_pool(slots=16)
    backend = E.load_backend(E.storage_config(root), kv.host, {"swa": swa.host, "mamba": mamba.host})
    hashes = E.page_hashes(300, seed=70)
    k_idx, s_idx = kv.alloc_pages(300), swa.alloc_pages(300)
    k_data, s_data = E.fill_random(kv.host, k_idx, 71), E.fill_random(swa.host, s_idx, 72)
    m_idx = mamba.alloc_pages(1)
    m_data = E.fill_random(mamba.host, m_idx, 73)
    # Backup: side pools first (v2), then KV in batches of 128 (v1), as the hybrid controller does.
    res = backend.batch_set_v2(
        [
            ns.PoolTransfer(name=ns.PoolName.SWA, host_indices=s_idx, keys=hashes),
            ns.PoolTransfer(name=ns.PoolName.MAMBA, host_indices=m_idx, keys=[hashes[-1]]),
        ]
    )
    assert ns.count_pool_hits(res) == {ns.PoolName.SWA: 300, ns.PoolName.MAMBA: 1}
    for i in range(0, 300, ns.STORAGE_BATCH_SIZE):
        keys = hashes[i : i + 128]
        assert all(backend.batch_set_v1(keys, k_idx[i * E.PAGE_SIZE : (i + len(keys)) * E.PAGE_SIZE], E.extra_info(hashes[:i])))
    for p, i in ((kv, k_idx), (swa, s_idx), (mamba, m_idx)):
        E.zero_pages(p.host, i)
    # Hit query: all hashes at once with the pool transfers.
    transfers = [
        ns.PoolTransfer(name=ns.PoolName.SWA, keys=hashes[-8:], hit_policy=ns.PoolHitPolicy.TRAILING_PAGES),
        ns.PoolTransfer(name=ns.PoolName.MAMBA, keys=hashes[-1:], hit_policy=ns.PoolHitPolicy.TRAILING_PAGES),
    ]
    hit = backend.batch_exists_v2(hashes, transfers, E.extra_info([]))
    assert hit.kv_hit_pages == 300
    assert dict(hit.extra_pool_hit_pages) == {ns.PoolName.KV: 300, ns.PoolName.SWA: 300, ns.PoolName.MAMBA: 300}
    # KV load in batches of 128, counting leading Trues.
    loaded = 0
    for i in range(0, 300, 128):
        keys = hashes[i : i + 128]
        ok = backend.batch_get_v1(keys, k_idx[i * E.PAGE_SIZE : (i + len(keys)) * E.PAGE_SIZE], E.extra_info(hashes[:i]))
        loaded += next((j for j, v in enumerate(ok) if not v), len(ok))
    assert loaded == 300
    # Side pools: trailing windows ending at the hit.
    got = backend.batch_get_v2(
        [
            ns.PoolTransfer(name=ns.PoolName.SWA, host_indices=s_idx[292 * E.PAGE_SIZE :], keys=hashes[292:300]),
            ns.PoolTransfer(name=ns.PoolName.MAMBA, host_indices=m_idx, keys=hashes[299:300]),
        ]
    )
    assert ns.count_pool_hits(got) == {ns.PoolName.SWA: 8, ns.PoolName.MAMBA: 1}
    assert E.read_pages(kv.host, k_idx) == k_data
    assert E.read_pages(swa.host, s_idx[292 * E.PAGE_SIZE :]) == s_data[292 * 2 :]
    assert E.read_pages(mamba.host, m_idx) == m_data
    backend.close()


def test_sglang_file_backend_and_ours_agree_on_hits(tmp_path):
    """Same pages through SGLang's own `file` backend (legacy flat pages) and ours."""
    pool = E.mha_pool()
    hashes = E.page_hashes(20, seed=80)
    idx = pool.alloc_pages(20)
    E.fill_random(pool.host, idx, 80)
    cfg_file = E.storage_config(str(tmp_path / "file"), interface_v1=False, extra={"file_storage_path": str(tmp_path / "file")})
    hf = ns.StorageBackendFactory.create_backend("file", cfg_file, pool.host)
    ours = E.load_backend(E.storage_config(str(tmp_path / "ours")), pool.host)
    pages = [pool.host.get_data_page(idx[i * E.PAGE_SIZE], flat=True) for i in range(12)]
    assert hf.batch_set(hashes[:12], pages)
    assert all(ours.batch_set_v1(hashes[:12], idx[: 12 * E.PAGE_SIZE]))
    assert hf.batch_exists(hashes) == ours.batch_exists(hashes) == 12
    ours.close()
