"""Prometheus metrics: what a scrape shows after real traffic, and SGLang's own /metrics path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest  # the test extra has it
from prometheus_client.parser import text_string_to_metric_families

from conftest import KiB, MiB, payload, small_config
from umbp_nvme.store.segments import segment_name
from umbp_nvme.store.sync import SyncPageStore

from support.faults import FaultPlan, FaultRule

from umbp_nvme import metrics

OBJ = 64 * KiB


def scrape(registry) -> dict:
    """{(sample name, frozenset(labels)): value} of one scrape."""
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    hits = [v for (n, lab), v in samples.items() if n == name and set(labels.items()) <= set(lab)]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def corrupt(sync: SyncPageStore, key: str) -> None:
    """Flip one byte of ``key``'s object in its segment file, behind the store's back."""
    st = sync.store
    seg, off = st.locate([key])[0][:2]
    with open(os.path.join(st.path, segment_name(seg)), "r+b") as f:
        f.seek(off + 17)
        b = f.read(1)
        f.seek(off + 17)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def test_a_scrape_counts_puts_gets_evictions_a_crc_error_and_an_io_error_exactly(store_dir):
    cfg = small_config(ssd_capacity_bytes=4 * MiB, ssd_segment_size_bytes=1 * MiB)
    plan = FaultPlan(seed=1)
    # the fault engine sits below the counting wrapper, like a failing drive
    sync = SyncPageStore(store_dir, cfg, engine_factory=plan.engine_factory())
    reg = CollectorRegistry()
    m = metrics.Metrics(reg, multiprocess=False)
    m.watch(sync, {"model_name": "tiny", "tp_rank": 1})
    try:
        first = [f"a{i}" for i in range(10)]
        assert sync.put_many(first, [payload(k, OBJ) for k in first]) == [True] * 10
        outs = [np.zeros(OBJ, np.uint8) for _ in first]
        assert sync.get_many(first, outs) == [True] * 10
        corrupt(sync, "a0")
        assert sync.get_many(["a0"], [np.zeros(OBJ, np.uint8)]) == [False]  # CRC error: dropped
        plan.set_rules([FaultRule("eio", ops=("read",), limit=1)])
        assert sync.get_many(["a1"], [np.zeros(OBJ, np.uint8)]) == [False]  # injected EIO
        plan.set_rules([])
        more = [f"b{i}" for i in range(60)]  # 70 x 64 KiB into 4 MiB: evictions
        for lo in range(0, 60, 20):
            ks = more[lo : lo + 20]
            assert sync.put_many(ks, [payload(k, OBJ) for k in ks]) == [True] * 20
        present = sync.exists_many(first + more)
        stats = sync.stats()

        s = scrape(reg)
        lab = dict(model_name="tiny", tp_rank="1", store="")
        assert value(s, "umbp_nvme_puts_total", **lab) == 70
        assert value(s, "umbp_nvme_gets_total", **lab) == 12
        assert value(s, "umbp_nvme_hits_total", **lab) == 10
        assert value(s, "umbp_nvme_misses_total", **lab) == 2
        assert value(s, "umbp_nvme_crc_errors_total", **lab) == 1
        assert value(s, "umbp_nvme_io_errors_total", op="read", **lab) == 1
        assert value(s, "umbp_nvme_io_errors_total", op="write", **lab) == 0
        assert value(s, "umbp_nvme_deletes_total", **lab) == 1  # the corrupt entry
        evicted = 70 - 1 - sum(present)
        assert evicted > 0
        assert value(s, "umbp_nvme_evictions_total", **lab) == evicted == stats["evictions"]
        assert value(s, "umbp_nvme_objects", **lab) == sum(present)
        assert value(s, "umbp_nvme_bytes_used", **lab) == sum(present) * OBJ
        assert value(s, "umbp_nvme_capacity_bytes", **lab) == 4 * MiB
        assert value(s, "umbp_nvme_puts_in_doubt_bytes", **lab) == 0
        assert value(s, "umbp_nvme_fs_free_bytes", **lab) > 0
        # latency: one observation per batch call
        assert value(s, "umbp_nvme_batch_seconds_count", op="put", **lab) == 4
        assert value(s, "umbp_nvme_batch_seconds_count", op="get", **lab) == 3
        assert value(s, "umbp_nvme_batch_seconds_count", op="exists", **lab) == 1
        assert value(s, "umbp_nvme_object_seconds_count", op="put", **lab) == 4
        assert value(s, "umbp_nvme_batch_seconds_bucket", op="get", le="10.0", **lab) == 3
        # no key or hash ever becomes a label
        assert not any("a0" in v or "b1" in v for _, lab_ in s for _, v in lab_)
    finally:
        m.unwatch(sync)
        sync.close()


def test_a_forced_posix_engine_and_a_buffered_store_show_as_fallbacks(store_dir, monkeypatch):
    monkeypatch.setenv("UMBP_NVME_FORCE_NO_URING", "1")
    sync = SyncPageStore(store_dir, small_config(ssd_io_backend="io_uring"))
    reg = CollectorRegistry()
    m = metrics.Metrics(reg, multiprocess=False)
    m.watch(sync)
    try:
        assert sync.put_many(["k"], [payload("k", OBJ)]) == [True]  # data files are opened (and probed) on use
        s = scrape(reg)
        assert value(s, "umbp_nvme_engine_info", asked="io_uring", chosen="posix") == 1
        assert value(s, "umbp_nvme_fallback", what="engine") == 1
        direct = sync.stats()["o_direct"]
        assert value(s, "umbp_nvme_o_direct") == float(direct)
        assert value(s, "umbp_nvme_fallback", what="o_direct") == float(not direct)
    finally:
        m.unwatch(sync)
        sync.close()


def test_stats_prometheus_prints_the_families_of_a_store_on_disk(store_dir, capsys):
    from umbp_nvme.cli.main import main

    with SyncPageStore(store_dir, small_config()) as sync:
        ks = [f"k{i}" for i in range(5)]
        sync.put_many(ks, [payload(k, OBJ) for k in ks])
    assert main(["stats", "--store", store_dir, "--prometheus"]) == 0
    text = capsys.readouterr().out
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert fams["umbp_nvme_objects"].samples[0].value == 5
    assert fams["umbp_nvme_bytes_used"].samples[0].value == 5 * OBJ
    assert "umbp_nvme_capacity_bytes" in fams and "umbp_nvme_disk_bytes" in fams


SGLANG_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {tests!r})
    import sglang_env as E
    root = sys.argv[1]
    pool = E.mha_pool("page_first")
    cfg = E.storage_config(root, enable_storage_metrics=True)
    backend = E.load_backend(cfg, pool.host)
    hashes = E.page_hashes(8, seed=3)
    idx = pool.alloc_pages(8)
    E.fill_random(pool.host, idx, 5)
    assert all(backend.batch_set_v1(hashes, idx))
    assert backend.batch_exists(hashes) == 8
    assert all(backend.batch_get_v1(hashes, idx))
    backend.close()  # the last values are written at close; a live server refreshes every second

    # SGLang's own exposition: the /metrics route its HTTP server mounts
    from starlette.applications import Starlette
    from sglang.srt.utils.common import add_prometheus_middleware
    app = Starlette()
    add_prometheus_middleware(app)
    body = []
    async def get():
        scope = dict(type="http", method="GET", path="/metrics", raw_path=b"/metrics", root_path="",
                     query_string=b"", headers=[], scheme="http", server=("x", 80), http_version="1.1")
        async def receive():
            return dict(type="http.request", body=b"", more_body=False)
        async def send(msg):
            if msg["type"] == "http.response.body":
                body.append(msg.get("body", b""))
        await app(scope, receive, send)
    asyncio.run(get())
    sys.stdout.write(b"".join(body).decode())
    """
)


