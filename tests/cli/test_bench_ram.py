"""bench store --device ram: the RAM device's set-up and tear-down, the refusal without root, the
run's rows (every get's bytes checked) and the issue-36 target lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from umbp_nvme.bench import ramdev, store_ram

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_ram = pytest.mark.skipif(ramdev.why_not() is not None, reason=str(ramdev.why_not()))


def _mounted(path: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == path for line in f)


def _loop_attached(dev: str) -> bool:
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return any(line.startswith(dev + ":") for line in out.splitlines())


def test_without_root_the_refusal_says_what_is_needed(monkeypatch):
    monkeypatch.setattr(ramdev.os, "geteuid", lambda: 1000)
    why = ramdev.why_not()
    assert why is not None and "needs root" in why and "--dir" in why
    with pytest.raises(ramdev.RamDeviceError, match="needs root"):
        with ramdev.RamDevice(64 << 20):
            pass


def test_too_small_a_device_is_refused():
    with pytest.raises(ValueError, match="at least 64 MiB"):
        ramdev.RamDevice(1 << 20)


@needs_ram
def test_ram_device_holds_files_and_is_torn_down():
    with ramdev.RamDevice(96 << 20) as dev:
        loop, mnt, base = dev.loop, dev.mount, dev.base
        assert _mounted(mnt) and _loop_attached(loop)
        data = os.urandom(1 << 20)
        with open(os.path.join(mnt, "f"), "wb") as f:
            f.write(data)
        with open(os.path.join(mnt, "f"), "rb") as f:
            assert f.read() == data
    assert not _mounted(mnt) and not _mounted(os.path.join(base, "tmpfs"))
    assert not _loop_attached(loop) and not os.path.exists(base)


@needs_ram
def test_ram_device_is_torn_down_after_an_error_with_a_file_left_open():
    with pytest.raises(RuntimeError, match="boom"):
        with ramdev.RamDevice(96 << 20) as dev:
            loop, mnt = dev.loop, dev.mount
            held = open(os.path.join(mnt, "open"), "wb")  # a crashed run's descriptor: the mount is busy
            raise RuntimeError("boom")
    held.close()
    assert not _mounted(mnt)


def test_targets_judge_ratios_cpu_beside_the_crc_fio_and_wrong_bytes():
    kib64 = 64 << 10
    store = dict(system="umbp_store", buffers="4k", object_bytes=kib64, wrong_bytes=0)
    rows = [
        dict(store, op="get", vs_umbp_uring=0.95, vs_nixl_posix=0.85, cpu_us_per_op=12.0),
        dict(system="umbp_uring", op="get", buffers="4k", object_bytes=kib64, wrong_bytes=3, cpu_us_per_op=2.0),
        dict(system="crc32c", op="crc", buffers="4k", object_bytes=kib64, cpu_us_per_op=5.0),
        dict(store, op="get", object_bytes=4096, cpu_us_per_op=4.4, vs_umbp_uring=1.0),
        dict(system="fio", op="get", buffers="4k", object_bytes=4096, cpu_us_per_op=4.0),
    ]
    assert store_ram.targets(rows) == [
        "get 64 KiB 4k: store/raw = 0.950 (target >= 0.9) MET",
        "get 64 KiB 4k: store/nixl = 0.850 (target >= 0.9) NOT MET",
        "get 64 KiB 4k: CPU per object 12.0 us, 7.0 us beside the CRC's 5.0 (target <= 6) NOT MET",
        "get 64 KiB 4k: wrong bytes, all systems = 3 (target 0) NOT MET",
        "get 4 KiB 4k: wrong bytes, all systems = 0 (target 0) MET",
        "get 4 KiB 4k: CPU per object 4.4 us vs fio's 4.0 = 1.10x (target <= 1.2) MET",
    ]


def test_dir_with_device_ram_is_a_usage_error():
    from umbp_nvme.bench.store import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device", "ram", "--dir", "/tmp/x"])


@needs_ram
def test_bench_store_device_ram_smoke(tmp_path):
    out = tmp_path / "ram.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "umbp_nvme.bench", "store", "--device", "ram", "--smoke", "--buffers", "4k",
         "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    gets = [r for r in rows if r["op"] == "get" and r["system"] in ("umbp_store", "umbp_uring")]
    assert {(r["system"], r["object_bytes"]) for r in gets} == {
        (s, n) for s in ("umbp_store", "umbp_uring") for n in (4096, 64 << 10)}
    assert all(r["wrong_bytes"] == 0 for r in rows if "wrong_bytes" in r)
    assert {r["object_bytes"] for r in rows if r["system"] == "crc32c"} == {4096, 64 << 10}
    assert all(r["cpu_us_per_op"] > 0 for r in rows if r["system"] == "crc32c")
    assert "wrong bytes: 0 in every get" in proc.stdout
    assert "bench target (issue 36): get 64 KiB 4k: store/raw" in proc.stdout
    assert "umbp-ramdev-" in proc.stdout  # the note names the mount
    mnt = next(line.split("mounted at ")[1].strip() for line in proc.stdout.splitlines() if "mounted at" in line)
    assert not _mounted(mnt) and not os.path.exists(os.path.dirname(mnt))
