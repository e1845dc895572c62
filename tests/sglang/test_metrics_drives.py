"""Per-drive Prometheus series of a store over several drives (metrics.drive_samples)."""

from __future__ import annotations


import numpy as np
from prometheus_client import CollectorRegistry

from conftest import KiB, payload, small_config
from support.drive_pages import page_keys as _keys
from support.faults import FaultPlan, FaultRule, on_files_under as _on
from test_metrics_scrape import scrape, value
from umbp_nvme import metrics
from umbp_nvme.store.sync import SyncPageStore

OBJ = 64 * KiB




def test_a_two_drive_store_exports_each_drives_state_objects_bytes_errors_and_gbps(tmp_path):
    roots = [str(tmp_path / f"d{i}" / "store") for i in range(2)]
    plan = FaultPlan()
    sync = SyncPageStore(roots, small_config(), engine_factory=plan.engine_factory())
    reg = CollectorRegistry()
    m = metrics.Metrics(reg, multiprocess=False)
    m.watch(sync, {"tp_rank": 0})
    try:
        keys = _keys(20)
        assert sync.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 40
        assert sync.get_many(keys, [np.zeros(OBJ, np.uint8) for _ in keys]) == [True] * 40
        on = [sum(1 for d in sync.store.drive_of(keys) if d == i) for i in range(2)]
        assert on[0] > 0 and on[1] > 0 and sum(on) == 40
        s = scrape(reg)
        for i in range(2):
            d = str(i)
            assert value(s, "umbp_nvme_drive_healthy", drive=d) == 1
            assert value(s, "umbp_nvme_drive_info", drive=d, path=roots[i]) == 1
            assert value(s, "umbp_nvme_drive_objects", drive=d) == on[i]
            assert value(s, "umbp_nvme_drive_bytes_written_total", drive=d) == on[i] * OBJ
            assert value(s, "umbp_nvme_drive_bytes_read_total", drive=d) == on[i] * OBJ
            assert value(s, "umbp_nvme_drive_errors_total", drive=d) == 0
            assert value(s, "umbp_nvme_drive_read_gbps", drive=d) > 0
            assert value(s, "umbp_nvme_drive_write_gbps", drive=d) > 0
            assert value(s, "umbp_nvme_drive_fs_free_bytes", drive=d) > 0
        assert value(s, "umbp_nvme_objects", tp_rank="0") == 40  # the store's own series: the sum

        plan.set_rules([FaultRule("eio", ops=("read",), predicate=_on(roots[1]))])
        res = sync.get_many(keys, [np.zeros(OBJ, np.uint8) for _ in keys])
        assert sum(res) == on[0]
        s = scrape(reg)
        assert value(s, "umbp_nvme_drive_healthy", drive="1") == 0
        assert value(s, "umbp_nvme_drive_errors_total", drive="1") > 0
        assert value(s, "umbp_nvme_drive_degradations_total", drive="1") == 1
        assert value(s, "umbp_nvme_drive_healthy", drive="0") == 1
        assert value(s, "umbp_nvme_drive_errors_total", drive="0") == 0
        assert not [k for k in s if k[0] == "umbp_nvme_drive_fs_free_bytes" and ("drive", "1") in k[1]]
    finally:
        m.unwatch(sync)
        sync.close()


def test_multiprocess_push_carries_the_drive_label_and_one_root_has_no_drive_series(tmp_path):
    roots = [str(tmp_path / f"d{i}" / "store") for i in range(2)]
    two, one = SyncPageStore(roots, small_config()), SyncPageStore(str(tmp_path / "one"), small_config())
    reg = CollectorRegistry()
    m = metrics.Metrics(reg, multiprocess=True, refresh_s=0.05)
    m.watch(two, {"tp_rank": 0})
    m.watch(one, {"tp_rank": 1})
    try:
        keys = _keys(10)
        assert two.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 20
        assert one.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 20
        assert m.wait_refreshes(3, 10)  # several rounds: counter deltas never added twice
        s = scrape(reg)
        rows = two.stats()["drives"]
        for i in range(2):
            assert value(s, "umbp_nvme_drive_objects", tp_rank="0", drive=str(i)) == rows[i]["objects"]
            assert value(s, "umbp_nvme_drive_bytes_written_total", tp_rank="0", drive=str(i)) == rows[i]["objects"] * OBJ
        assert sum(r["objects"] for r in rows) == 20
        assert not [k for k in s if k[0].startswith("umbp_nvme_drive_") and ("tp_rank", "1") in k[1]]
        assert value(s, "umbp_nvme_objects", tp_rank="1") == 20
    finally:
        m.unwatch(two)
        m.unwatch(one)
        m.close()
        two.close()
        one.close()
