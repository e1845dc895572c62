"""`umbp-nvme stats | verify | inspect | compact` end to end on temp stores."""

from __future__ import annotations

import json
import os

import numpy as np
from support.cli_stores import CAP, _cfg, items, make_store, read_store, run_cli

from umbp_nvme.cli.maintenance import StoreReader, classify_key
from umbp_nvme.store.segments import segment_name
from umbp_nvme.store.sync import SyncPageStore


def _corrupt(store: str, key: str) -> None:
    with StoreReader(store) as r:
        rec = r.lookup([key])[0]
    path = os.path.join(store, segment_name(rec.segment))
    with open(path, "r+b") as f:
        f.seek(rec.offset + 17)
        b = f.read(1)
        f.seek(rec.offset + 17)
        f.write(bytes([b[0] ^ 0x5A]))


def test_stats_numbers_match_the_store_contents(tmp_path, capsys):
    kv = items(7, 12 * 1024)  # 14 KV objects of 12 KiB
    side = {f"m_{'ab' * 32}_0_swa_k": b"s" * 5000, f"m_{'ab' * 32}_0_swa_v": b"t" * 5000, f"m_{'cd' * 32}_0_temporal": b"u" * 3000}
    store = str(tmp_path / "s")
    make_store(store, kv | side, {"model": "m", "layout": "page_first"})
    rc, out, err = run_cli(capsys, "stats", "--store", store, "--capacity", "64m", "--json")
    s = json.loads(out)
    assert rc == 0
    assert s["objects"] == 17
    assert s["object_bytes"] == 14 * 12 * 1024 + 13000
    assert s["bytes_used"] == 14 * 12 * 1024 + 2 * 8192 + 4096  # slots: rounded up to 4 KiB
    w = SyncPageStore(store, _cfg())  # the store's own accounting agrees
    try:
        own = w.stats()
    finally:
        w.close()
    assert (own["objects"], own["bytes_used"]) == (s["objects"], s["bytes_used"])
    assert s["pools"] == {"kv": {"objects": 14, "bytes": 14 * 12 * 1024}, "swa": {"objects": 2, "bytes": 10000},
                          "mamba": {"objects": 1, "bytes": 3000}}
    assert s["prefixes"] == {"(none)": 14, "m": 3}
    assert s["capacity_bytes"] == 64 << 20 and s["high_watermark_bytes"] == int((64 << 20) * 0.98)
    assert s["namespace"] == {"model": "m", "layout": "page_first"}
    assert s["writer_pid"] is None
    rc, out, err = run_cli(capsys, "stats", "--store", store)
    assert "objects      17" in out and "swa" in out


def test_classify_key_knows_the_component_key_shapes():
    h = "0123456789abcdef" * 4
    assert classify_key(f"{h}_0_k") == ("kv", "")
    assert classify_key(f"{h}__k") == ("kv", "")
    assert classify_key(f"{h}_3_1_v") == ("kv", "")
    assert classify_key(f"tag_org-M_{h}__indexer") == ("indexer", "tag_org-M")
    assert classify_key(f"m_{h}_0_conv_1") == ("mamba", "m")
    assert classify_key(f"m_{h}__deepseek_v4_c4") == ("deepseek_v4_c4", "m")


def test_verify_finds_a_corrupted_object_and_repair_drops_it(tmp_path, capsys):
    data = items(5)
    store = str(tmp_path / "s")
    make_store(store, data)
    rc, out, err = run_cli(capsys, "verify", "--store", store)
    assert rc == 0 and "clean" in out
    victim = list(data)[3]
    _corrupt(store, victim)
    rc, out, err = run_cli(capsys, "verify", "--store", store, "--json")
    s = json.loads(out)
    assert rc == 1 and s["checked"] == 10
    assert [(b["key"], b["status"]) for b in s["bad"]] == [(victim, "crc_mismatch")]
    rc, out, err = run_cli(capsys, "verify", "--store", store, "--repair", *CAP[:2])
    assert rc == 1 and "dropped 1 bad entries" in out
    rc, out, err = run_cli(capsys, "verify", "--store", store)
    assert rc == 0 and "checked 9 objects" in out
    assert read_store(store, [k for k in data if k != victim]) == {k: v for k, v in data.items() if k != victim}


