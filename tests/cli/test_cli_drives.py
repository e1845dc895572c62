"""umbp-nvme over a multi-drive store (--store D0,D1): stats per drive (with the state the writer
recorded), verify, inspect, export -> warmup round trip, byte-exact."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os

import numpy as np

from conftest import payload, small_config
from support.cli_stores import make_store
from support.faults import FaultPlan, FaultRule, on_files_under as _on
from umbp_nvme.cli.main import main
from umbp_nvme.store import PageStore

OBJ = 8 << 10




async def _fill(roots, keys, degrade_second: bool) -> list[int]:
    plan = FaultPlan()
    st = await PageStore.open(roots, small_config(), engine_factory=plan.engine_factory(), probe_interval_s=60)
    assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * len(keys)
    where = st.drive_of(keys)
    if degrade_second:
        plan.set_rules([FaultRule("eio", ops=("read",), predicate=_on(roots[1]))])
        await st.get_many(keys, [np.zeros(OBJ, np.uint8) for _ in keys])
        assert st.stats()["drives"][1]["state"] == "degraded"
    await st.close()
    return where


def test_stats_verify_inspect_over_two_drives_show_each_drive(tmp_path, capsys):
    roots = [str(tmp_path / f"d{i}" / "store") for i in range(2)]
    keys = [f"p{i:03d}_0_{c}" for i in range(24) for c in "kv"]
    where = asyncio.run(_fill(roots, keys, degrade_second=True))
    spec = ",".join(roots)
    assert main(["stats", "--store", spec, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [d["objects"] for d in doc["drives"]] == [where.count(0), where.count(1)]
    assert doc["objects"] == 48
    assert doc["drives"][1]["recorded_health"]["state"] == "degraded"
    assert doc["drives"][0]["recorded_health"]["state"] == "healthy"
    assert doc["drives"][1]["recorded_health"]["errors"] > 0 and doc["drives"][0]["recorded_health"]["errors"] == 0
    assert doc["drives"][0]["recorded_health"]["write_gbps"] > 0
    assert main(["stats", "--store", spec]) == 0
    text = capsys.readouterr().out
    assert "== drive 1: " in text and "degraded (get failed: io_errors_read=" in text
    table = text[text.rindex("drive  root"):].splitlines()
    assert "errors" in table[0] and "read/write GB/s" in table[0] and len(table) == 3
    assert main(["verify", "--store", spec, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sum(d["checked"] for d in doc["drives"]) == 48 and all(not d["bad"] for d in doc["drives"])
    assert main(["inspect", "--store", spec, "--json", keys[0]]) == 0  # found on its drive: success
    doc = json.loads(capsys.readouterr().out)
    found = [d["keys"][0]["found"] for d in doc["drives"]]
    assert found == [where[0] == 0, where[0] == 1]
    assert main(["inspect", "--store", spec, keys[0], "nope_0_k"]) == 1  # a key no drive has
    capsys.readouterr()


def test_export_then_warmup_moves_a_two_drive_store_byte_exact(tmp_path, capsys):
    roots = [str(tmp_path / f"d{i}" / "store") for i in range(2)]
    keys = [f"e{i:03d}_0_{c}" for i in range(20) for c in "kv"]
    asyncio.run(_fill(roots, keys, degrade_second=False))
    out = str(tmp_path / "arch")
    assert main(["export", "--store", ",".join(roots), "--out", out]) == 0
    assert os.path.exists(out + ".d0") and os.path.exists(out + ".d1")
    dest = [str(tmp_path / f"n{i}" / "store") for i in range(2)]
    assert main(["warmup", "--store", ",".join(dest), out + ".d0", out + ".d1"]) == 0
    capsys.readouterr()

    async def check():
        st = await PageStore.open(dest, small_config(), capacity_from_manifest=True)  # sized by warmup
        outs = [np.zeros(OBJ, np.uint8) for _ in keys]
        res = await st.get_many(keys, outs)
        ok = all(np.array_equal(o, payload(k, OBJ)) for o, k in zip(outs, keys))
        spread = [r["objects"] for r in st.stats()["drives"]]
        await st.close()
        return res, ok, spread

    res, ok, spread = asyncio.run(check())
    assert res == [True] * 40 and ok and min(spread) > 0


def test_warmup_into_two_drives_places_whole_pages_by_sglang_key_formats(tmp_path, capsys):
    # side-pool keys carry a config prefix before the page hash: the store's own default page (the
    # text before the first '_') would put them all on one drive; warm-up places by sglang/keys.page_of
    hashes = [hashlib.sha256(f"w{i}".encode()).hexdigest() for i in range(16)]
    keys = [f"tag_org-model_{h}_0_{c}" for h in hashes for c in ("swa_k", "swa_v", "mamba_temporal")]
    src = str(tmp_path / "src")
    make_store(src, {k: payload(k, OBJ).tobytes() for k in keys})
    dest = [str(tmp_path / f"n{i}" / "store") for i in range(2)]
    assert main(["warmup", "--store", ",".join(dest), src]) == 0
    capsys.readouterr()

    async def check():
        st = await PageStore.open(dest, small_config(), capacity_from_manifest=True)
        where = st.drive_of(keys)
        outs = [np.zeros(OBJ, np.uint8) for _ in keys]
        res = await st.get_many(keys, outs)
        await st.close()
        return where, res, all(np.array_equal(o, payload(k, OBJ)) for o, k in zip(outs, keys))

    where, res, same = asyncio.run(check())
    assert res == [True] * len(keys) and same
    assert all(len(set(where[i : i + 3])) == 1 for i in range(0, len(keys), 3))  # each page's objects together
    assert sorted(set(where)) == [0, 1]  # and the pages spread over both drives


def test_stats_prometheus_over_two_drives_is_one_exposition_with_a_series_per_drive(tmp_path, capsys):
    from prometheus_client.parser import text_string_to_metric_families

    roots = [str(tmp_path / f"d{i}" / "store") for i in range(2)]
    keys = [f"p{i:03d}_0_{c}" for i in range(24) for c in "kv"]
    where = asyncio.run(_fill(roots, keys, degrade_second=True))
    assert main(["stats", "--store", ",".join(roots), "--prometheus"]) == 0
    samples = {}
    for fam in text_string_to_metric_families(capsys.readouterr().out):  # parses: one valid exposition
        for s in fam.samples:
            samples[(s.name, s.labels.get("drive"))] = s.value
    assert samples[("umbp_nvme_objects", None)] == 48
    assert samples[("umbp_nvme_drive_objects", "0")] == where.count(0)
    assert samples[("umbp_nvme_drive_objects", "1")] == where.count(1)
    assert samples[("umbp_nvme_drive_healthy", "0")] == 1
    assert samples[("umbp_nvme_drive_healthy", "1")] == 0  # as the writer recorded it
    assert samples[("umbp_nvme_drive_bytes_used", "0")] > 0
