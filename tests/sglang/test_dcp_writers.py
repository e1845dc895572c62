"""Decode-context-parallel MLA through the real sglang==0.5.23 wheel (issue 17).

With DCP, sglang makes one MLA writer per DCP shard (`is_storage_writer`: tp_rank == dcp_rank)
and each shard holds different bytes under the same page hash. Every writer must own a store
(two writers on one directory: the second finds it locked), and each TP replica of a shard must
read what that shard's writer wrote, under Mooncake's `h_dcp{shard}_cp{cp}_k` key.
"""

from __future__ import annotations

import os

from support import sglang_env as E

ns = E.require_sglang()
E.skip_unless_config_has(ns.HiCacheStorageConfig, "dcp_size", "decode-context-parallel storage", "0.5.23", module=True)

TP, DCP = 4, 2


def dcp_config(root, tp_rank):
    return E.storage_config(root, tp_rank=tp_rank, tp_size=TP, is_mla=True, dcp_size=DCP, dcp_rank=tp_rank % DCP,
                            logical_page_size=E.PAGE_SIZE)


def test_each_dcp_shard_writer_owns_a_store_and_its_replicas_read_it(root):
    hashes = E.page_hashes(6, seed=11)
    writers = {}
    written = {}
    for tp_rank in range(DCP):  # the writers: tp0 (shard 0) and tp1 (shard 1)
        config = dcp_config(root, tp_rank)
        assert config.is_storage_writer
        pool = E.mla_pool()
        backend = E.load_backend(config, pool.host)
        assert not backend.is_mla_follower
        assert os.path.basename(backend.store_dir) == f"dcp{tp_rank}"
        idx = pool.alloc_pages(6)
        written[tp_rank] = E.fill_random(pool.host, idx, seed=300 + tp_rank)
        assert all(backend.batch_set_v1(hashes, idx))
        assert backend.store.exists_many([hashes[0] + f"_dcp{tp_rank}_cp0_k"]) == [True]
        writers[tp_rank] = backend
    assert written[0] != written[1]
    for tp_rank in range(DCP, TP):  # the replicas: tp2 reads shard 0, tp3 reads shard 1
        shard = tp_rank % DCP
        pool = E.mla_pool()
        backend = E.load_backend(dcp_config(root, tp_rank), pool.host)
        assert backend.is_mla_follower
        assert backend.store_dir == writers[shard].store_dir
        idx = pool.alloc_pages(6)
        assert backend.batch_exists(hashes) == 6
        assert all(backend.batch_get_v1(hashes, idx))
        assert E.read_pages(pool.host, idx) == written[shard]
        backend.close()
    for backend in writers.values():
        backend.close()
