"""DISK event hashes against sglang 0.5.23 on every key format the backend writes (issue 27).

Each case loads the backend through SGLang's factory with SGLang's own host pools, backs pages
up as the cache controller does (with prefix keys), and reads what a ZMQ subscriber gets. The
oracle is the wheel: every announced hash is ``hash_str_to_int64`` of a page whose KV objects
the store really holds (read back from the store's own keys, whatever their rank, MLA or pool
suffixes), every such page is announced once, and the parents chain by the wheel's hashes.
"""

from __future__ import annotations

import pytest

from support import sglang_env as E
from support.kv_sub import Sub, stored, stored_hashes

ns = E.require_sglang()
from sglang.srt.mem_cache.utils import hash_str_to_int64 as wheel_hash  # noqa: E402

from umbp_nvme.sglang.keys import page_of  # noqa: E402

PAGES = 6


def events_on(tmp_path) -> dict:
    return {"kv_events_endpoint": f"ipc://{tmp_path}/ev", "kv_events_replay_endpoint": f"ipc://{tmp_path}/rp"}


def backed_up(backend, pool, hashes, prefix):
    idx = pool.alloc_pages(len(hashes))
    E.fill_random(pool.host, idx, seed=len(prefix) + 1)
    assert backend.batch_set_v1(hashes, idx, E.extra_info(prefix)) == [True] * len(hashes)


def kv_pages_held(backend) -> set[str]:
    """Pages of which the store holds every KV-anchor object, from its own keys."""
    sfx = backend.v1_suffixes
    keys = set(backend.store.store.keys())
    pages = {page_of(k) for k in keys}
    return {p for p in pages if all(p + s in keys for s in sfx)}


def check(backend, sub, hashes, prefix):
    frames = sub.upto_now()
    got = stored_hashes(frames)
    held = kv_pages_held(backend)
    assert held == set(hashes)
    assert got == [wheel_hash(h) for h in hashes]  # each page once, in order
    parents = [e["parent_block_hash"] for e in stored(frames)]
    assert parents[0] == wheel_hash(prefix[-1])
    assert set(parents[1:]) <= {wheel_hash(h) for h in hashes}


CASES = {
    "mha": dict(),
    "mha tp0 of 2": dict(tp_rank=0, tp_size=2),
    "mha pp0 of 2": dict(pp_rank=0, pp_size=2),
    "mla": dict(is_mla=True),
    "mla tp0 of 4": dict(is_mla=True, tp_rank=0, tp_size=4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_announced_hashes_are_the_wheels_hashes_of_the_pages_the_store_holds(tmp_path, case):
    cfg = CASES[case]
    pool = E.mla_pool() if cfg.get("is_mla") else E.mha_pool()
    backend = E.load_backend(E.storage_config(str(tmp_path / "s"), extra=events_on(tmp_path), **cfg), pool.host)
    sub = Sub(f"ipc://{tmp_path}/ev", backend.publisher)
    try:
        sub.sync()
        hashes = E.page_hashes(PAGES + 2, seed=7)
        prefix, pages = hashes[:2], hashes[2:]
        backed_up(backend, pool, pages, prefix)
        check(backend, sub, pages, prefix)
        # the format under test: page key, then this case's rank / PP / MLA suffix
        # (_0_k _0_v; tp: _0_k; pp: _0_0_k; MLA: __k, one object)
        assert {k[64:] for k in backend.store.store.keys()} == set(backend.v1_suffixes)
    finally:
        sub.close()
        backend.close()


def test_the_other_ranks_of_a_tp_group_write_their_own_keys_and_announce_nothing(tmp_path):
    pools = [E.mha_pool(), E.mha_pool()]
    ranks = [E.load_backend(E.storage_config(str(tmp_path / "s"), tp_rank=r, tp_size=2, extra=events_on(tmp_path)),
                            pools[r].host) for r in range(2)]  # fmt: skip
    sub = Sub(f"ipc://{tmp_path}/ev", ranks[0].publisher)
    try:
        sub.sync()
        hashes = E.page_hashes(PAGES, seed=9)
        for r in (1, 0):
            backed_up(ranks[r], pools[r], hashes, [])
        assert ranks[1].publisher is None
        assert kv_pages_held(ranks[1]) == set(hashes) and ranks[1].v1_suffixes != ranks[0].v1_suffixes
        assert stored_hashes(sub.upto_now()) == [wheel_hash(h) for h in hashes]  # rank 0's pages, once
    finally:
        sub.close()
        for b in ranks:
            b.close()


def transfer(name, hashes, idx):
    return ns.PoolTransfer(name=ns.PoolName(name), host_indices=idx, keys=list(hashes), hit_policy=ns.PoolHitPolicy("all_pages"))


def test_side_pool_objects_announce_nothing_and_the_kv_pages_are_the_wheels_hashes(tmp_path):
    kv, swa, mamba = E.mha_pool(), E.swa_pool(), E.mamba_pool()
    backend = E.load_backend(E.storage_config(str(tmp_path / "s"), extra=events_on(tmp_path)), kv.host,
                             {"swa": swa.host, "mamba": mamba.host})  # fmt: skip
    sub = Sub(f"ipc://{tmp_path}/ev", backend.publisher)
    try:
        sub.sync()
        hashes = E.page_hashes(PAGES, seed=11)
        s_idx, m_idx = swa.alloc_pages(PAGES), mamba.alloc_pages(PAGES)
        res = backend.batch_set_v2([transfer("swa", hashes, s_idx), transfer("mamba", hashes, m_idx)])
        assert res["swa"] == res["mamba"] == [True] * PAGES
        assert len(backend.store.store.keys()) > 0 and sub.upto_now() == []  # side pools alone: no page
        backed_up(backend, kv, hashes[:4], [])
        assert stored_hashes(sub.upto_now()) == [wheel_hash(h) for h in hashes[:4]]
    finally:
        sub.close()
        backend.close()