def test_read_only_commands_work_while_a_writer_holds_the_store_and_writing_ones_say_who(tmp_path, capsys):
    data = items(3)
    store = str(tmp_path / "s")
    make_store(store, data)
    writer = SyncPageStore(store, _cfg())
    try:
        more = items(2, tag="live")
        assert all(writer.put_many(list(more), [np.frombuffer(bytearray(v), np.uint8) for v in more.values()]))
        rc, out, err = run_cli(capsys, "stats", "--store", store, "--json")
        s = json.loads(out)
        assert rc == 0 and s["objects"] == 10 and s["writer_pid"] == str(os.getpid())
        assert run_cli(capsys, "verify", "--store", store)[0] == 0
        assert run_cli(capsys, "inspect", "--store", store, list(more)[0])[0] == 0
        arc = str(tmp_path / "x.umbparc")
        assert run_cli(capsys, "export", "--store", store, "--out", arc)[0] == 0
        for argv in (["compact", "--store", store], ["verify", "--store", store, "--repair"]):
            rc, out, err = run_cli(capsys, *argv)
            assert rc == 2
            assert f"pid {os.getpid()}" in err and store in err and "stop that process" in err
    finally:
        writer.close()


def test_inspect_shows_where_each_key_lives_and_whether_it_verifies(tmp_path, capsys):
    data = items(2)
    store = str(tmp_path / "s")
    make_store(store, data)
    k0, k1 = list(data)[:2]
    _corrupt(store, k1)
    rc, out, err = run_cli(capsys, "inspect", "--store", store, "--json", k0, k1, "missing_0_k")
    rows = json.loads(out)["keys"]
    assert rc == 1
    assert rows[0]["status"] == "ok" and rows[0]["length"] == len(data[k0]) and rows[0]["file"].endswith(".dat")
    assert rows[0]["pool"] == "kv" and rows[0]["offset"] % 4096 == 0 and len(rows[0]["crc32c"]) == 8
    assert rows[1]["status"] == "crc_mismatch"
    assert rows[2] == {"key": "missing_0_k", "found": False, "status": "missing"}
    rc, out, err = run_cli(capsys, "inspect", "--store", store, k0)
    assert rc == 0 and k0 in out and "ok" in out


def test_compact_removes_empty_segments_and_punches_free_space_keeping_data(tmp_path, capsys):
    data = items(64, 60 * 1024)  # 128 objects of 64 KiB slots = 8 MiB: 8 segments of 1 MiB
    store = str(tmp_path / "s")
    make_store(store, data)
    keep = {k: v for i, (k, v) in enumerate(data.items()) if i % 16 == 0}  # 8 objects, one in each segment
    holder = SyncPageStore(store, _cfg())
    try:
        holder.delete_many([k for k in data if k not in keep][:100])
    finally:
        holder.close()
    before = {n: os.stat(os.path.join(store, n)).st_blocks for n in os.listdir(store) if n.startswith("seg-")}
    rc, out, err = run_cli(capsys, "compact", "--store", store, *CAP, "--json")
    s = json.loads(out)
    assert rc == 0, err
    assert s["reclaimed_bytes"] > 0 and s["disk_bytes_after"] < s["disk_bytes_before"]
    after = {n: os.stat(os.path.join(store, n)) for n in os.listdir(store) if n.startswith("seg-")}
    assert all(st.st_size == 1 << 20 for st in after.values())  # sizes kept: the store needs them whole
    assert sum(st.st_blocks for st in after.values()) < sum(before.values())
    remaining = {k: v for k, v in data.items() if k in keep or k not in [x for x in data if x not in keep][:100]}
    assert read_store(store, remaining) == remaining
    assert run_cli(capsys, "verify", "--store", store)[0] == 0
    # the store keeps working: new objects go into the punched space
    more = items(8, 60 * 1024, tag="new")
    make_store(store, more)
    assert read_store(store, more) == more


def test_commands_on_a_path_that_is_not_a_store_say_so(tmp_path, capsys):
    for cmd in ("stats", "verify", "inspect", "export"):
        extra = ["k"] if cmd == "inspect" else (["--out", str(tmp_path / "o")] if cmd == "export" else [])
        rc, out, err = run_cli(capsys, cmd, "--store", str(tmp_path / "nope"), *extra)
        assert rc == 2 and str(tmp_path / "nope") in err and "--store" in err
