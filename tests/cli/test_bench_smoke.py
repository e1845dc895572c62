"""Smoke tests of the store and hicache benchmarks: a tiny run each, JSON schema, positive numbers.

Each runs the benchmark's ``--smoke`` mode in a child process (as a user would, through
``python -m umbp_nvme.bench``), so a benchmark's hugetlb reservation, page-cache drops and
event loops stay out of the test process. The hicache benchmark is skipped without sglang.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support import sglang_env
from umbp_nvme.bench import nixl_posix

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = {"bench", "system", "op", "object_bytes", "queue_depth", "runs", "gbps", "iops", "cpu_us_per_op"}
SPANS = {f"{k}_{s}" for k in ("gbps", "iops", "cpu_us_per_op") for s in ("min", "max")}


def _run(name: str, tmp_path, *extra: str) -> tuple[list[dict], str]:
    out = tmp_path / f"{name}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "umbp_nvme.bench", name, "--smoke", "--dir", str(tmp_path / "d"), "--json", str(out), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f), proc.stdout


def _check_common(rows: list[dict], bench: str) -> None:
    assert rows, "no rows"
    for r in rows:
        assert COMMON <= set(r), f"missing {COMMON - set(r)} in {r}"
        assert SPANS <= set(r), f"missing {SPANS - set(r)} in {r}"
        assert r["bench"] == bench
        assert r["runs"] >= 1 and r["object_bytes"] >= 0 and r["queue_depth"] >= 0
        assert r["iops"] > 0 and r["cpu_us_per_op"] >= 0, r
        for k in ("gbps", "iops", "cpu_us_per_op"):
            assert r[f"{k}_min"] <= r[k] <= r[f"{k}_max"], (k, r)


def test_store_bench_smoke(tmp_path):
    rows, stdout = _run("store", tmp_path)
    _check_common(rows, "store")
    ops = {(r["op"], r["system"]) for r in rows}
    for want in [("put", "umbp_store"), ("put", "umbp_uring"), ("get", "umbp_store"), ("get", "umbp_uring"),
                 ("exists", "umbp_store"), ("exists", "umbp_store_ro"), ("reopen", "umbp_store")]:
        assert want in ops, f"no {want} row; rows: {sorted(ops)}"
    for r in rows:
        if r["op"] in ("put", "get"):
            assert r["gbps"] > 0 and r["object_bytes"] % 4096 == 0
            assert r["buffers"] in ("4k", "huge")
            if r["system"] == "umbp_store":
                assert r["vs_umbp_uring"] > 0
        else:
            assert r["latency_us_p50"] > 0 and r["objects"] > 0
            assert r["latency_us_p50_min"] <= r["latency_us_p50"] <= r["latency_us_p50_max"]
        if r["op"].startswith("reopen"):
            assert r["seconds_p50"] > 0
    assert "bench target:" in stdout and "NOT MET" not in stdout
    assert all(r["verify_crc"] is True for r in rows if r["op"] in ("put", "get")), "the default verifies"
    assert "verify_crc on" in stdout


def test_store_bench_prints_the_issue_targets_per_size():
    from umbp_nvme.bench.store import targets

    row = dict(system="umbp_store", buffers="4k", vs_umbp_uring=0.87)
    lines = targets([dict(row, op="put", object_bytes=64 << 10), dict(row, op="put", object_bytes=1 << 20),
                     dict(row, op="get", object_bytes=64 << 10)])  # fmt: skip
    assert lines == [
        "put 64 KiB 4k: store/raw = 0.870 (target >= 0.85) MET",
        "put 1024 KiB 4k: store/raw = 0.870 (target >= 0.9) NOT MET",
        "get 64 KiB 4k: store/raw = 0.870 (target >= 0.9) NOT MET",
    ]


def test_store_bench_no_verify_opens_stores_without_the_get_crc(tmp_path):
    rows, stdout = _run("store", tmp_path, "--ops", "put,get", "--buffers", "4k", "--no-verify")
    _check_common(rows, "store")
    systems = {"umbp_store", "umbp_uring"} | ({"nixl_posix"} if nixl_posix.load_error() is None else set())
    assert {(r["op"], r["system"]) for r in rows} == {(op, s) for op in ("put", "get") for s in systems}
    assert all(r["verify_crc"] is False for r in rows)
    assert "verify_crc off (--no-verify)" in stdout
    assert ("nixl_posix: not run" in stdout) == ("nixl_posix" not in systems)


def test_store_bench_roots_smoke(tmp_path):
    """--roots: rows for 1, 2 and 4 drives with the N x 1-drive ratio (directories on one disk here)."""
    roots = [str(tmp_path / f"r{i}") for i in range(4)]
    for r in roots:
        os.makedirs(r)
    rows, stdout = _run("store", tmp_path, "--roots", ",".join(roots))
    _check_common(rows, "store")
    assert sorted((r["op"], r["drives"]) for r in rows) == [("get", 1), ("get", 2), ("get", 4),
                                                            ("put", 1), ("put", 2), ("put", 4)]
    for r in rows:
        assert r["gbps"] > 0 and (r["vs_n_x_1drive"] is None) == (r["drives"] == 1)
    assert "x N x 1-drive" in stdout
    assert all(os.listdir(r) == [] for r in roots)  # the bench removes its stores


@pytest.mark.skipif(not sglang_env.sglang_installed(), reason="sglang is not installed (tools/install_sglang.sh)")
def test_hicache_bench_smoke(tmp_path):
    rows, stdout = _run("hicache", tmp_path)
    if "skipped: sglang is not importable" in stdout:
        assert rows == []
        pytest.skip(stdout.strip().splitlines()[-1])
    _check_common(rows, "hicache")
    ops = {(r["op"], r["system"]) for r in rows}
    for op in ("set", "get"):
        for system in ("umbp_nvme_backend", "hicache_file"):
            assert (op, system) in ops, f"no {op}/{system} row; rows: {sorted(ops)}"
    for system in ("umbp_nvme_backend", "hicache_file"):
        assert ("exists", system) in ops
    for r in rows:
        assert r["shape"] == "tiny" and r["page_bytes"] == 2 * r["object_bytes"], r
        if r["op"] in ("set", "get"):
            assert r["gbps"] > 0
            if r["system"] == "umbp_nvme_backend":
                assert r["vs_hicache_file"] > 0
            if r["op"] == "set" and not r["system"].startswith("fio"):
                assert r["sync_s"] >= 0 and r["gbps_incl_sync"] > 0
        if r["op"] == "exists":
            assert r["latency_us_p50"] > 0


def test_hicache_bench_without_sglang_exits_zero(tmp_path):
    """UMBP_BENCH_NO_SGLANG hides sglang: the benchmark says so, writes [] and exits 0."""
    out = tmp_path / "h.json"
    env = dict(os.environ, UMBP_BENCH_NO_SGLANG="1")
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "bench_hicache.py"), "--smoke", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped: sglang is not importable" in proc.stdout
    assert json.loads(out.read_text()) == []
