"""`umbp-nvme doctor`: every item on this machine, each with a fix where needed, and forced fallbacks named as such."""

from __future__ import annotations

import errno
import json
import os
import resource

import pytest

from umbp_nvme.doctor import report as doctor
from umbp_nvme.cli.main import main
from umbp_nvme.engine import files as engine_files

ITEMS = {"io_uring", "engine", "o_direct", "memlock", "hugepages", "filesystem", "scheduler", "gpu", "probe", "session", "page_hash"}
SHM = "/dev/shm"


def run_doctor(capsys, *args) -> tuple[int, dict]:
    rc = main(["doctor", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def finding(r: dict, item: str) -> list[dict]:
    return [f for f in r["findings"] if f["item"] == item]


def test_doctor_json_reports_every_item_with_a_fix_for_each_problem(tmp_path, capsys):
    # No bound on elapsed time (it was < 15 s; this loaded 2-core machine took 8.3 s): the probe's
    # phases are time-boxed (4 x PROBE_SECONDS), the report says how long each item took, and a
    # hang is pytest-timeout's.
    rc, r = run_doctor(capsys, "--store", str(tmp_path / "store"))
    assert rc == 0 and set(r["items"]) == ITEMS
    assert {f["item"] for f in r["findings"]} == ITEMS  # each item says something
    assert all(f["fix"] for f in r["findings"] if f["level"] in ("warn", "fail"))
    assert not any("check itself failed" in f["message"] for f in r["findings"])
    p = r["items"]["probe"]
    for k in ("store_write_gbps", "store_read_gbps", "raw_write_gbps", "raw_read_gbps"):
        assert p[k] > 0, k
    assert p["write_fraction_of_raw"] > 0 and p["read_fraction_of_raw"] > 0
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert r["items"]["memlock"]["soft_bytes"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert "reason" in r["items"]["engine"] and r["items"]["gpu"]["detail"]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".umbp-doctor")]  # scratch removed


def test_io_uring_disabled_by_the_environment_is_named_as_a_fallback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UMBP_NVME_FORCE_NO_URING", "1")
    rc, r = run_doctor(capsys, "--store", str(tmp_path), "--no-probe")
    e = r["items"]["engine"]
    assert e["chosen"] == "posix" and e["asked"] == "io_uring" and e["fallback"] is True
    assert "UMBP_NVME_FORCE_NO_URING" in e["reason"]
    (f,) = finding(r, "engine")
    assert f["level"] == "warn" and "fallback" in f["message"] and "UMBP_NVME_FORCE_NO_URING" in f["fix"]


def test_posix_asked_in_the_config_is_a_choice_not_a_fallback(tmp_path, capsys):
    rc, r = run_doctor(capsys, "--store", str(tmp_path), "--no-probe", "--config", '{"ssd_io_backend": "posix"}')
    e = r["items"]["engine"]
    assert e == {**e, "asked": "posix", "chosen": "posix", "fallback": False}
    (f,) = finding(r, "engine")
    assert f["level"] == "info" and "config" in f["message"]


@pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")
def test_a_tmpfs_store_is_named_ram_and_its_o_direct_is_what_the_kernel_does(capsys):
    store = os.path.join(SHM, f"umbp-doctor-test-{os.getpid()}")
    rc, r = run_doctor(capsys, "--store", store, "--no-probe")
    fs = r["items"]["filesystem"]
    if fs["fs_type"] != "tmpfs":
        pytest.skip(f"{SHM} is {fs['fs_type']} here")
    assert any(f["level"] == "warn" and "RAM" in f["message"] for f in finding(r, "filesystem"))
    od = r["items"]["o_direct"]
    assert od["direct"] == od["kernel_accepts"]  # tmpfs takes O_DIRECT since Linux 6.6
    assert r["items"]["scheduler"]["scheduler"] is None  # no block device under tmpfs


def test_o_direct_refused_by_the_file_system_is_named_as_a_buffered_fallback(tmp_path, capsys, monkeypatch):
    # tmpfs before Linux 6.6 (and overlay, many FUSE mounts) fail open(O_DIRECT) with EINVAL
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *a, **kw)

    engine_files.forget_direct_refusals()  # the refusal is remembered per device: before and after
    monkeypatch.setattr(os, "open", no_direct)
    try:
        r = doctor.report(str(tmp_path), probe=False)
    finally:
        engine_files.forget_direct_refusals()
    od = r["items"]["o_direct"]
    assert od["asked"] is True and od["direct"] is False and od["kernel_accepts"] is False
    assert "EINVAL" in od["error"]
    (f,) = finding(r, "o_direct")
    assert f["level"] == "warn" and "buffered I/O (fallback)" in f["message"] and "EINVAL" in f["message"]
    assert "ext4 or xfs" in f["fix"]


def test_the_text_form_puts_a_fix_under_each_problem(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UMBP_NVME_FORCE_NO_URING", "1")
    assert main(["doctor", "--store", str(tmp_path), "--no-probe"]) == 0
    out = capsys.readouterr().out.splitlines()
    i = next(i for i, ln in enumerate(out) if "[warn] engine" in ln)
    assert "fix: unset UMBP_NVME_FORCE_NO_URING" in out[i + 1]


def test_doctor_at_start_logs_one_block_that_checks_the_host_pool(tmp_path, caplog):
    import logging

    from support.standin_pools import Config, FakeMHAPool
    from umbp_nvme.sglang.backend import UMBPNvmeStore

    cfg = Config(str(tmp_path / "s"))
    cfg.extra_config["doctor_at_start"] = True
    with caplog.at_level(logging.INFO, logger="umbp_nvme.doctor"):
        backend = UMBPNvmeStore(cfg, FakeMHAPool())
    try:
        blocks = [r.getMessage() for r in caplog.records if r.name == "umbp_nvme.doctor"]
        assert len(blocks) == 1 and blocks[0].startswith("umbp-nvme doctor: ")
        assert "[" in blocks[0] and "engine" in blocks[0] and "probe" not in blocks[0]  # no I/O probe at start
        assert "hugepage" in blocks[0] and "host pool" in blocks[0]
        assert not any("unknown extra_config key" in r.getMessage() for r in caplog.records)
    finally:
        backend.close()


def test_the_host_pool_ranges_are_checked_for_hugepages():
    from umbp_nvme.buffers import AlignedBuffer

    with AlignedBuffer(4 << 20) as b:
        h = doctor.check_hugepages([], [(b.address, b.nbytes)])
    assert len(h["pool"]) == 1 and h["pool"][0]["kernel_page_kib"] == 4
    assert isinstance(h["pool_hugepage_backed"], bool)
