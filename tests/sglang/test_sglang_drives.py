"""UMBPNvmeStore with several roots (one per drive), against the real sglang wheel: MHA TP2 and
MLA leader/follower byte-exact, whole pages on one drive, an old single-directory store kept."""

from __future__ import annotations

import json
import os

from support import sglang_env as E

ns = E.require_sglang()

from test_backend_on_real_wheel import get_all, hit_pages, set_all  # noqa: E402


def _roots(tmp_path, n=2) -> list[str]:
    return [str(tmp_path / f"nvme{i}" / "l3") for i in range(n)]


def test_mha_tp2_over_two_roots_round_trips_byte_exact_with_whole_pages_per_drive(tmp_path):
    roots = _roots(tmp_path)
    pools = [E.mha_pool() for _ in range(2)]
    cfgs = [E.storage_config(json.dumps(roots), tp_rank=r, tp_size=2) for r in range(2)]
    backends = [E.load_backend(c, p.host) for c, p in zip(cfgs, pools)]
    for r, b in enumerate(backends):
        assert b.store_dirs == [os.path.join(os.path.abspath(x), f"tp{r}") for x in roots]
    hashes = E.page_hashes(140, seed=31)
    data = []
    for r, (b, p) in enumerate(zip(backends, pools)):
        idx = p.alloc_pages(140)
        data.append((idx, E.fill_random(p.host, idx, seed=300 + r)))
        assert set_all(b, hashes, idx) == 140
        drives = b.store.store.drive_of([h + s for h in hashes for s in (f"_{r}_k", f"_{r}_v")])
        assert all(drives[i] == drives[i + 1] for i in range(0, len(drives), 2))  # K and V together
        rows = b.store_stats()["store"]["drives"]
        assert [x["state"] for x in rows] == ["healthy"] * 2 and all(x["objects"] > 0 for x in rows)
        assert sum(x["objects"] for x in rows) == 280
        got = b.get_stats()  # SGLang's StorageMetrics (a plain dataclass) carries the per-drive rows
        assert [(x["drive"], x["objects"], x["state"]) for x in got.drives] == [
            (x["drive"], x["objects"], x["state"]) for x in rows]
        assert all(x["write_gbps"] > 0 and x["bytes_written"] > 0 for x in got.drives)
    for (idx, written), b, p in zip(data, backends, pools):
        E.zero_pages(p.host, idx)
        assert hit_pages(b, hashes) == 140
        assert get_all(b, hashes, idx) == 140
        assert E.read_pages(p.host, idx) == written
        b.close()


def test_mla_leader_and_follower_over_two_roots_byte_exact(tmp_path):
    roots = _roots(tmp_path)
    spec = ",".join(roots)  # the comma form
    lpool, fpool = E.mla_pool(), E.mla_pool()
    leader = E.load_backend(E.storage_config(spec, tp_rank=0, tp_size=2, is_mla=True), lpool.host)
    assert leader.store_dirs == [os.path.abspath(r) for r in roots]  # one shared directory per root
    hashes = E.page_hashes(130, seed=41)
    idx = lpool.alloc_pages(130)
    written = E.fill_random(lpool.host, idx, seed=42)
    assert set_all(leader, hashes, idx) == 130
    assert all(x["objects"] > 0 for x in leader.store_stats()["store"]["drives"])
    follower = E.load_backend(E.storage_config(spec, tp_rank=1, tp_size=2, is_mla=True), fpool.host)
    assert follower.is_mla_follower and follower.store.readonly
    fidx = fpool.alloc_pages(130)
    assert hit_pages(follower, hashes) == 130
    assert get_all(follower, hashes, fidx) == 130
    assert E.read_pages(fpool.host, fidx) == written
    follower.close()
    leader.close()


def test_an_existing_single_directory_store_configured_with_two_roots_serves_every_old_page(tmp_path):
    old, added = _roots(tmp_path)
    pool = E.mha_pool()
    hashes = E.page_hashes(100, seed=51)
    idx = pool.alloc_pages(100)
    written = E.fill_random(pool.host, idx, seed=52)
    one = E.load_backend(E.storage_config(old), pool.host)
    assert set_all(one, hashes, idx) == 100
    one.close()
    E.zero_pages(pool.host, idx)
    two = E.load_backend(
        E.storage_config(json.dumps([old, added]), extra={"ssd_capacity_bytes": 128 << 20}), pool.host
    )  # the added drive brings its own share of the capacity
    assert hit_pages(two, hashes) == 100
    assert get_all(two, hashes, idx) == 100
    assert E.read_pages(pool.host, idx) == written
    more = E.page_hashes(100, seed=53)
    midx = pool.alloc_pages(100)
    mdata = E.fill_random(pool.host, midx, seed=54)
    assert set_all(two, more, midx) == 100
    rows = two.store_stats()["store"]["drives"]
    assert rows[1]["objects"] > 0 and rows[0]["objects"] > 200  # new pages spread over both
    E.zero_pages(pool.host, midx)
    assert get_all(two, more, midx) == 100
    assert E.read_pages(pool.host, midx) == mdata
    two.close()


def test_a_failing_drive_under_the_backend_costs_only_its_pages_and_rejoins(tmp_path):
    import time

    from support.faults import FaultPlan, FaultRule, on_files_under
    from umbp_nvme.sglang.backend import UMBPNvmeStore

    roots = _roots(tmp_path)
    plan = FaultPlan()
    pool = E.mha_pool()
    backend = UMBPNvmeStore(E.storage_config(json.dumps(roots)), pool.host, engine_factory=plan.engine_factory())
    hashes = E.page_hashes(60, seed=81)
    idx = pool.alloc_pages(60)
    written = E.fill_random(pool.host, idx, seed=82)
    assert set_all(backend, hashes, idx) == 60
    where = backend.store.store.drive_of([h + "_0_k" for h in hashes])
    plan.set_rules([FaultRule("eio", ops=("read",), predicate=on_files_under(backend.store_dirs[1]))])
    E.zero_pages(pool.host, idx)
    res = backend.batch_get_v1(hashes, idx)  # never raises: the bad drive's pages are misses
    assert res == [d == 0 for d in where]
    got = E.read_pages(pool.host, idx)  # objects, K and V of each page
    assert all(got[2 * i : 2 * i + 2] == written[2 * i : 2 * i + 2] for i, d in enumerate(where) if d == 0)
    first_bad = where.index(1)
    assert backend.batch_exists(hashes) == first_bad  # exists stops at the first page it lost
    rows = backend.store_stats()["store"]["drives"]
    assert rows[1]["state"] == "degraded" and rows[0]["state"] == "healthy"
    got = backend.get_stats().drives  # what SGLang's metrics call sees
    assert [x["state"] for x in got] == ["healthy", "degraded"] and got[1]["errors"] > 0
    plan.clear()
    deadline = time.monotonic() + 30  # a hang guard: the probe re-admits it within a few rounds
    while backend.store_stats()["store"]["drives"][1]["state"] != "healthy" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.batch_exists(hashes) == 60
    E.zero_pages(pool.host, idx)
    assert get_all(backend, hashes, idx) == 60 and E.read_pages(pool.host, idx) == written
    backend.close()
