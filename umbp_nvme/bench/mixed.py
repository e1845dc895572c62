"""Mixed benchmark: what a prefetch (get) pays while a backup (put stream) saturates the disk.

    umbp-nvme bench mixed [--quick] -- [--dir DIR] [--sizes 1M,4M] [--gets 4,8] [--json PATH]
    python -m umbp_nvme.bench mixed [same args]   (or python -m umbp_nvme.bench.mixed [same args])

One ``SyncPageStore`` (strict durability, io_uring) per knob setting (``--knobs on,off``: "on" =
the defaults, ``ssd_read_priority=on`` and ``ssd_write_slice_bytes`` sliced; "off" = whole
batches, no ioprio). For each object size and objects per get call (G), in one run, a cell per
pattern ("b2b": get calls back to back; "spaced": one call every 4x the idle b2b p50, so gets use
about a quarter of the read bandwidth), each cell ``--rounds`` rounds of:

  put stream    48-object ``put_many`` batches back to back in a thread (each batch's keys deleted
                two batches later, so the store never fills); its GB/s alone (``put_solo_gbps``)
  get loaded    ``get_many`` of G random objects of a prefilled read set (cold: O_DIRECT) beside
                the stream; the stream's GB/s over the same window (``put_gbps``)
  get idle      the same gets with the stream stopped

Ratios (``vs_idle_p50``/``_p99``, ``put_vs_solo``) are taken within each round and their median
over rounds reported, so drift of a shared disk hits both sides alike; latencies are pooled.

``--sglang`` adds the same cells through the SGLang backend on real host pools (mixed_sglang.py).
``--fio`` adds the device's own anchor (fio, io_uring, O_DIRECT): a 4 MiB randread job at QD 1
alone, then beside a 4 MiB write job at QD 32, without and with ``prioclass=1`` on the reader.
Rows: bench "mixed", system ("umbp_on" | "umbp_off" | "fio"), op, object_bytes, gets, pattern,
p50_ms/p90_ms/p99_ms, vs_idle_p50/p99, put_gbps, put_vs_solo, loop_p99_ms (p99 of a no-op hop onto
the store's loop thread during the phase: what other work on the loop could add to a get),
src_segs / dst_segs (mean physically contiguous runs per object of the backup's source and the
gets' destination, from /proc/self/pagemap, root only: this disk takes 254 segments per request,
so an object on scattered 4 KiB pages costs the device more requests than one on long runs, and
the solo rates of runs and of the two paths differ with it; see bench/engine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ..buffers import AlignedBuffer
from ..config import CRC_POLICIES, StoreConfig
from ..engine import arbiter as arbiter_mod
from ..store.sync import SyncPageStore
from .common import WorkDir, finish, parse_bytes
from .engine import phys_runs
from .mixed_measure import SPACING_X, LoopProbe, loaded_gets, pct, row, solo_window

PUT_BATCH = 48


def parse_args(argv):
    p = argparse.ArgumentParser(prog="umbp-nvme bench mixed", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="store directory (default umbp-bench-mixed in the temp dir); what the run makes "
                   "there is removed at the end unless --keep")
    p.add_argument("--keep", action="store_true", help="keep what the run wrote in --dir")
    p.add_argument("--quick", action="store_true", help="fewer gets per phase (about 2 minutes)")
    p.add_argument("--smoke", action="store_true", help="tiny run in a temp dir (tests)")
    p.add_argument("--sizes", default="1M,4M", help="object sizes, comma-separated (default 1M,4M)")
    p.add_argument("--gets", default="4,8", help="objects per get call, comma-separated (default 4,8)")
    p.add_argument("--knobs", default="on,off", help="knob settings to compare: on, off (default both)")
    p.add_argument("--calls", type=int, default=0, help="get calls per block (default 30, --quick 20)")
    p.add_argument("--rounds", type=int, default=0, help="rounds per cell (default 5, --quick 3)")
    p.add_argument("--read-set", type=int, default=64, help="objects prefilled per size for the gets")
    p.add_argument("--slice", default=None, help="ssd_write_slice_bytes for 'on' (default: the config default)")
    p.add_argument("--read-fraction", type=float, help="sweeps: the arbiter's READ_SLICE_FRACTION (default 0.25)")
    p.add_argument("--read-floor", help="sweeps: the arbiter's READ_SLICE_FLOOR in bytes (default 2M)")
    p.add_argument("--read-window", type=int, help="sweeps: the arbiter's READ_WINDOW_SLICES (slices in flight beside reads)")
    p.add_argument("--quiet-ms", type=float, help="sweeps: the arbiter's READ_QUIET_S in ms (default 100)")
    p.add_argument("--crc-policy", choices=CRC_POLICIES,
                   help="sweeps: ssd_crc_policy, the put CRC worker's CPU policy while reads are about "
                   f"(default {StoreConfig.ssd_crc_policy})")
    p.add_argument("--crc-off", action="store_true",
                   help="sweeps: ssd_crc_worker=false (the old split: loop thread / default executor by batch size)")
    p.add_argument("--memory", choices=("4k", "thp"), default="4k",
                   help="store path's buffers: 4k = plain mmap (default), thp = madvise(MADV_HUGEPAGE) (2 MiB runs)")
    p.add_argument("--fio", action="store_true", help="also run the fio anchor (needs fio)")
    p.add_argument("--sglang", action="store_true", help="also through the SGLang backend on real host pools (needs sglang)")
    p.add_argument("--json", help="write rows as JSON")
    p.add_argument("--plot", help=argparse.SUPPRESS)
    cfg = p.parse_args(argv)
    cfg.sizes = [parse_bytes(s) for s in cfg.sizes.split(",") if s]
    cfg.gets = [int(g) for g in cfg.gets.split(",") if g]
    cfg.knobs = [k for k in cfg.knobs.split(",") if k]
    if any(k not in ("on", "off") for k in cfg.knobs):
        p.error(f"--knobs takes on and/or off, got {cfg.knobs}")
    cfg.calls = cfg.calls or (4 if cfg.smoke else 20 if cfg.quick else 30)
    cfg.rounds = cfg.rounds or (1 if cfg.smoke else 3 if cfg.quick else 5)
    cfg.warm_s, cfg.solo_s = (0.2, 0.3) if cfg.smoke else (0.5, 1.5)
    if cfg.smoke:
        cfg.sizes, cfg.gets, cfg.read_set = [256 << 10], [4], 16
    cfg.slice = parse_bytes(cfg.slice) if cfg.slice else StoreConfig.ssd_write_slice_bytes
    if cfg.read_fraction is not None and not 0 < cfg.read_fraction <= 1:
        p.error(f"--read-fraction must be in (0, 1], got {cfg.read_fraction}")
    cfg.read_floor = parse_bytes(cfg.read_floor) if cfg.read_floor else None
    if cfg.read_floor is not None and cfg.read_floor <= 0:
        p.error("--read-floor must be > 0")
    if cfg.read_window is not None and cfg.read_window < 1:
        p.error("--read-window must be >= 1")
    if cfg.quiet_ms is not None and cfg.quiet_ms < 0:
        p.error("--quiet-ms must be >= 0")
    # the CRC flags as config keys: every store of the run gets them (the SGLang one: extra_config)
    cfg.crc_keys = ({"ssd_crc_policy": cfg.crc_policy} if cfg.crc_policy else {}) | (
        {"ssd_crc_worker": False} if cfg.crc_off else {})
    return cfg


def arbiter_settings(cfg) -> dict:
    """Apply the sweep flags to the arbiter's module constants (read when a store's arbiter is
    made, so before any store opens) and return the settings in force, for the rows (the CRC
    flags go to each store's config: ``cfg.crc_keys``)."""
    if cfg.read_fraction is not None:
        arbiter_mod.READ_SLICE_FRACTION = cfg.read_fraction
    if cfg.read_floor is not None:
        arbiter_mod.READ_SLICE_FLOOR = cfg.read_floor
    if cfg.read_window is not None:
        arbiter_mod.READ_WINDOW_SLICES = cfg.read_window
    if cfg.quiet_ms is not None:
        arbiter_mod.READ_QUIET_S = cfg.quiet_ms / 1e3
    return {"read_fraction": arbiter_mod.READ_SLICE_FRACTION, "read_floor": arbiter_mod.READ_SLICE_FLOOR,
            "read_window": arbiter_mod.READ_WINDOW_SLICES, "quiet_ms": round(arbiter_mod.READ_QUIET_S * 1e3, 3),
            "crc": "no-worker" if cfg.crc_off else cfg.crc_policy or StoreConfig.ssd_crc_policy}  # fmt: skip


class ThpBuffer:
    """Like AlignedBuffer, but madvise(MADV_HUGEPAGE) before the first touch, so the kernel backs it
    with 2 MiB transparent huge pages where it can (THP "madvise" or "always"): objects on a few
    long physical runs, as a host pool often is, rather than one device segment per 4 KiB page."""

    def __init__(self, nbytes: int):
        import mmap

        self.nbytes = nbytes
        self._mmap = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = np.frombuffer(self._mmap, dtype=np.uint8)
        off = (-base.ctypes.data) % (2 << 20)
        self.array = base[off : off + nbytes]
        self.address = int(self.array.ctypes.data)
        if hasattr(self._mmap, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            self._mmap.madvise(mmap.MADV_HUGEPAGE)
        self.array[:] = 0  # fault in now, off the timed path

    def close(self) -> None:
        self.array = None
        try:
            self._mmap.close()
        except BufferError:
            pass


def store_config(path: str, knob: str, slice_bytes: int, capacity: int, crc_keys: dict | None = None) -> StoreConfig:
    return StoreConfig(
        ssd_storage_dir=path, ssd_capacity_bytes=capacity, ssd_segment_size_bytes=256 << 20,
        ssd_durability_mode="strict", ssd_io_backend="io_uring",
        ssd_read_priority=knob, ssd_write_slice_bytes=slice_bytes if knob == "on" else 0, **(crc_keys or {}),
    )  # fmt: skip


def mean_runs(addr: int, nbytes: int, size: int) -> float | None:
    """Mean physically contiguous runs per ``size``-byte object of [addr, addr+nbytes) (None: not root)."""
    r = phys_runs("self", addr, nbytes, size)
    return None if r is None else round(r, 1)


class PutStream:
    """48-object put batches back to back in a thread; each batch's keys deleted two batches later."""

    def __init__(self, store: SyncPageStore, size: int, buf: AlignedBuffer, tag: str):
        self.store, self.size, self.buf, self.tag = store, size, buf, tag
        self.stop = threading.Event()
        self.bytes = 0
        self.failed = 0
        self.marks: list[tuple[float, int]] = []  # (time, bytes so far) after each batch
        self.thread = threading.Thread(target=self._run, name="bench-put-stream", daemon=True)
        self._gen = 0

    def _run(self) -> None:
        views = [self.buf.array[i * self.size : (i + 1) * self.size] for i in range(PUT_BATCH)]
        old: list[list[str]] = []
        while not self.stop.is_set():
            keys = [f"{self.tag}-put-{self._gen}-{i}" for i in range(PUT_BATCH)]
            self._gen += 1
            ok = self.store.put_many(keys, views)
            self.failed += ok.count(False)
            self.bytes += ok.count(True) * self.size
            self.marks.append((time.perf_counter(), self.bytes))
            old.append(keys)
            if len(old) > 2:
                self.store.delete_many(old.pop(0))
        for keys in old:
            self.store.delete_many(keys)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()

    def gbps(self, t0: float, t1: float) -> float:
        """Bytes of batches that ended in [t0, t1] over the time from the first batch end before t0."""
        inside = [(t, b) for t, b in self.marks if t0 <= t <= t1]
        before = [(t, b) for t, b in self.marks if t < t0]
        if not inside or not before:
            return float("nan")
        (ta, ba), (tb, bb) = before[-1], inside[-1]
        return (bb - ba) / (tb - ta) / 1e9 if tb > ta else float("nan")


def run_gets(store, keys: list[str], dst: AlignedBuffer, size: int, nget: int, calls: int,
             interval_s: float, rng: random.Random) -> list[float]:  # fmt: skip
    """Latency (ms) of ``calls`` get_many calls; every byte checked against the key's pattern."""
    views = [dst.array[i * size : (i + 1) * size] for i in range(nget)]
    lat = []
    next_t = time.perf_counter()
    for _ in range(calls):
        if interval_s:
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            next_t += interval_s
        pick = rng.sample(range(len(keys)), nget)
        t0 = time.perf_counter()
        ok = store.get_many([keys[j] for j in pick], views)
        lat.append((time.perf_counter() - t0) * 1e3)
        if not all(ok):
            raise RuntimeError(f"get_many missed {ok.count(False)} of {nget} prefilled objects")
        for v, j in zip(views, pick):
            if v[0] != j % 251 or v[-1] != j % 251:
                raise RuntimeError(f"object {keys[j]} read back wrong bytes")
    return lat


def prefill(store, size: int, n: int, src: AlignedBuffer) -> list[str]:
    keys = [f"read-{size}-{j}" for j in range(n)]
    for s in range(0, n, PUT_BATCH):
        batch = keys[s : s + PUT_BATCH]
        views = []
        for k, j in enumerate(range(s, s + len(batch))):
            v = src.array[k * size : (k + 1) * size]
            v[:] = j % 251
            views.append(v)
        if not all(store.put_many(batch, views)):
            raise RuntimeError("prefill put_many failed")
    src.array[:] = 0xA5
    return keys


def cell(cfg, store, keys, dst, src, size: int, nget: int, pattern: str, interval: float, tag: str,
         notes: list[str]) -> dict:  # fmt: skip
    """``cfg.rounds`` rounds of [put stream alone, gets beside it, gets alone]: ratios are taken
    round by round (drift of the shared disk hits both sides of each) and their median kept."""
    idle, loaded, loop_idle, loop_loaded, ratios = [], [], [], [], {"p50": [], "p99": [], "put": []}
    solo_all, put_all = [], []
    rng = random.Random(hash((size, nget, pattern)) & 0xFFFF)
    gap = interval if pattern == "spaced" else 0.0
    for r in range(cfg.rounds):
        ps = PutStream(store, size, src, f"{tag}-{r}")
        ps.start()
        time.sleep(cfg.warm_s)  # the stream reaches its steady rate
        t0, t1 = solo_window(ps.marks, cfg.solo_s)
        with LoopProbe(store) as probe:
            lat_l = loaded_gets(ps.marks, t1, lambda: run_gets(store, keys, dst, size, nget, cfg.calls, gap, rng))
        t2 = time.perf_counter()
        ps.finish()
        if ps.failed:
            notes.append(f"{tag}: {ps.failed} puts of the stream failed")
        solo, gb = ps.gbps(t0, t1), ps.gbps(t1, t2)
        with LoopProbe(store) as probe_idle:
            lat_i = run_gets(store, keys, dst, size, nget, len(lat_l), gap, rng)
        idle += lat_i
        loaded += lat_l
        loop_idle += probe_idle.lat
        loop_loaded += probe.lat
        solo_all.append(solo)
        put_all.append(gb)
        ratios["p50"].append(pct(lat_l, 50) / pct(lat_i, 50))
        ratios["p99"].append(pct(lat_l, 99) / pct(lat_i, 99))
        ratios["put"].append(gb / solo if solo > 0 else float("nan"))
    med = lambda v: round(float(np.nanmedian(v)), 2)  # noqa: E731
    return {
        "idle": idle, "loaded": loaded, "loop_idle": loop_idle, "loop_loaded": loop_loaded,
        "vs_idle_p50": med(ratios["p50"]), "vs_idle_p99": med(ratios["p99"]), "put_vs_solo": med(ratios["put"]),
        "put_solo_gbps": round(float(np.nanmedian(solo_all)), 3), "put_gbps": round(float(np.nanmedian(put_all)), 3),
    }  # fmt: skip


def bench_knob(cfg, directory: str, knob: str, notes: list[str]) -> list[dict]:
    path = os.path.join(directory, f"store-{knob}")
    shutil.rmtree(path, ignore_errors=True)
    biggest = max(cfg.sizes)
    capacity = max(4 << 30, (cfg.read_set * sum(cfg.sizes) + 8 * PUT_BATCH * biggest) * 2)
    capacity = -(-capacity // (256 << 20)) * (256 << 20)
    rows: list[dict] = []
    make = ThpBuffer if cfg.memory == "thp" else AlignedBuffer
    src = make(PUT_BATCH * biggest)
    dst = make(max(cfg.gets) * biggest)
    src.array[:] = 0xA5
    store = SyncPageStore(path, store_config(path, knob, cfg.slice, capacity, cfg.crc_keys))
    system = f"umbp_{knob}"
    try:
        for size in cfg.sizes:
            keys = prefill(store, size, cfg.read_set, src)
            segs = {"memory": cfg.memory, "src_segs": mean_runs(src.address, PUT_BATCH * size, size)}
            for nget in cfg.gets:
                segs["dst_segs"] = mean_runs(dst.address, nget * size, size)
                # spacing from this size's idle back-to-back latency (one untimed calibration block)
                calib = run_gets(store, keys, dst, size, nget, cfg.calls, 0.0, random.Random(1))
                interval = SPACING_X * statistics.median(calib) / 1e3
                for pattern in ("b2b", "spaced"):
                    c = cell(cfg, store, keys, dst, src, size, nget, pattern, interval, f"{knob}-{size}-{nget}-{pattern}",
                             notes)  # fmt: skip
                    rows.append(row(system, "get_idle", size, nget, pattern, c["idle"],
                                    loop_p99_ms=round(pct(c["loop_idle"], 99), 2), **segs))  # fmt: skip
                    rows.append(row(
                        system, "get_loaded", size, nget, pattern, c["loaded"],
                        vs_idle_p50=c["vs_idle_p50"], vs_idle_p99=c["vs_idle_p99"], put_gbps=c["put_gbps"],
                        put_solo_gbps=c["put_solo_gbps"], put_vs_solo=c["put_vs_solo"],
                        interval_ms=round(interval * 1e3, 1) if pattern == "spaced" else 0.0,
                        loop_p99_ms=round(pct(c["loop_loaded"], 99), 2), **segs,
                    ))  # fmt: skip
    finally:
        store.close()
        src.close()
        dst.close()
        shutil.rmtree(path, ignore_errors=True)
    return rows


def fio_anchor(directory: str, quick: bool, notes: list[str]) -> list[dict]:
    """randread 4 MiB at QD 1 alone, then beside a 4 MiB write job at QD 32 (without / with prioclass=1)."""
    if shutil.which("fio") is None:
        notes.append("fio not installed: no device anchor")
        return []
    rfile, wfile = os.path.join(directory, "fio-read"), os.path.join(directory, "fio-write")
    runtime = 4 if quick else 8
    common = ["--ioengine=io_uring", "--direct=1", "--bs=4M", f"--runtime={runtime}", "--time_based",
              "--output-format=json", "--group_reporting=0"]  # fmt: skip
    reader = ["--name=read", f"--filename={rfile}", "--rw=randread", "--iodepth=1", "--size=2G"]
    writer = ["--name=write", f"--filename={wfile}", "--rw=write", "--iodepth=32", "--size=4G"]
    rows = []
    cases = [("read_solo", reader, []), ("read_beside_write", reader, writer),
             ("read_beside_write_prio", reader + ["--prioclass=1", "--prio=7"], writer)]  # fmt: skip
    base = None
    for name, r, w in cases:
        try:
            out = subprocess.run(["fio", *common, *r, *w], capture_output=True, text=True, timeout=runtime * 10 + 120)
            jobs = {j["jobname"]: j for j in json.loads(out.stdout[out.stdout.find("{"):])["jobs"]}
        except (subprocess.SubprocessError, ValueError, KeyError) as e:
            notes.append(f"fio {name} failed: {e}")
            continue
        pc = jobs["read"]["read"]["clat_ns"].get("percentile", {})
        p50, p99 = pc.get("50.000000", 0) / 1e6, pc.get("99.000000", 0) / 1e6
        base = base or (p50, p99)
        rec = {"bench": "mixed", "system": "fio", "op": name, "object_bytes": 4 << 20, "gets": 1, "pattern": "qd1",
               "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
               "vs_idle_p50": round(p50 / base[0], 2) if base[0] else None,
               "vs_idle_p99": round(p99 / base[1], 2) if base[1] else None}  # fmt: skip
        if "write" in jobs:
            rec["put_gbps"] = round(jobs["write"]["write"]["bw_bytes"] / 1e9, 3)
        rows.append(rec)
    for f in (rfile, wfile):
        if os.path.exists(f):
            os.unlink(f)
    return rows


def print_rows(rows: list[dict]) -> None:
    cols = ("system", "op", "object_bytes", "gets", "pattern", "p50_ms", "p90_ms", "p99_ms", "vs_idle_p50",
            "vs_idle_p99", "put_solo_gbps", "put_gbps", "put_vs_solo", "loop_p99_ms", "src_segs", "dst_segs")  # fmt: skip
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{'' if r.get(c) is None else r.get(c):>12}" for c in cols))


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["op"] != "get_loaded":
            continue
        head = f"{r['system']} {r['object_bytes'] >> 20 or r['object_bytes']}{'M' if r['object_bytes'] >= 1 << 20 else 'B'}"
        head += f" x{r['gets']} {r['pattern']}"
        if r["pattern"] == "spaced":
            ok = r["vs_idle_p50"] <= 1.3 and r["vs_idle_p99"] <= 1.6 and (r["put_vs_solo"] or 0) >= 0.7
            out.append(f"{head}: p50 {r['vs_idle_p50']}x (<=1.3) p99 {r['vs_idle_p99']}x (<=1.6) "
                       f"backup {r['put_vs_solo']}x solo (>=0.7): {'met' if ok else 'NOT met'}")  # fmt: skip
        else:
            ok = r["vs_idle_p50"] <= 1.6
            out.append(f"{head}: p50 {r['vs_idle_p50']}x (<=1.6): {'met' if ok else 'NOT met'}")
    return out


def main(argv=None) -> int:
    cfg = parse_args(argv)
    work = WorkDir(cfg, os.path.join(tempfile.gettempdir(), "umbp-bench-mixed"), "umbp-mixed-", "bench mixed")
    directory = work.path
    notes: list[str] = []
    rows: list[dict] = []
    settings = arbiter_settings(cfg)
    try:
        for knob in cfg.knobs:
            rows += bench_knob(cfg, directory, knob, notes)
        if cfg.sglang:
            from .mixed_sglang import bench_sglang

            rows += bench_sglang(cfg, directory, notes)
        if cfg.fio:
            rows += fio_anchor(directory, cfg.quick, notes)
    finally:
        work.cleanup()
    for r in rows:
        if r["system"] != "fio":
            r.update(settings)
    notes.append("arbiter: read slice fraction {read_fraction}, floor {read_floor} B, {read_window} in flight, quiet {quiet_ms} ms"
                 .format(**settings))  # fmt: skip
    print_rows(rows)
    finish(cfg, rows, notes, targets=targets(rows), source="issue 13")
    return 0


if __name__ == "__main__":
    sys.exit(main())
