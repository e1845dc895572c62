"""bench hicache's anchors and verdict (umbp_nvme/bench/hicache_fio.py): which fio job each ratio
is against, when HiCacheFile's set time is no backup-to-disk figure, and what the target lines say."""

from __future__ import annotations

import os
import shutil

import pytest

from umbp_nvme.bench import hicache_fio as hv
from umbp_nvme.bench.common import Sample, Skip

MiB = 1 << 20


def s(gbps: float, nbytes: int = 1000 * MiB) -> Sample:
    return Sample(nbytes=nbytes, ops=100, wall_s=nbytes / gbps / 1e9, cpu_s=0.01)


def samples_two_rounds():
    # round 0: qd 32 fastest; round 1: qd 128 fastest; batch job between
    return {
        ("get", hv.UMBP): [s(1.8), s(1.5)],
        ("get", hv.HIFILE): [s(0.6), s(0.5)],
        ("get", "fio_huge@32"): [s(3.0), s(2.0)],
        ("get", "fio_huge@128"): [s(2.5), s(2.5)],
        ("get", "fio_huge@256"): [s(2.2), s(1.9)],
        ("get", "fio_huge_batch@256"): [s(2.0), s(2.0)],
        ("set", hv.UMBP): [s(1.6), s(1.6)],
        ("set", hv.HIFILE): [s(1.8), s(0.4)],
    }


def test_best_per_round_takes_the_fastest_job_of_each_round():
    runs = [[s(3.0), s(2.0)], [s(2.5), s(2.5)], [s(1.0)]]
    best = hv.best_per_round(runs)
    assert len(best) == 1  # the job with one round bounds the pairing
    assert best[0].gbps == pytest.approx(3.0)
    best = hv.best_per_round(runs[:2])
    assert [round(b.gbps, 6) for b in best] == [3.0, 2.5]


def test_get_ratios_are_against_the_batch_job_and_the_best_stream():
    f = hv.ratio_fields(samples_two_rounds(), {}, "get", hv.UMBP, "fio_huge", [32, 128, 256], "fio_huge_batch@256")
    assert f["vs_fio"] == pytest.approx((1.8 / 2.0 + 1.5 / 2.0) / 2)
    assert f["vs_fio_best"] == pytest.approx((1.8 / 3.0 + 1.5 / 2.5) / 2)
    assert f["vs_hicache_file"] == pytest.approx((1.8 / 0.6 + 1.5 / 0.5) / 2)
    none = hv.ratio_fields(samples_two_rounds(), {}, "get", hv.UMBP, "fio_huge", [], None)
    assert none["vs_fio"] is None and none["vs_fio_best"] is None


def test_set_ratios_carry_the_on_disk_ratio_and_the_page_cache_flag(monkeypatch):
    smp = samples_two_rounds()
    extra = {("sync_s", hv.UMBP): [0.01, 0.01], ("sync_s", hv.HIFILE): [1.0, 1.0]}
    monkeypatch.setattr(hv, "dirty_background_bytes", lambda: 2048 * MiB)
    ours = hv.ratio_fields(smp, extra, "set", hv.UMBP, "fio", [], None)
    theirs = hv.ratio_fields(smp, extra, "set", hv.HIFILE, "fio", [], None)
    incl = [smp[("set", hv.UMBP)][i].nbytes / (smp[("set", hv.UMBP)][i].wall_s + 0.01) for i in range(2)]
    hf = [smp[("set", hv.HIFILE)][i].nbytes / (smp[("set", hv.HIFILE)][i].wall_s + 1.0) for i in range(2)]
    assert ours["vs_hicache_file_incl_sync"] == pytest.approx((incl[0] / hf[0] + incl[1] / hf[1]) / 2)
    assert ours["vs_hicache_file"] == pytest.approx((1.6 / 1.8 + 1.6 / 0.4) / 2)
    assert "in_page_cache" not in ours
    assert theirs["in_page_cache"] is True and theirs["dirty_background_bytes"] == 2048 * MiB
    monkeypatch.setattr(hv, "dirty_background_bytes", lambda: 512 * MiB)
    assert hv.ratio_fields(smp, extra, "set", hv.HIFILE, "fio", [], None)["in_page_cache"] is False
    monkeypatch.setattr(hv, "dirty_background_bytes", lambda: None)
    assert hv.ratio_fields(smp, extra, "set", hv.HIFILE, "fio", [], None)["in_page_cache"] is False


