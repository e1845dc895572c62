"""Smoke test of ``bench mixed`` (issue 13): a tiny run in a child process, every cell present,
latencies and throughputs positive, the put stream's failures reported, ratios computed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_mixed_smoke_rows(tmp_path):
    out = tmp_path / "mixed.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "umbp_nvme.bench", "mixed", "--smoke", "--dir", str(tmp_path / "d"), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    cells = {(r["system"], r["op"], r["pattern"]) for r in rows if r["system"] != "fio"}
    want = {(s, op, p) for s in ("umbp_on", "umbp_off") for op in ("get_idle", "get_loaded") for p in ("b2b", "spaced")}
    assert cells == want
    runs = {(r["system"], r["pattern"], r["op"]): r["runs"] for r in rows}
    for r in rows:
        # smoke: blocks of 4 calls, more while no backup batch ended beside them; idle as many
        assert r["runs"] % 4 == 0 and 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert runs[r["system"], r["pattern"], "get_idle"] == runs[r["system"], r["pattern"], "get_loaded"]
        if r["op"] == "get_loaded":  # a backup batch ended inside both windows: never NaN
            assert r["vs_idle_p50"] > 0 and r["loop_p99_ms"] > 0
            assert r["put_gbps"] > 0 and r["put_solo_gbps"] > 0 and r["put_vs_solo"] > 0
        if r["system"] != "fio":  # physical runs per object of the backup's source / the gets' destination
            segs = (r["src_segs"], r["dst_segs"])
            assert all(1 <= v <= r["object_bytes"] // 4096 for v in segs) if os.geteuid() == 0 else segs == (None, None)
    assert "puts of the stream failed" not in proc.stdout
    assert "bench target (issue 13): umbp_on" in proc.stdout and "bench target (issue 13): umbp_off" in proc.stdout


def test_bench_mixed_sglang_path_reads_back_every_page(tmp_path):
    """Prefetch while backup through the real SGLang backend and host pool (skipped without sglang)."""
    import argparse

    import pytest

    pytest.importorskip("sglang")
    from umbp_nvme.bench.mixed_sglang import bench_sglang

    cfg = argparse.Namespace(knobs=["on"], sizes=[1 << 20], gets=[2], rounds=1, calls=3, warm_s=0.2, solo_s=0.3,
                             slice=8 << 20, crc_keys={})  # fmt: skip
    notes: list[str] = []
    rows = bench_sglang(cfg, str(tmp_path), notes)
    if any("no SGLang-path rows" in n for n in notes):
        pytest.skip(notes[0])
    assert not [n for n in notes if "failed" in n], notes
    assert {(r["system"], r["op"], r["pattern"]) for r in rows} == {
        ("sglang_on", op, p) for op in ("get_idle", "get_loaded") for p in ("b2b", "spaced")
    }
    for r in rows:  # every get was checked byte for byte against the page it was backed up from
        assert r["gets"] == 2 and r["runs"] % 3 == 0 and 0 < r["p50_ms"] <= r["p99_ms"]
        if r["op"] == "get_loaded":  # the backup's own GB/s, alone and beside the gets: never NaN
            assert r["put_solo_gbps"] > 0 and r["put_gbps"] > 0 and r["put_vs_solo"] > 0
            assert r["loop_p99_ms"] > 0  # the no-op hop onto the backend's store loop was timed
        segs = (r["src_segs"], r["dst_segs"])  # physical runs per K/V object (pagemap: root only)
        assert all(1 <= v <= 256 for v in segs) if os.geteuid() == 0 else segs == (None, None)


def test_bench_mixed_sglang_check_catches_wrong_and_unwritten_bytes(tmp_path):
    """The in-place check (memset before, memcmp of K and V views after) fails a get that flips
    one byte, and one that reports success without writing (stale bytes of an earlier get)."""
    import pytest

    pytest.importorskip("sglang")
    from umbp_nvme.bench import mixed_sglang as ms
    from umbp_nvme.bench.hicache import load_sglang

    be = ms.Backend(load_sglang(), str(tmp_path / "s"), 1 << 20, 2, "on", 8 << 20, {})
    try:
        real = be.backend.batch_get_v1
        assert be.get([3, 7]) > 0 and be.get([3, 7]) > 0  # real reads pass, twice into the same slots
        dst = be.views[ms.READ_PAGES + ms.BACKUP_PAGES + 1][1]  # V object of the second destination page
        assert bytes(dst.view(-1).view(torch_uint8()).numpy()[:64]) == bytes(
            be.views[7][1].view(-1).view(torch_uint8()).numpy()[:64])

        def flip(keys, slots):
            ok = real(keys, slots)
            flat = dst.view(-1).view(torch_uint8())
            flat[flat.numel() - 1] ^= 1  # the last byte of the last object
            return ok

        be.backend.batch_get_v1 = flip
        with pytest.raises(RuntimeError, match=r"page read-1048576-7 read back wrong bytes \(V object\)"):
            be.get([3, 7])
        be.backend.batch_get_v1 = lambda keys, slots: [True] * len(keys)  # claims success, writes nothing
        with pytest.raises(RuntimeError, match="page read-1048576-3 read back wrong bytes"):
            be.get([3, 7])
        be.backend.batch_get_v1 = real
        assert be.get([7, 3]) > 0
    finally:
        be.close()


def torch_uint8():
    import torch

    return torch.uint8


def test_bench_mixed_thp_buffer_is_aligned_writable_and_parsed():
    """--memory thp: the store path's buffers madvised for 2 MiB pages (bench mixed, docs/benchmarks.md)."""
    from umbp_nvme.bench import mixed

    assert mixed.parse_args([]).memory == "4k" and mixed.parse_args(["--memory", "thp"]).memory == "thp"
    b = mixed.ThpBuffer(3 << 20)
    try:
        assert b.address % (2 << 20) == 0 and b.array.nbytes == 3 << 20
        b.array[:] = 7
        assert int(b.array.sum()) == 7 * (3 << 20)
        runs = mixed.mean_runs(b.address, 2 << 20, 2 << 20)
        assert runs is None or 1 <= runs <= 512  # None: not root (pagemap hides PFNs)
    finally:
        b.close()
