"""More UMBPNvmeStore paths against the real sglang==0.5.23 wheel (docs/sglang.md):
split heads (§3, §4), page envelopes (§3), BLOCK_GROUPS (§5) and
restorable_prefix_pages (§5) through batch_exists_v2. Bytes and counts are asserted."""

from __future__ import annotations

import pytest
from support import sglang_env as E

ns = E.require_sglang()
torch = ns.torch

from test_backend_on_real_wheel import hit_pages, transfer

from umbp_nvme.sglang import hits as H
from umbp_nvme.sglang.backend import stores_page_envelope
from umbp_nvme.store.layout import read_manifest


def _bytes(t) -> bytes:
    """Raw bytes of a (contiguous) tensor slice; bf16 has no numpy dtype, so view it as uint8."""
    assert t.is_contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _read_object(store, key: str, nbytes: int) -> bytes | None:
    """One stored object's bytes, read through the store into a scratch tensor in a registered range."""
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    store.register_memory(buf.data_ptr(), nbytes)
    ok = store.get_many([key], [(buf.data_ptr(), nbytes)])
    return _bytes(buf) if ok == [True] else None


class _Spy:
    """Wrap one method of an object, recording (args, result) of every call."""

    def __init__(self, obj, name):
        self.calls = []
        inner = getattr(obj, name)

        def wrapper(*a, **kw):
            out = inner(*a, **kw)
            self.calls.append((a, kw, out))
            return out

        setattr(obj, name, wrapper)


# -- 1. split heads ------------------------------------------------------------------------------

SPLIT_CASES = [
    # (tp_rank, tp_size, tp_lcm_size, heads) -> split ranks tp_rank*sf .. tp_rank*sf+sf-1
    pytest.param(0, 1, 2, 4, id="tp1-lcm2"),
    pytest.param(1, 2, 4, 4, id="tp2r1-lcm4"),
    pytest.param(0, 1, 4, 4, id="tp1-lcm4-one-head-each"),
]


def _split_setup(root, tp_rank, tp_size, lcm, heads, pages, seed):
    pool = E.mha_pool("page_head", heads=heads)
    cfg = E.storage_config(
        root, layout="page_head", tp_rank=tp_rank, tp_size=tp_size, tp_lcm_size=lcm, should_split_heads=True
    )
    assert cfg.should_split_heads is True and cfg.tp_lcm_size == lcm  # plain dataclass fields in 0.5.23
    backend = E.load_backend(cfg, pool.host)
    hashes = E.page_hashes(pages, seed=seed)
    idx = pool.alloc_pages(pages)
    return pool, backend, hashes, idx


@pytest.mark.parametrize("tp_rank,tp_size,lcm,heads", SPLIT_CASES)
def test_split_heads_keys_pointers_and_bytes(root, tp_rank, tp_size, lcm, heads):
    sf = lcm // tp_size
    ranks = list(range(tp_rank * sf, tp_rank * sf + sf))
    pages = 6
    pool, backend, hashes, idx = _split_setup(root, tp_rank, tp_size, lcm, heads, pages, seed=60 + lcm)
    host = pool.host
    try:
        assert backend.scheme.split_factor == sf
        # docs/sglang.md §4: per page, [h_{r}_k, h_{r}_v for r in split ranks], nothing else.
        assert backend.scheme.v1_keys(hashes[:1]) == [f"{hashes[0]}_{r}_{c}" for r in ranks for c in ("k", "v")]

        # Fill through the split-heads meta (it covers the whole page: sf groups x K,V).
        ptrs, sizes = host.get_split_heads_page_buffer_meta(idx, sf)
        assert len(ptrs) == pages * 2 * sf
        E.fill_random(host, idx, seed=61)
        expected_pages = E.read_pages(host, idx)

        put_spy = _Spy(backend.store, "put_many")
        assert backend.batch_set_v1(hashes, idx) == [True] * pages
        (args, _kw, res), = put_spy.calls
        objkeys, bufs = args
        assert objkeys == [f"{h}_{r}_{c}" for h in hashes for r in ranks for c in ("k", "v")]
        # Pointers in exactly host_pool.get_split_heads_page_buffer_meta order, one to one with the keys.
        assert [(int(p), int(s)) for p, s in bufs] == [(int(p), int(s)) for p, s in zip(ptrs, sizes)]
        assert res == [True] * len(objkeys)

        # Each object holds exactly its head group of K (or V) for that page (independent of the meta).
        hpg = heads // sf
        for i in (0, pages - 1):
            page = int(idx[i * E.PAGE_SIZE]) // E.PAGE_SIZE
            for g, r in enumerate(ranks):
                for c, kv in (("k", 0), ("v", 1)):
                    want = _bytes(host.kv_buffer[kv, page, g * hpg : (g + 1) * hpg])
                    assert _read_object(backend.store, f"{hashes[i]}_{r}_{c}", len(want)) == want

        E.zero_pages(host, idx)
        assert E.read_pages(host, idx) != expected_pages
        get_spy = _Spy(backend.store, "get_many")
        assert hit_pages(backend, hashes) == pages
        assert backend.batch_get_v1(hashes, idx) == [True] * pages
        (gargs, _gkw, _gres), = get_spy.calls
        assert gargs[0] == objkeys and [(int(p), int(s)) for p, s in gargs[1]] == [(int(p), int(s)) for p, s in zip(ptrs, sizes)]
        assert E.read_pages(host, idx) == expected_pages
    finally:
        backend.close()


