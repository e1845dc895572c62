"""`bench hicache`'s anchors and verdict: the fio jobs it compares against, the page-cache facts
that decide whether HiCacheFile's set time means anything, the ratios and the target lines.

fio. A batch_get_v1 / batch_set_v1 call is synchronous: SGLang hands over one batch (2 objects
per page) and waits for all of it before the next call. The like-for-like fio job does the same:
``--iodepth=N --iodepth_batch_submit=N --iodepth_batch_complete_min=N`` with N = one call's
objects, same object size, O_DIRECT, io_uring, shmhuge buffers for hugetlb pools (rows
``fio_batch`` / ``fio_huge_batch``); ``vs_fio`` is against it. The streaming jobs (``--fio-qd``,
each keeping its depth in flight all the time) are the device's ceiling for the object size:
``vs_fio_best`` is against the fastest of them in the same round. The deepest streaming job alone
(the anchor before) was neither: on a disk with fewer tags than its depth (this virtio disk: 128
per hardware queue) io_uring hands the excess to io-wq threads and the deepest job is the slowest
(128 KiB randread, one run: qd 32 3.05, qd 128 2.93, qd 256 2.45 GB/s).

Page cache. HiCacheFile writes buffered files and never syncs. While what it wrote stays under
the kernel's dirty background threshold, none of it is on disk when batch_set returns (measured:
all 2 GiB of a sample still dirty, none under writeback) and its set times a memcpy plus whatever
dirty throttling the kernel applies (0.3-1.8 GiB/s within one 2 GiB sample). set / hicache_file
is then no backup-to-disk comparison: the verdict says so and gives the ratio with both on disk
(each system's set plus a syncfs right after).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess

from .common import Sample, Skip, paired_ratio

UMBP, HIFILE = "umbp_nvme_backend", "hicache_file"


def run_fio_batch(fio: str, path: str, file_size: int, op: str, size: int, depth: int, huge: bool,
                  duration_s: float) -> Sample:
    """fio as one synchronous call does I/O: ``depth`` ops submitted together, the next batch once
    all of them completed. Skip when fio fails."""
    cmd = [
        fio, "--name=batch", f"--filename={path}", f"--size={file_size}",
        f"--rw={'randread' if op == 'read' else 'randwrite'}", f"--bs={size}", f"--iodepth={depth}",
        f"--iodepth_batch_submit={depth}", f"--iodepth_batch_complete_min={depth}",
        "--ioengine=io_uring", "--direct=1", "--time_based", f"--runtime={max(1, int(duration_s * 1000))}ms",
        "--allow_file_create=0", "--randrepeat=0", "--norandommap", "--output-format=json",
    ]  # fmt: skip
    if huge:
        cmd += ["--iomem=shmhuge", "--hugepage-size=2m"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s * 10 + 60)
    except subprocess.TimeoutExpired as e:
        raise Skip(f"fio batch job ran past {e.timeout:.0f} s") from None
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise Skip(f"fio exited {proc.returncode}: {msg[-1] if msg else ''}")
    out = proc.stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]  # fio may print warnings before the JSON
    side = job["read" if op == "read" else "write"]
    runtime_s = job["job_runtime"] / 1000.0
    return Sample(nbytes=int(side["io_bytes"]), ops=int(side["total_ios"]), wall_s=side["runtime"] / 1000.0,
                  cpu_s=(job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s)


def dirty_background_bytes() -> int | None:
    """The dirty bytes above which the kernel starts writing back: vm.dirty_background_bytes, or
    vm.dirty_background_ratio of MemAvailable (close to the kernel's dirtyable memory); None if unknown."""
    try:
        with open("/proc/sys/vm/dirty_background_bytes") as f:
            b = int(f.read())
        if b > 0:
            return b
        with open("/proc/sys/vm/dirty_background_ratio") as f:
            ratio = int(f.read())
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        return avail * ratio // 100
    except (OSError, ValueError, StopIteration):
        return None


def best_per_round(runs: list[list[Sample]]) -> list[Sample]:
    """Round by round, the fastest of several jobs' samples (jobs with fewer rounds drop out)."""
    rounds = min((len(r) for r in runs), default=0)
    return [max((r[i] for r in runs), key=lambda s: s.gbps) for i in range(rounds)]


def ratio_fields(samples: dict, extra: dict, op: str, system: str, fio_name: str, qds: list[int],
                 batch_label: str | None) -> dict:
    """The ratio columns of one of our rows (or HiCacheFile's), each paired per round."""
    ss = samples[(op, system)]
    streams = [samples[(op, f"{fio_name}@{qd}")] for qd in qds if samples.get((op, f"{fio_name}@{qd}"))]
    batch = samples.get((op, batch_label)) if batch_label else None
    out = {
        "vs_fio": paired_ratio(ss, batch) if batch else None,
        "vs_fio_best": paired_ratio(ss, best_per_round(streams)) if streams else None,
        "vs_hicache_file": paired_ratio(ss, samples[(op, HIFILE)]) if system != HIFILE and samples.get((op, HIFILE)) else None,
    }
    if op == "set":
        syncs = extra[("sync_s", system)]
        incl = [s.nbytes / (s.wall_s + y) / 1e9 for s, y in zip(ss, syncs)]
        out["sync_s"] = statistics.median(syncs)
        out["gbps_incl_sync"] = statistics.median(incl)
        if system != HIFILE and ("sync_s", HIFILE) in extra:
            hf = samples[(op, HIFILE)]
            hf_incl = [s.nbytes / (s.wall_s + y) / 1e9 for s, y in zip(hf, extra[("sync_s", HIFILE)])]
            out["vs_hicache_file_incl_sync"] = statistics.median(a / b for a, b in zip(incl, hf_incl) if b > 0)
        if system == HIFILE:
            limit = dirty_background_bytes()
            out["dirty_background_bytes"] = limit
            out["in_page_cache"] = limit is not None and ss[0].nbytes <= limit
    return out


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _met(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def targets(rows: list[dict]) -> list[str]:
    """One verdict line per (shape, memory kind) and target; ratios that do not measure the
    target say why instead of a bare NOT MET."""
    out = []
    hf_set = {(r["shape"], r["buffers"]): r for r in rows if r["system"] == HIFILE and r["op"] == "set"}
    for r in rows:
        if r["system"] != UMBP:
            continue
        tag = f"{r['shape']} {r['buffers']}"
        if r["op"] == "get" and (r.get("vs_fio") is not None or r.get("vs_fio_best") is not None):
            v, best = r.get("vs_fio"), r.get("vs_fio_best")
            head = (f"cold get / fio (one call's {2 * r['queue_depth']} objects at once, like for like) = {v:.2f} "
                    f"(>= 0.9) {_met(v >= 0.9)}") if v is not None else "cold get: no like-for-like fio job"
            tail = f"; / best streaming fio = {best:.2f}" if best is not None else ""
            hf = r.get("vs_hicache_file")
            out.append(f"{tag}: " + head + tail + (f"; / hicache_file = {hf:.2f}" if hf is not None else ""))
        if r["op"] == "set" and r.get("vs_hicache_file") is not None:
            v, incl = r["vs_hicache_file"], r.get("vs_hicache_file_incl_sync")
            hf = hf_set.get((r["shape"], r["buffers"]), {})
            if hf.get("in_page_cache"):
                size = _mib(hf["pages_per_sample"] * hf["page_bytes"])
                line = (f"set / hicache_file = {v:.2f}: not comparable (HiCacheFile's {size} sample stays in the "
                        f"page cache, under the {_mib(hf['dirty_background_bytes'])} dirty background threshold: "
                        f"its set times a memcpy and dirty throttling, nothing reaches the disk)")
                if incl is not None:
                    line += f"; both on disk (set + syncfs): {incl:.2f} (>= 3) {_met(incl >= 3)}"
                out.append(f"{tag}: {line}")
            else:
                out.append(f"{tag}: set / hicache_file = {v:.2f} (>= 3) {_met(v >= 3)}"
                           + (f"; both on disk (set + syncfs): {incl:.2f}" if incl is not None else ""))
        if r["op"] == "exists":
            v = r["latency_us_p50"]
            out.append(f"{tag}: batch_exists({r['queue_depth']}) p50 = {v:.1f} us (<= 150) {_met(v <= 150)}")
    return out


def fio_batch_label(fio_name: str, depth: int) -> str:
    return f"{fio_name}_batch@{depth}"


def run_fio_batch_for(cfg, fio_path: str, op: str, rw: str, obj: int, depth: int, huge: bool) -> Sample:
    """The like-for-like job with the benchmark's fio settings (see the module docstring)."""
    if not os.path.exists(fio_path):
        raise Skip(f"fio test file {fio_path} is missing")
    return run_fio_batch(cfg.fio, fio_path, cfg.fio_file_size, rw, obj, depth, huge, cfg.fio_duration)
