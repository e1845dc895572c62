"""``bench store --device ram``: the store, the raw engine, NIXL POSIX and fio on a RAM-backed
loop device (bench/ramdev.py), where the device is not the bottleneck and CPU per object decides.

Besides the put / get rows of bench/store_tput.py (on the RAM device, every get's bytes checked)
it measures, in the same process and run:
  crc32c   CPU per object of one ``crc32c_many`` call over a batch's objects in the benchmark's
           own memory (the part of the store's CPU that is checksum, not bookkeeping);
  fio      4 KiB random reads, io_uring, O_DIRECT, at the store's batch size as queue depth, on
           a file on the same device (CPU per op from fio's own usr+sys over its runtime).
The targets (issue 36): 64 KiB put and get >= 0.9x the raw engine and NIXL; store CPU per
64 KiB object less the CRC's <= 6 us; a 4 KiB get's CPU <= 1.2x fio's; 0 wrong bytes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import types

import numpy as np

from .common import Sample, Skip, finish, make_row, print_table
from .engine import Memory, make_test_file, run_fio
from .ramdev import RamDevice, RamDeviceError, why_not

from umbp_nvme import _uring

BENCH = "store"
FIO_FILE_BYTES = 256 << 20
FIO_DURATION_S = 1.0
SLACK_BYTES = 512 << 20  # ext4's own blocks, the journal, the store's index
KiB = 1 << 10
TARGETS = {"vs_raw": 0.9, "vs_nixl": 0.9, "cpu_beside_crc_us": 6.0, "get4k_vs_fio_cpu": 1.2}


def device_bytes(cfg) -> int:
    """The RAM device's size: the throughput store's capacity, fio's file and slack."""
    n_obj = cfg.batch_pages * 2
    sample_cap = max(max(cfg.sample_bytes, n_obj * s) for s in cfg.sizes)
    seg = cfg.segment_bytes
    capacity = -(-int(sample_cap * 1.5 + 4 * seg) // seg) * seg
    return capacity + FIO_FILE_BYTES + SLACK_BYTES


def crc_rows(cfg) -> list[dict]:
    """CPU per object of the CRC over one batch of each size, from ordinary memory (not in cache:
    the batch is larger than the caches for 64 KiB and up, as the store's batches are)."""
    n_obj = cfg.batch_pages * 2
    rows = []
    mem = Memory(n_obj * max(cfg.sizes), ["4k"], [])
    try:
        buf = mem.bufs["4k"]
        buf.array[:] = 1
        for size in cfg.sizes:
            addrs = np.uint64(buf.address) + np.arange(n_obj, dtype=np.uint64) * np.uint64(size)
            lens = np.full(n_obj, size, np.int64)
            out = np.empty(n_obj, np.uint32)
            samples = []
            for _ in range(max(3, cfg.runs)):
                buf.array[:: 4096] += 1  # each pass reads memory a write has touched since, as a get does
                c0, w0 = time.process_time(), time.perf_counter()
                _uring.crc32c_many(addrs, lens, out)
                samples.append(Sample(n_obj * size, n_obj, time.perf_counter() - w0, time.process_time() - c0))
            rows.append(make_row(BENCH, "crc32c", "crc", size, n_obj, samples, buffers="4k"))
    finally:
        mem.close()
    return rows


def fio_rows(cfg, directory: str, notes: list[str]) -> list[dict]:
    """fio's 4 KiB random reads on the RAM device, queue depth = the store's objects per call."""
    fio = shutil.which("fio")
    if fio is None:
        notes.append("fio not on PATH: no fio row (apt-get install fio)")
        return []
    qd = cfg.batch_pages * 2
    path = os.path.join(directory, "fio-4k.dat")
    make_test_file(path, FIO_FILE_BYTES)
    fcfg = types.SimpleNamespace(fio=fio, duration=FIO_DURATION_S)
    samples = []
    try:
        for _ in range(cfg.runs):
            samples.append(run_fio(path, FIO_FILE_BYTES, "read", 4096, qd, False, fcfg))
    except Skip as e:
        notes.append(f"fio: {e}")
        return []
    finally:
        os.unlink(path)
    notes.append(f"fio: --rw=randread --bs=4k --iodepth={qd} --ioengine=io_uring --direct=1, {FIO_DURATION_S:g} s "
                 f"per run on a {FIO_FILE_BYTES >> 20} MiB file on the RAM device")
    return [make_row(BENCH, "fio", "get", 4096, qd, samples, buffers="4k")]


def run(cfg, bench) -> tuple[list[dict], list[str]]:
    """Set up the RAM device, run ``bench(cfg)`` (bench/store.py's) and the extra rows on it."""
    why = why_not()
    if why:
        raise SystemExit(f"bench store: {why}")
    size = device_bytes(cfg)
    print(f"bench store --device ram: a {size >> 20} MiB RAM-backed ext4 (tmpfs file + loop device), "
          "torn down at the end", flush=True)
    try:
        with RamDevice(size) as dev:
            cfg.dir, cfg.keep = dev.mount, False
            rows, notes = asyncio.run(bench(cfg))
            rows += fio_rows(cfg, dev.mount, notes)
            notes.append(f"device: {dev.loop} ({size >> 20} MiB ext4 on a tmpfs file), mounted at {dev.mount}")
    except RamDeviceError as e:
        raise SystemExit(f"bench store --device ram: {e}") from None
    rows += crc_rows(cfg)
    return rows, notes


def _row(rows, system, op, size, buffers=None):
    for r in rows:
        if (r["system"], r["op"], r["object_bytes"]) == (system, op, size) and buffers in (None, r.get("buffers")):
            return r
    return None


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["system"] != "umbp_store" or r["op"] not in ("put", "get"):
            continue
        what = f"{r['op']} {r['object_bytes'] // KiB} KiB {r['buffers']}"
        if r["object_bytes"] == 64 * KiB:
            for key, name in (("vs_umbp_uring", "vs_raw"), ("vs_nixl_posix", "vs_nixl")):
                v = r.get(key)
                if v is not None:
                    t = TARGETS[name]
                    out.append(f"{what}: store/{name[3:]} = {v:.3f} (target >= {t}) {'MET' if v >= t else 'NOT MET'}")
            crc = _row(rows, "crc32c", "crc", r["object_bytes"])
            if crc is not None:
                v = r["cpu_us_per_op"] - crc["cpu_us_per_op"]
                t = TARGETS["cpu_beside_crc_us"]
                out.append(f"{what}: CPU per object {r['cpu_us_per_op']:.1f} us, {v:.1f} us beside the CRC's "
                           f"{crc['cpu_us_per_op']:.1f} (target <= {t:g}) {'MET' if v <= t else 'NOT MET'}")
        if r["op"] == "get" and "wrong_bytes" in r:
            bad = sum(x.get("wrong_bytes", 0) for x in rows if x["op"] == "get" and x["object_bytes"] == r["object_bytes"]
                      and x.get("buffers") == r.get("buffers"))
            out.append(f"{what}: wrong bytes, all systems = {bad} (target 0) {'MET' if bad == 0 else 'NOT MET'}")
    fio = _row(rows, "fio", "get", 4096)
    for r in rows:
        if fio and r["system"] == "umbp_store" and r["op"] == "get" and r["object_bytes"] == 4096:
            v = r["cpu_us_per_op"] / fio["cpu_us_per_op"] if fio["cpu_us_per_op"] else float("inf")
            t = TARGETS["get4k_vs_fio_cpu"]
            out.append(f"get 4 KiB {r['buffers']}: CPU per object {r['cpu_us_per_op']:.1f} us vs fio's "
                       f"{fio['cpu_us_per_op']:.1f} = {v:.2f}x (target <= {t}) {'MET' if v <= t else 'NOT MET'}")
    return out


def report(cfg, rows: list[dict], notes: list[str], seconds: float) -> None:
    print(f"store benchmark on a RAM device: {len(rows)} rows, {cfg.runs} alternating runs, {cfg.batch_pages} pages "
          f"x 2 objects per call, {seconds:.0f} s total")
    print_table([r for r in rows if r["op"] in ("put", "get", "crc")], ratio_keys=("vs_umbp_uring", "vs_nixl_posix"))
    bad = [f"{r['system']} {r['op']} {r['object_bytes']} {r.get('buffers')}: {r['wrong_bytes']}"
           for r in rows if r.get("wrong_bytes")]
    print("wrong bytes: " + ("; ".join(bad) if bad else f"0 in every get ({sum(1 for r in rows if 'wrong_bytes' in r)} rows)"))
    finish(cfg, rows, notes, targets=targets(rows), title="PageStore vs raw engine vs NIXL on a RAM device",
           source="issue 36")