@pytest.mark.parametrize("which", [0, 1, 2, 3], ids=["first-k", "first-v", "second-k", "last-v"])
def test_split_heads_page_counts_only_when_all_2sf_objects_exist(root, which):
    ranks = [0, 1]
    pool, backend, hashes, idx = _split_setup(root, 0, 1, 2, 4, 4, seed=70)
    try:
        E.fill_random(pool.host, idx, seed=71)
        written = E.read_pages(pool.host, idx)
        assert all(backend.batch_set_v1(hashes, idx))
        assert backend.batch_exists(hashes) == 4
        r, c = ranks[which // 2], ("k", "v")[which % 2]
        victim = f"{hashes[1]}_{r}_{c}"
        assert backend.store.delete_many([victim]) == [True]
        assert backend.store.exists_many([victim]) == [False]
        assert backend.batch_exists(hashes) == 1  # page 1 has 2*sf-1 objects: it does not count
        assert backend.batch_exists(hashes[2:]) == 2
        assert not backend.exists(hashes[1]) and backend.exists(hashes[0])
        E.zero_pages(pool.host, idx)
        assert backend.batch_get_v1(hashes, idx) == [True, False, True, True]
        got = E.read_pages(pool.host, idx)
        # Page-wise bytes: pages 0, 2, 3 came back exactly (read_pages is per object, 2 per page).
        per_page = len(got) // 4
        for p in (0, 2, 3):
            assert got[p * per_page : (p + 1) * per_page] == written[p * per_page : (p + 1) * per_page]
    finally:
        backend.close()


def test_split_heads_objects_differ_from_unsplit_keys(root):
    """A split-heads store never answers for plain `{h}_{tp}_k/v` keys, and vice versa."""
    pool, backend, hashes, idx = _split_setup(root, 0, 1, 2, 4, 3, seed=75)
    try:
        E.fill_random(pool.host, idx, seed=76)
        assert all(backend.batch_set_v1(hashes, idx))
        assert backend.store.exists_many([f"{hashes[0]}_0_k", f"{hashes[0]}_0_v", f"{hashes[0]}_1_k"]) == [True, True, True]
        sizes = read_manifest(backend.store_dir)["namespace"]["kv_object_bytes"]  # as recorded on disk
        full = pool.host.get_page_buffer_meta(idx[: E.PAGE_SIZE])[1]
        assert sizes == [int(full[0]) // 2] * 4  # each split object is half a page's K (or V)
    finally:
        backend.close()


# -- 2. page envelope (UnifiedPageEnvelopeHostPool, stores_page_envelope=True) --------------------


def _unified_pool(layout="page_first", heads=E.HEADS):
    unified_mod = pytest.importorskip(
        "sglang.srt.mem_cache.pool_host.unified", reason=f"sglang {E.sglang_version()} has no page-envelope host pools (0.5.21+)"
    )
    UnifiedPageEnvelopeHostPool = unified_mod.UnifiedPageEnvelopeHostPool
    from sglang.srt.mem_cache.unified_memory_pool import (
        MHASubPoolSpec,
        UnifiedKVPool,
        UnifiedMHATokenToKVPool,
    )

    specs = [
        MHASubPoolSpec(name=n, layer_num=E.LAYERS, grow_direction=d, head_num=heads, head_dim=E.HEAD_DIM, store_dtype=torch.bfloat16)
        for n, d in (("full", "up"), ("swa", "down"))
    ]
    total = 2 * 64 * E.PAGE_SIZE * specs[0].entry_bytes()
    unified = UnifiedKVPool(total_bytes=total, sub_pool_specs=specs, device="cpu", enable_memory_saver=False, page_size=E.PAGE_SIZE)
    device = UnifiedMHATokenToKVPool(unified_buffer=unified, sub_pool_name="full", page_size=E.PAGE_SIZE, start_layer=0, end_layer=E.LAYERS - 1)
    host = UnifiedPageEnvelopeHostPool(device, 2.0, 0, E.PAGE_SIZE, layout, pin_memory=False, device="cpu")
    return E.PoolBundle(host, (unified, device))


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("split", [False, True], ids=["plain", "should_split_heads"])
def test_page_envelope_anchor_round_trip(root, layout, split):
    pool = _unified_pool(layout)
    host = pool.host
    # 0.5.22+ says so in stores_page_envelope; 0.5.21's pool of this class does not say
    assert getattr(host, "stores_page_envelope", True) is True and stores_page_envelope(host) is True
    assert host.kv_buffer is not None
    fields = {"tp_lcm_size": 2, "should_split_heads": True} if split else {}
    backend = E.load_backend(E.storage_config(root, layout=layout, **fields), host)
    try:
        pages = 5
        hashes = E.page_hashes(pages, seed=80)
        idx = pool.alloc_pages(pages)
        ptrs, sizes = host.get_page_buffer_meta(idx)
        assert len(ptrs) == pages and all(int(s) == host.item_bytes for s in sizes)
        written = E.fill_random(host, idx, seed=81)
        put_spy = _Spy(backend.store, "put_many")
        assert backend.batch_set_v1(hashes, idx, E.extra_info([])) == [True] * pages
        (args, _kw, _res), = put_spy.calls
        # One object per page under `{h}_{mha_suffix}_kv`; envelopes are never split (the rank's own suffix).
        assert args[0] == [f"{h}_0_kv" for h in hashes]
        assert [(int(p), int(s)) for p, s in args[1]] == [(int(p), int(s)) for p, s in zip(ptrs, sizes)]
        assert backend.store.exists_many([f"{hashes[0]}_0_k", f"{hashes[0]}_0_v", f"{hashes[0]}_1_kv"]) == [False] * 3
        assert _read_object(backend.store, f"{hashes[2]}_0_kv", host.item_bytes) == written[2]
        assert hit_pages(backend, hashes) == pages
        E.zero_pages(host, idx)
        assert E.read_pages(host, idx) != written
        assert backend.batch_get_v1(hashes, idx) == [True] * pages
        assert E.read_pages(host, idx) == written
        # Remove page 3's envelope: the prefix stops at 3 and only that page misses.
        assert backend.store.delete_many([f"{hashes[3]}_0_kv"]) == [True]
        assert backend.batch_exists(hashes) == 3
        E.zero_pages(host, idx)
        assert backend.batch_get_v1(hashes, idx) == [True, True, True, False, True]
        got = E.read_pages(host, idx)
        assert [got[i] == written[i] for i in range(pages)] == [True, True, True, False, True]
    finally:
        backend.close()


# -- 3. BLOCK_GROUPS and 4. restorable_prefix_pages through batch_exists_v2 ----------------------


HAS_BLOCK_GROUPS = hasattr(ns.PoolHitPolicy, "BLOCK_GROUPS")  # SGLang 0.5.22+
needs_block_groups = pytest.mark.skipif(
    not HAS_BLOCK_GROUPS, reason=f"sglang {E.sglang_version()} has no PoolHitPolicy.BLOCK_GROUPS (sglang 0.5.22+)"
)


def _block_transfer(hashes, block_pages, group_pages, name="swa"):
    return ns.PoolTransfer(
        name=ns.PoolName(name),
        keys=list(hashes),
        hit_policy=ns.PoolHitPolicy.BLOCK_GROUPS,
        block_pages=block_pages,
        group_pages=group_pages,
    )


def _store_pages(backend, pool, name, hashes, idx, pages, ps):
    for p in pages:
        res = backend.batch_set_v2([transfer(name, pool, [hashes[p]], idx[p * ps : (p + 1) * ps])])
        assert res[name] == [True]


def _kv_and(backend, kv, n, seed):
    hashes = E.page_hashes(n, seed=seed)
    k_idx = kv.alloc_pages(n)
    E.fill_random(kv.host, k_idx, seed)
    assert all(backend.batch_set_v1(hashes, k_idx))
    return hashes


def _reference(backend, hashes, kv_hit, transfers):
    """hits.v2_hits over the store's real existence answers: the pure reference of docs/sglang.md §5."""
    return H.v2_hits(
        hashes,
        kv_hit,
        transfers,
        backend.store.exists_many,
        lambda page_keys, t: backend.scheme.side_pool_keys(page_keys, t.name, backend.registry.get(t.name)),
        kv_name=ns.PoolName.KV,
    )


@needs_block_groups
def test_block_groups_verdict_never_gates_kv(hybrid):
    backend, kv, swa, _mamba = hybrid
    hashes = _kv_and(backend, kv, 12, seed=90)
    s_idx = swa.alloc_pages(12)
    E.fill_random(swa.host, s_idx, 91)
    # Blocks of 4 pages, key groups of 2 at each block's end: block 0 -> pages 2,3; block 1 -> 6,7;
    # block 2 -> 10,11 (only 10 stored). Pages 0,1,4,5 are missing and must not matter.
    _store_pages(backend, swa, "swa", hashes, s_idx, [2, 3, 6, 7, 10], E.PAGE_SIZE)
    r = backend.batch_exists_v2(hashes, [_block_transfer(hashes, 4, 2)])
    assert isinstance(r, ns.PoolTransferResult)
    assert r.kv_hit_pages == 12  # never gated
    assert r.extra_pool_hit_pages == {ns.PoolName.KV: 12, ns.PoolName.SWA: 8}
    assert r.restorable_prefix_pages == list(range(1, 13))
    ref = _reference(backend, hashes, 12, [_block_transfer(hashes, 4, 2)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == tuple(ref)
    page_ok = [p in (2, 3, 6, 7, 10) for p in range(12)]
    assert H.block_group_pages(page_ok, 4, 2) == 8

    # group_pages=0 means the whole block: page 0 is missing, so nothing is covered and SWA is absent.
    r0 = backend.batch_exists_v2(hashes, [_block_transfer(hashes, 4, 0)])
    assert r0.kv_hit_pages == 12 and r0.extra_pool_hit_pages == {ns.PoolName.KV: 12}
    # Storing page 11 completes block 2's group.
    _store_pages(backend, swa, "swa", hashes, s_idx, [11], E.PAGE_SIZE)
    assert backend.batch_exists_v2(hashes, [_block_transfer(hashes, 4, 2)]).extra_pool_hit_pages[ns.PoolName.SWA] == 12
    # A partial last block covers nothing: blocks of 5 -> block 0 group (3,4) is missing page 4.
    assert backend.batch_exists_v2(hashes, [_block_transfer(hashes, 5, 2)]).extra_pool_hit_pages == {ns.PoolName.KV: 12}
    # Impossible geometry (group > block) gives 0 but still leaves KV alone.
    bad = backend.batch_exists_v2(hashes, [_block_transfer(hashes, 2, 3)])
    assert bad.kv_hit_pages == 12 and ns.PoolName.SWA not in bad.extra_pool_hit_pages


@needs_block_groups
def test_block_groups_judges_the_prefix_left_by_earlier_pools(hybrid):
    backend, kv, swa, mamba = hybrid
    hashes = _kv_and(backend, kv, 12, seed=92)
    s_idx, m_idx = swa.alloc_pages(12), mamba.alloc_pages(12)
    E.fill_random(swa.host, s_idx, 93)
    E.fill_random(mamba.host, m_idx, 94)
    _store_pages(backend, swa, "swa", hashes, s_idx, range(12), E.PAGE_SIZE)  # every SWA page
    _store_pages(backend, mamba, "mamba", hashes, m_idx, range(6), 1)  # Mamba for pages 0..5 only
    transfers = [transfer("mamba", mamba, hashes, None), _block_transfer(hashes, 4, 2)]
    r = backend.batch_exists_v2(hashes, transfers)
    # Mamba (ALL_PAGES) cuts the prefix to 6; BLOCK_GROUPS then sees 6 pages: one whole block of 4.
    assert r.kv_hit_pages == 6
    assert r.extra_pool_hit_pages == {ns.PoolName.KV: 12, ns.PoolName.MAMBA: 6, ns.PoolName.SWA: 4}
    assert r.restorable_prefix_pages == [1, 2, 3, 4, 5, 6]
    assert (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages) == tuple(_reference(backend, hashes, 12, transfers))
    # Order matters: BLOCK_GROUPS first sees all 12 pages.
    r2 = backend.batch_exists_v2(hashes, transfers[::-1])
    assert r2.kv_hit_pages == 6 and r2.extra_pool_hit_pages[ns.PoolName.SWA] == 12


def test_restorable_prefix_pages_with_trailing_window(hybrid):
    backend, kv, swa, mamba = hybrid
    assert "restorable_prefix_pages" in ns.PoolTransferResult.__dataclass_fields__
    hashes = _kv_and(backend, kv, 12, seed=95)
    s_idx, m_idx = swa.alloc_pages(12), mamba.alloc_pages(12)
    E.fill_random(swa.host, s_idx, 96)
    E.fill_random(mamba.host, m_idx, 97)
    present = [2, 3, 6, 7, 8, 11]
    _store_pages(backend, mamba, "mamba", hashes, m_idx, present, 1)
    window2 = transfer("mamba", mamba, hashes[:2], None, "trailing_pages")  # window = len(keys) = 2
    r = backend.batch_exists_v2(hashes, [window2])
    # Windows of 2 ending at p: p=4 (2,3), p=8 (6,7), p=9 (7,8); p=12 has only 11.
    assert r.restorable_prefix_pages == [4, 8, 9]
    assert r.kv_hit_pages == 9 == max(r.restorable_prefix_pages)
    assert r.extra_pool_hit_pages == {ns.PoolName.KV: 12, ns.PoolName.MAMBA: 9}
    assert tuple(_reference(backend, hashes, 12, [window2])) == (r.kv_hit_pages, r.extra_pool_hit_pages, r.restorable_prefix_pages)
    assert H.trailing_stop_points([p in present for p in range(12)], 2) == [4, 8, 9]

    # A window of 1 stops at every page that has a state.
    window1 = transfer("mamba", mamba, hashes[:1], None, "trailing_pages")
    r1 = backend.batch_exists_v2(hashes, [window1])
    assert r1.restorable_prefix_pages == [p + 1 for p in present] and r1.kv_hit_pages == 12

    # SWA (ALL_PAGES) for 7 pages first: Mamba is judged over 7 pages, only p=4 survives.
    _store_pages(backend, swa, "swa", hashes, s_idx, range(7), E.PAGE_SIZE)
    both = [transfer("swa", swa, hashes, None), window2]
    rb = backend.batch_exists_v2(hashes, both)
    assert rb.kv_hit_pages == 4 and rb.restorable_prefix_pages == [4]
    assert rb.extra_pool_hit_pages == {ns.PoolName.KV: 12, ns.PoolName.SWA: 7, ns.PoolName.MAMBA: 4}
    assert tuple(_reference(backend, hashes, 12, both)) == (rb.kv_hit_pages, rb.extra_pool_hit_pages, rb.restorable_prefix_pages)

    if not HAS_BLOCK_GROUPS:  # before 0.5.22 the rest cannot be asked (the skips above say so)
        return
    # A BLOCK_GROUPS pool never narrows the restorable set.
    with_bg = [window2, _block_transfer(hashes, 4, 2)]
    rg = backend.batch_exists_v2(hashes, with_bg)
    assert rg.restorable_prefix_pages == [4, 8, 9] and rg.kv_hit_pages == 9
    assert tuple(_reference(backend, hashes, 12, with_bg)) == (rg.kv_hit_pages, rg.extra_pool_hit_pages, rg.restorable_prefix_pages)

    # No trailing state at all: nothing is restorable and the KV entry stays in the dict.
    none = backend.batch_exists_v2(hashes[:2], [window2])
    assert none.kv_hit_pages == 0 and none.restorable_prefix_pages == [] and none.extra_pool_hit_pages == {ns.PoolName.KV: 2}