def _rows(in_page_cache: bool, vs_hf: float, incl: float) -> list[dict]:
    common = dict(shape="small", buffers="huge", queue_depth=128, pages_per_sample=1024, page_bytes=256 * 1024)
    return [
        dict(common, system=hv.HIFILE, op="set", in_page_cache=in_page_cache, dirty_background_bytes=2296 * MiB),
        dict(common, system=hv.UMBP, op="set", vs_hicache_file=vs_hf, vs_hicache_file_incl_sync=incl),
        dict(common, system=hv.UMBP, op="get", vs_fio=0.95, vs_fio_best=0.7, vs_hicache_file=2.4),
        dict(common, system=hv.UMBP, op="exists", latency_us_p50=24.0),
    ]


def test_verdict_says_not_comparable_when_the_file_backend_stayed_in_page_cache():
    lines = hv.targets(_rows(True, 0.79, 1.5))
    set_line = next(x for x in lines if "set / hicache_file" in x)
    assert set_line.startswith("small huge: set / hicache_file = 0.79: not comparable")
    assert "256 MiB sample" in set_line and "2296 MiB dirty background threshold" in set_line
    assert set_line.endswith("both on disk (set + syncfs): 1.50 (>= 3) NOT MET")
    assert "= 0.79 (>= 3)" not in set_line  # no bare verdict on the page-cache ratio
    assert hv.targets(_rows(True, 3.3, 4.0))[0].endswith("both on disk (set + syncfs): 4.00 (>= 3) MET")


def test_verdict_judges_the_plain_ratio_when_the_file_backend_reached_the_disk():
    lines = hv.targets(_rows(False, 2.5, 3.2))
    assert lines[0] == "small huge: set / hicache_file = 2.50 (>= 3) NOT MET; both on disk (set + syncfs): 3.20"
    get = lines[1]
    assert get.startswith("small huge: cold get / fio (one call's 256 objects at once, like for like) = 0.95 (>= 0.9) MET")
    assert "/ best streaming fio = 0.70" in get and "/ hicache_file = 2.40" in get
    assert lines[2] == "small huge: batch_exists(128) p50 = 24.0 us (<= 150) MET"


def test_dirty_background_bytes_follows_the_kernel_settings():
    got = hv.dirty_background_bytes()
    with open("/proc/sys/vm/dirty_background_bytes") as f:
        fixed = int(f.read())
    if fixed:
        assert got == fixed
    else:
        with open("/proc/sys/vm/dirty_background_ratio") as f:
            ratio = int(f.read())
        with open("/proc/meminfo") as f:
            avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
        assert got == pytest.approx(avail * ratio / 100, rel=0.05)  # MemAvailable moves a little


@pytest.mark.skipif(shutil.which("fio") is None, reason="fio is not on PATH")
def test_fio_batch_job_reads_whole_objects_and_refuses_a_missing_file(tmp_path):
    path = str(tmp_path / "f.dat")
    with open(path, "wb") as f:
        f.write(os.urandom(4 * MiB))
    got = hv.run_fio_batch(shutil.which("fio"), path, 4 * MiB, "read", 64 * 1024, 4, False, 0.2)
    assert got.ops > 0 and got.nbytes == got.ops * 64 * 1024 and got.wall_s > 0
    with pytest.raises(Skip, match="fio exited"):
        hv.run_fio_batch(shutil.which("fio"), str(tmp_path / "absent.dat"), 4 * MiB, "read", 65536, 4, False, 0.2)