def test_sglang_metrics_endpoint_shows_the_umbp_nvme_families(tmp_path):
    from support import sglang_env as E

    E.require_sglang()
    env = E.subprocess_env()
    mp = tmp_path / "prom"
    mp.mkdir()
    env["PROMETHEUS_MULTIPROC_DIR"] = str(mp)
    code = SGLANG_CHILD.format(tests=E.TESTS_DIR)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")], env=env, capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    fams = {f.name: f for f in text_string_to_metric_families(r.stdout)}
    puts = fams["umbp_nvme_puts"].samples
    assert [s.value for s in puts if s.name == "umbp_nvme_puts_total"] == [16.0]  # 8 pages x (k, v)
    assert puts[0].labels["tp_rank"] == "0" and puts[0].labels["model_name"] == E.MODEL
    assert [s.value for s in fams["umbp_nvme_hits"].samples if s.name == "umbp_nvme_hits_total"] == [16.0]
    assert fams["umbp_nvme_objects"].samples[0].value == 16
    counts = {s.labels["op"]: s.value for s in fams["umbp_nvme_batch_seconds"].samples if s.name.endswith("_count")}
    assert counts == {"put": 1.0, "get": 1.0, "exists": 1.0}


def test_multiprocess_mode_refreshes_counters_gauges_and_histograms_while_the_store_runs(store_dir):
    # the push path (what SGLang's multiprocess /metrics reads) on an in-memory registry
    sync = SyncPageStore(store_dir, small_config())
    reg = CollectorRegistry()
    m = metrics.Metrics(reg, multiprocess=True, refresh_s=0.05)
    m.watch(sync, {"tp_rank": 2})
    try:
        ks = [f"k{i}" for i in range(6)]
        assert sync.put_many(ks, [payload(k, OBJ) for k in ks]) == [True] * 6
        assert sync.get_many(ks[:4], [np.zeros(OBJ, np.uint8) for _ in range(4)]) == [True] * 4
        assert m.wait_refreshes(4, 10)  # several refreshes: deltas must not be added twice
        s = scrape(reg)
        assert value(s, "umbp_nvme_puts_total", tp_rank="2") == 6
        assert value(s, "umbp_nvme_hits_total", tp_rank="2") == 4
        assert value(s, "umbp_nvme_objects", tp_rank="2") == 6
        assert value(s, "umbp_nvme_batch_seconds_count", tp_rank="2", op="get") == 1
        assert value(s, "umbp_nvme_object_seconds_count", tp_rank="2", op="put") == 1
        assert sync.put_many(["x"], [payload("x", OBJ)]) == [True]
        assert m.wait_refreshes(2, 10)  # one whole round after the put
        s = scrape(reg)
        assert value(s, "umbp_nvme_puts_total", tp_rank="2") == 7
        assert value(s, "umbp_nvme_batch_seconds_count", tp_rank="2", op="put") == 2
    finally:
        m.unwatch(sync)
        m.close()
        sync.close()
