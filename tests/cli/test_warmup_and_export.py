"""`umbp-nvme warmup` / `export` end to end on temp stores (no SGLang needed; see test_warmup_from_hicachefile.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, payload
from support.cli_stores import CAP, _cfg, items, make_store, read_store, run_cli

import umbp_nvme.cli.main as cli
from umbp_nvme.cli.hicache_files import FileBackendLayout
from umbp_nvme.cli.maintenance import StoreReader
from umbp_nvme.cli.warmup import TokenBucket

# --- HiCacheFile directories ------------------------------------------------------------------


def write_file_backend(directory: str, pages: dict[str, bytes], suffix: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for h, data in pages.items():
        with open(os.path.join(directory, f"{h}{suffix}.bin"), "wb") as f:
            f.write(data)


def test_file_backend_suffixes_match_hicachefile_naming():
    assert FileBackendLayout(model="org/M").file_suffix == "_org-M_0_1"
    assert FileBackendLayout(model="m", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2).file_suffix == "_m_1_2_2_1"
    assert FileBackendLayout(model="m", is_mla=True, tp_rank=3, tp_size=4).file_suffix == "_m"
    assert FileBackendLayout(model="m", is_mla=True, pp_size=2, pp_rank=1).file_suffix == "_m_2_1"
    assert FileBackendLayout(model=None).file_suffix == "__0_1"


def test_file_backend_page_maps_to_k_then_v_objects_and_split_head_groups():
    lay = FileBackendLayout(model="m")
    assert lay.objects("h", 8192) == (["h_0_k", "h_0_v"], [0, 4096], [4096, 4096])
    mla = FileBackendLayout(model="m", is_mla=True)
    assert mla.objects("h", 8192) == (["h__k"], [0], [8192])
    sh = FileBackendLayout(model="m", tp_rank=1, tp_size=2, split_factor=2)
    keys, offs, lens = sh.objects("h", 16384)
    assert keys == ["h_2_k", "h_2_v", "h_3_k", "h_3_v"]
    assert offs == [0, 8192, 4096, 12288] and lens == [4096] * 4


def test_warmup_from_file_backend_dir_maps_keys_and_bytes(tmp_path, capsys):
    src = str(tmp_path / "hicache")
    pages = {f"{i:064x}": payload(f"page{i}", 2 * 8192).tobytes() for i in range(20)}
    write_file_backend(src, pages, "_org-M_0_1")
    write_file_backend(src, {f"{i:064x}": b"z" * 100 for i in range(3)}, "_org-M_1_2")  # another rank: ignored
    with open(os.path.join(src, ".abc.tmp"), "wb") as f:  # HiCacheFile's in-flight temporary
        f.write(b"junk")
    store = str(tmp_path / "store")
    rc, out, err = run_cli(capsys, "warmup", "--store", store, "--model", "org/M", *CAP, "--json", src)
    s = json.loads(out)
    assert rc == 0, (out, err)
    assert s["imported"] == 40 and s["failed"] == 0 and s["bytes_imported"] == 20 * 2 * 8192
    assert s["ignored_files"] == 4
    got = read_store(store, [f"{h}_0_{c}" for h in pages for c in "kv"])
    for h, data in pages.items():
        assert got[f"{h}_0_k"] == data[:8192] and got[f"{h}_0_v"] == data[8192:]


def test_warmup_refuses_files_whose_size_does_not_match_the_namespace(tmp_path, capsys):
    src = str(tmp_path / "hicache")
    good = {f"{i:064x}": payload(f"g{i}", 8192).tobytes() for i in range(4)}
    write_file_backend(src, good, "_m_0_1")
    write_file_backend(src, {"f" * 64: b"\1" * 6000}, "_m_0_1")
    store = str(tmp_path / "store")
    ns = {"model": "m", "kv_object_bytes": [4096, 4096]}  # as UMBPNvmeStore records it
    rc, out, err = run_cli(capsys, "warmup", "--store", store, "--model", "m", "--namespace", json.dumps(ns), *CAP, "--json", src)
    s = json.loads(out)
    assert rc == 1
    assert s["imported"] == 8 and s["refused_files"] == 1
    assert any("6000 bytes" in e and "8192" in e and "f" * 64 in e for e in s["errors"])


def test_warmup_without_matching_files_says_which_suffix_it_looked_for(tmp_path, capsys):
    src = str(tmp_path / "hicache")
    write_file_backend(src, {"a" * 64: b"\0" * 8192}, "_other_0_1")
    rc, out, err = run_cli(capsys, "warmup", "--store", str(tmp_path / "s"), "--model", "mine", *CAP, "--json", src)
    # issue 35: nothing to import is an error (exit 2) before the store is made, not an empty success
    assert rc == 2 and out == "" and not os.path.exists(tmp_path / "s")
    assert "names ending '_mine_0_1.bin'" in err and "--model" in err


# --- stores, archives ------------------------------------------------------------------------


def test_export_then_warmup_into_a_fresh_store_is_byte_identical(tmp_path, capsys):
    data = items(20, 12 * 1024) | items(5, 100_000, tag="q")  # 50 objects
    a = str(tmp_path / "a")
    make_store(a, data, {"model": "m", "dtype": "bf16"})
    arc = str(tmp_path / "cache.umbparc")
    rc, out, err = run_cli(capsys, "export", "--store", a, "--out", arc, "--json")
    assert rc == 0, err
    assert json.loads(out)["exported"] == 50
    b = str(tmp_path / "b")
    rc, out, err = run_cli(capsys, "warmup", "--store", b, *CAP, "--json", arc)
    s = json.loads(out)
    assert rc == 0 and s["imported"] == 50 and s["failed"] == 0
    assert read_store(b, data) == data
    with StoreReader(b) as r:
        assert r.namespace == {"model": "m", "dtype": "bf16"}  # the archive carries it
    # a second import skips everything: deduplicated
    rc, out, err = run_cli(capsys, "warmup", "--store", b, *CAP, "--json", arc)
    s = json.loads(out)
    assert (s["imported"], s["skipped"]) == (0, 50)


def test_export_of_selected_keys_and_to_stdout(tmp_path, capsys):
    data = items(3)  # 6 objects
    a = str(tmp_path / "a")
    make_store(a, data)
    keys = list(data)[:3]
    kf = tmp_path / "keys.txt"
    kf.write_text("# hot pages\n" + "\n".join(keys + ["not-there_0_k"]) + "\n")
    arc = str(tmp_path / "hot.umbparc")
    rc, out, err = run_cli(capsys, "export", "--store", a, "--out", arc, "--keys", str(kf), "--json")
    s = json.loads(out)
    assert rc == 1 and s["exported"] == 3 and s["missing"] == 1  # exit 1: a key was asked for and is not there
    from umbp_nvme.cli.archive import ArchiveReader

    with open(arc, "rb") as f:
        assert sorted(k for k, v, ok in ArchiveReader(f)) == sorted(keys)


def test_warmup_merges_another_store_and_checks_its_namespace(tmp_path, capsys):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    da, db = items(5, tag="a"), items(5, tag="b")
    make_store(a, da, {"model": "m"})
    make_store(b, db, {"model": "m"})
    rc, out, err = run_cli(capsys, "warmup", "--store", b, *CAP, "--json", a)
    s = json.loads(out)
    assert rc == 0 and s["imported"] == 10
    assert read_store(b, list(da) + list(db)) == da | db
    other = str(tmp_path / "other")
    make_store(other, items(2, tag="c"), {"model": "different"})
    rc, out, err = run_cli(capsys, "warmup", "--store", b, *CAP, other)
    assert rc == 2
    assert "model" in err and "different" in err and b in err


def test_warmup_skips_an_archive_record_whose_crc_fails(tmp_path, capsys):
    data = items(3)  # 6 objects
    a = str(tmp_path / "a")
    make_store(a, data)
    arc = tmp_path / "x.umbparc"
    assert run_cli(capsys, "export", "--store", a, "--out", str(arc))[0] == 0
    raw = bytearray(arc.read_bytes())
    victim = list(data)[2]
    pos = raw.index(data[victim][:64]) + 100
    raw[pos] ^= 0x40
    arc.write_bytes(bytes(raw))
    b = str(tmp_path / "b")
    rc, out, err = run_cli(capsys, "warmup", "--store", b, *CAP, "--json", str(arc))
    s = json.loads(out)
    assert rc == 1 and s["imported"] == 5 and s["failed"] == 1
    assert any(victim in e and "CRC32C" in e for e in s["errors"])
    assert read_store(b, [victim])[victim] is None


def test_writing_into_a_locked_store_names_the_holder(tmp_path, capsys):
    from umbp_nvme.store.sync import SyncPageStore

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    make_store(a, items(2))
    holder = SyncPageStore(b, _cfg())
    try:
        rc, out, err = run_cli(capsys, "warmup", "--store", b, *CAP, a)
        assert rc == 2
        assert f"pid {os.getpid()}" in err and b in err
    finally:
        holder.close()


# --- throttle and resume ---------------------------------------------------------------------


def test_token_bucket_paces_bytes():
    t = [0.0]
    b = TokenBucket(1000.0, burst_s=0.5, clock=lambda: t[0])
    assert b.delay_for(500) == 0.0  # the burst
    assert b.delay_for(1000) == pytest.approx(1.0)
    t[0] += 1.0
    assert b.delay_for(0) == 0.0
    assert TokenBucket(None).delay_for(1 << 40) == 0.0


def test_max_gbps_slows_the_import(tmp_path, capsys):
    data = items(16, 64 * 1024)  # 32 objects, 2 MiB
    a = str(tmp_path / "a")
    make_store(a, data)
    t0 = time.perf_counter()
    rc, out, err = run_cli(capsys, "warmup", "--store", str(tmp_path / "b"), *CAP, "--max-gbps", "0.002",
                           "--batch-size", "256k", "--json", a)
    dt = time.perf_counter() - t0
    assert rc == 0 and json.loads(out)["imported"] == 32
    assert dt >= 0.7  # 2.1 MB at 2 MB/s, less the first burst


def test_resume_after_sigint_imports_each_key_exactly_once(tmp_path):
    data = items(60, 64 * 1024)  # 120 objects, 7.9 MB
    a = str(tmp_path / "a")
    make_store(a, data, {"model": "m"})
    arc = str(tmp_path / "x.umbparc")
    assert cli.main(["export", "--store", a, "--out", arc]) == 0
    b = str(tmp_path / "b")
    cmd = [sys.executable, "-m", "umbp_nvme.cli", "warmup", "--store", b, *CAP, "--batch-size", "256k", "--json"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # at the floor rate (1 MB/s) the import takes ~8 s, the interrupt comes at 10 objects (~0.7 MB)
    p = subprocess.Popen(cmd + ["--max-gbps", "0.001", arc], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    n = 0
    while time.time() < deadline and p.poll() is None:
        if os.path.exists(os.path.join(b, "index.lmdb")):
            with StoreReader(b) as r:
                n = len(r.scan()[0])
            if n >= 10:
                break
        time.sleep(0.05)
    assert p.poll() is None, "the import finished before it could be interrupted"
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    first = json.loads(out)
    assert p.returncode == 130, err
    assert first["interrupted"] and 0 < first["imported"] < 120
    with StoreReader(b) as r:
        assert len(r.scan()[0]) == first["imported"]  # nothing half-imported, nothing lost
    second = subprocess.run(cmd + [arc], cwd=ROOT, env=env, capture_output=True, timeout=120)
    s2 = json.loads(second.stdout)
    assert second.returncode == 0, second.stderr
    assert s2["skipped"] == first["imported"]
    assert s2["imported"] + first["imported"] == 120
    assert read_store(b, data) == data
