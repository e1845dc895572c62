"""Store benchmark: PageStore against the raw io_uring engine on the same segment files.

    python tools/bench_store.py [--dir DIR] [--quick | --smoke] [--json PATH] [--plot PATH]
    python -m umbp_nvme.bench store [same args]

Systems:
  umbp_store   PageStore.put_many / get_many: 128-page batches of 2 objects per page (256
               objects per call, one call at a time, as SGLang's controller issues them), memory
               passed as (address, nbytes) inside a registered range (the backend's hot path).
               Index lookup, slot allocation, CRC32C of every object, index commit all counted.
  umbp_uring   the raw UringEngine: one write_many / read_many of the same 256 ops per call, at
               the very (segment file, offset) extents the store chose for those objects in the
               same round, from/into the same memory; fdatasync of the touched segments per
               call when the store runs strict (the store does the same). No index, no CRC.
  nixl_posix   NVIDIA NIXL's POSIX plugin on the same extents and memory (bench/nixl_posix.py),
               when ``nixl`` is importable (`pip install nixl`; CPU-only works): the peer the
               issue measured, fdatasync of the touched segments per call when strict.

Each measured round is, per (object size, memory kind): store put, raw put (overwrites the same
extents with the same bytes, so the store's CRCs stay valid), store get, raw get, then an
untimed delete of the round's keys. Reads are cold: the segment files are O_DIRECT (a note says
so otherwise). One untimed warm-up round per size first writes every extent once (fallocated but
never written blocks cost extent conversion on the first write) and starts the thread pools.
``vs_umbp_uring`` is the median over rounds of store/raw from the same round.

Memory kinds as in the engine benchmark: "4k" (anonymous mmap) and "huge" (2 MiB hugetlb pages,
reserved through /proc/sys/vm/nr_hugepages as root, restored at exit). Both kinds are registered
with the store (register_memory) and, when the store took them as io_uring fixed buffers, with
the raw engine too, so both systems run with the same buffer kind (the row says ``fixed``).

Extra rows:
  op "exists"       ``await store.exists_prefix(keys)`` of 128 present keys on the large store
                    (the writer's in-memory view), and ``umbp_store_ro`` (a read-only open of the
                    same store, which asks LMDB). latency_us_p50 / _p99 per call, per run.
  op "reopen"       seconds to open the writer on a store of ``--reopen-objects`` (default 1 M)
                    objects, page cache warm (a process restart); latency_us_p50 holds it in
                    microseconds (seconds_p50 in seconds). "reopen_cold": after drop_caches (root).
                    The large store is built once with tiny objects (``--reopen-object-bytes``,
                    4 KiB) through the store's real put_many path in batches of 8192 in
                    DIR/reopen-<N>-<bytes>/; with --keep it stays there and the next run with
                    the same --dir reuses it (--rebuild forces a new one).
  op "rebuild"      seconds to open the writer on that store after index.lmdb was deleted: the
                    index is rebuilt from the records in the segments (target <= 30 s per 1 M).

``--device ram`` (root): the put / get rounds on a RAM-backed loop device the command sets up and
tears down, with fio's 4 KiB reads and the CRC's cost beside (bench/store_ram.py, issue 36).

Rows follow benchlib's format ("bench": "store"); queue_depth is objects per call.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from .engine import HugePages, Memory
from .common import (Sample, Stopwatch, WorkDir, as_info, check_buffers, drop_caches, finish, kept_store, make_row,
                     page_keys, parse_bytes, print_table)  # fmt: skip
from .store_tput import SegFds, store_config, bench_throughput, store_extents  # noqa: F401 - names of this module before the split
from . import scale

from umbp_nvme.buffers import HUGE_PAGE_BYTES
from umbp_nvme.config import StoreConfig
from umbp_nvme.store import PageStore

BENCH = "store"
OBJECTS_PER_PAGE = 2
REOPEN_BATCH = 8192
REOPEN_MARKER = "bench_store_reopen.json"
DEFAULT_DIR = os.path.join(tempfile.gettempdir(), "umbp-bench-store")
MiB, GiB = 1 << 20, 1 << 30
SMALL_PUT_BYTES = 64 << 10  # puts up to this size have the 0.85 target, larger ones 0.9

TARGETS = {
    "put_vs_raw": 0.9,  # 1-4 MiB objects
    "put_small_vs_raw": 0.85,  # strict put of 64 KiB and smaller (issue 14)
    "get_vs_raw": 0.9,
    "exists_us": 100.0,
    "reopen_s": 2.0,
    "rebuild_s": 30.0,  # per 1 M objects: index.lmdb lost, rebuilt from the segments' records
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="umbp-nvme bench store", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help=f"bench directory (default {DEFAULT_DIR}); what the run makes there is "
                   "removed at the end unless --keep")
    p.add_argument("--keep", action="store_true", help="keep what the run wrote (the reopen store is then reused by the "
                   "next run with the same --dir)")
    p.add_argument("--sizes", default=None, help="object sizes (default 64k,1m,4m; --quick 64k,1m)")
    p.add_argument("--batch-pages", type=int, default=None, help="pages per call, 2 objects each (default 128)")
    p.add_argument("--sample-bytes", default=None, help="bytes moved per measurement (default 1g; --quick 256m)")
    p.add_argument("--buffers", default="4k,huge", help="memory kinds: 4k,huge")
    p.add_argument("--ops", default="put,get,exists,reopen,rebuild", help="subset of put,get,exists,reopen,rebuild")
    p.add_argument("--runs", type=int, default=None, help="alternating rounds (default 3; --quick 2)")
    p.add_argument("--durability", default="strict", choices=("strict", "relaxed"), help="store durability mode")
    p.add_argument("--no-verify", action="store_true", help="stores opened with verify_crc=False: gets skip the CRC "
                   "check (puts still compute it for the records); the opt-out's cost, beside the default")
    p.add_argument("--segment-bytes", default="256m", help="store segment size")
    p.add_argument("--reopen-objects", type=int, default=None, help="objects in the reopen store (default 1000000; --quick 100000)")
    p.add_argument("--reopen-object-bytes", default="4k", help="object size of the reopen store")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached reopen store")
    p.add_argument("--exists-calls", type=int, default=None, help="exists_prefix calls per run (default 2000)")
    p.add_argument("--quick", action="store_true", help="small matrix, under a minute (reopen store of 100 k objects)")
    p.add_argument("--smoke", action="store_true", help="tiny run for tests: a few small objects, a few seconds")
    p.add_argument("--roots", default=None, help="several drives' directories (D0,D1,...): the multi-drive "
                   "run on 1, 2, 4 of them instead (bench/drives.py; sizes 1m,4m, 16 pages per call)")
    p.add_argument("--stall", type=int, default=None, help="with --roots: stall this fake drive mid-run (0-3)")
    p.add_argument("--stall-tool", default=None, help="the fake-drives tool (default $FAKE_DRIVES or fake-drives)")
    p.add_argument("--stall-timeout-s", type=float, default=1.0, help="io_timeout_s of the stall run")
    p.add_argument("--device", choices=("ram",), default=None, help="ram: run on a RAM-backed loop device set up and "
                   "torn down by the command (root), with NIXL and fio beside (bench/store_ram.py)")
    scale.add_args(p)
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    a = p.parse_args(argv)
    q, s = a.quick, a.smoke
    if a.roots:
        from umbp_nvme.config import parse_roots

        a.roots = parse_roots(a.roots)
        a.sizes = a.sizes or ("64k" if s else "1m,4m")
        a.batch_pages = a.batch_pages or (4 if s else 16)
        a.sample_bytes = a.sample_bytes or ("8m" if s else "64m" if q else "256m")
        if a.segment_bytes == "256m":
            a.segment_bytes = "16m" if s else "64m"
    if a.device == "ram":  # the per-object cost: 4 KiB too, and no index-scale ops unless asked
        if a.dir or a.roots or a.keep:
            p.error("--device ram runs on a RAM device it sets up and removes: --dir, --roots and --keep do not apply")
        a.sizes = a.sizes or ("4k,64k" if s else "4k,64k,1m" if q else "4k,64k,1m,4m")
        a.ops = "put,get" if a.ops == p.get_default("ops") else a.ops
    a.sizes = [parse_bytes(x) for x in (a.sizes or ("64k" if s else "64k,1m" if q else "64k,1m,4m")).split(",")]
    a.batch_pages = a.batch_pages or (8 if s else 128)
    a.sample_bytes = parse_bytes(a.sample_bytes or ("4m" if s else "256m" if q else "1g"))
    a.buffers = [b for b in a.buffers.split(",") if b]
    a.ops = [o for o in a.ops.split(",") if o]
    a.runs = a.runs or (1 if s else 2 if q else 3)
    a.segment_bytes = parse_bytes("16m" if s and a.segment_bytes == "256m" else a.segment_bytes)
    a.reopen_objects = a.reopen_objects or (2000 if s else 100_000 if q else 1_000_000)
    a.reopen_object_bytes = parse_bytes(a.reopen_object_bytes)
    a.exists_calls = a.exists_calls or (200 if s else 2000)
    scale.check_args(p, a)
    check_buffers(p, a.buffers)
    tool = a.stall_tool or os.environ.get("FAKE_DRIVES") or "fake-drives"
    if a.stall is not None and shutil.which(tool) is None:  # found before an hour of setup, not after
        p.error(f"--stall needs the fake-drives tool to stall a drive, and {tool!r} is not on PATH: give "
                "--stall-tool PATH or set FAKE_DRIVES (the drives come from `fake-drives up 4`)")
    for o in a.ops:
        if o not in ("put", "get", "exists", "reopen", "rebuild"):
            p.error(f"unknown op {o!r}; expected some of put,get,exists,reopen,rebuild")
    for size in a.sizes + [a.reopen_object_bytes]:
        if size <= 0 or size % 4096:
            p.error(f"object size {size} must be a positive multiple of 4096")
    if a.batch_pages < 1 or a.runs < 1 or a.reopen_objects < 128:
        p.error("--batch-pages and --runs must be >= 1, --reopen-objects >= 128")
    return a


# -- the large store: exists, reopen -------------------------------------------------------------


def _reopen_config(cfg, path: str) -> StoreConfig:
    seg = cfg.segment_bytes
    data = cfg.reopen_objects * cfg.reopen_object_bytes
    capacity = -(-int(data / 0.8 + 2 * seg) // seg) * seg
    return store_config(cfg, path, capacity)


def reopen_keys(n: int) -> list[str]:
    return page_keys("reopen", -(-n // OBJECTS_PER_PAGE))[:n]


async def ensure_reopen_store(cfg, directory: str, notes: list[str]) -> tuple[str, list[str]]:
    n, size = cfg.reopen_objects, cfg.reopen_object_bytes
    path = os.path.join(directory, f"reopen-{n}-{size}")
    marker = os.path.join(path, REOPEN_MARKER)
    want = {"objects": n, "object_bytes": size, "segment_bytes": cfg.segment_bytes, "keys": "sha256(reopen/i)_0_k|v",
            "build": "put_many", "format": "records-in-segments"}
    keys = reopen_keys(n)
    have = None if cfg.rebuild else kept_store(path, REOPEN_MARKER, want)
    if have:
        notes.append(f"reopen store: reused {path} ({n} objects, built in {have.get('build_s', 0):.1f} s)")
        return path, keys
    shutil.rmtree(path, ignore_errors=True)
    scfg = dataclasses.replace(_reopen_config(cfg, path), ssd_durability_mode="relaxed")  # building only; one flush at close
    t0 = time.perf_counter()
    store = await PageStore.open(path, scfg)
    from umbp_nvme.buffers import AlignedBuffer

    with AlignedBuffer(REOPEN_BATCH * size) as buf:
        buf.array[:] = np.random.default_rng(3).integers(0, 256, buf.nbytes, dtype=np.uint8)
        store.register_memory(buf.address, buf.nbytes)
        tuples = [(buf.address + i * size, size) for i in range(REOPEN_BATCH)]
        try:
            for lo in range(0, n, REOPEN_BATCH):
                batch = keys[lo : lo + REOPEN_BATCH]
                res = await store.put_many(batch, tuples[: len(batch)])
                if not all(res):
                    raise RuntimeError(f"building the reopen store: put_many failed for {res.count(False)} objects")
            count = store.stats()["objects"]
        finally:
            await store.close()
    build_s = time.perf_counter() - t0
    if count != n:
        raise RuntimeError(f"reopen store holds {count} objects, expected {n} (evicted?)")
    with open(marker, "w") as f:
        json.dump(dict(want, build_s=build_s), f)
    notes.append(f"reopen store: built {path} with {n} x {size} B objects through put_many "
                 f"(batches of {REOPEN_BATCH}) in {build_s:.1f} s" + ("; kept for the next run (--keep)" if getattr(cfg, "keep", False) else ""))
    return path, keys


async def _latency_sample_us(coro_fn, calls: int) -> tuple[Sample, float, float]:
    """Per-call latency of ``await coro_fn()`` on the running loop: (sample, p50 us, p99 us)."""
    lat = np.empty(calls, np.float64)
    pc = time.perf_counter
    with Stopwatch() as sw:
        for i in range(calls):
            t = pc()
            await coro_fn()
            lat[i] = pc() - t
    return sw.sample(0, calls), float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


async def bench_large(cfg, directory: str, notes: list[str]) -> list[dict]:
    path, keys = await ensure_reopen_store(cfg, directory, notes)
    scfg = _reopen_config(cfg, path)
    n = cfg.reopen_objects
    rows: list[dict] = []
    # reopen (warm page cache, then cold)
    variants = [("reopen", False)] + ([("reopen_cold", True)] if os.geteuid() == 0 else [])
    if os.geteuid() != 0:
        notes.append("reopen_cold skipped: not root (cannot drop the page cache)")
    samples: dict[str, list[tuple[Sample, float]]] = {v: [] for v, _ in variants}
    store = await PageStore.open(path, scfg)  # warm the cache once
    await store.close()
    async def timed_open(what: str) -> tuple[Sample, float]:
        gc.collect()
        with Stopwatch() as sw:
            store = await PageStore.open(path, scfg)
        count = store.stats()["objects"]
        await store.close()
        if count != n:
            raise RuntimeError(f"{what} store holds {count} objects, expected {n}")
        return sw.sample(0, n), sw.wall_s

    if "reopen" in cfg.ops:
        for _ in range(cfg.runs):
            for op, cold in variants:  # alternate warm and cold
                if cold:
                    drop_caches()
                samples[op].append(await timed_open("reopened"))
    if "rebuild" in cfg.ops:
        samples["rebuild"] = []
        for _ in range(cfg.runs):  # index.lmdb lost: the writer rebuilds it from the records in the segments
            os.unlink(os.path.join(path, "index.lmdb"))
            with as_info():  # the store reports the lost index as an ERROR; here it is the measurement
                samples["rebuild"].append(await timed_open("rebuilt"))
    for op, got in samples.items():
        if not got:
            continue
        ss, secs = [s for s, _ in got], [w for _, w in got]
        med = statistics.median(secs)
        rows.append(make_row(BENCH, "umbp_store", op, cfg.reopen_object_bytes, 0, ss, buffers="", objects=n,
                             seconds_p50=med, latency_us_p50=med * 1e6, latency_us_p50_min=min(secs) * 1e6,
                             latency_us_p50_max=max(secs) * 1e6))  # fmt: skip
    if "exists" in cfg.ops:
        store = await PageStore.open(path, scfg)
        ro = await PageStore.open(path, scfg, readonly=True)
        try:
            start = (n // 2) // OBJECTS_PER_PAGE * OBJECTS_PER_PAGE
            probe = keys[start : start + 128]
            assert await store.exists_prefix(probe) == 128, "exists_prefix of present keys did not count 128"
            assert await ro.exists_prefix(probe) == 128, "read-only exists_prefix did not count 128"
            ex: dict[str, list] = {"umbp_store": [], "umbp_store_ro": []}
            for _ in range(cfg.runs):
                for name, s in (("umbp_store", store), ("umbp_store_ro", ro)):
                    ex[name].append(await _latency_sample_us(lambda s=s: s.exists_prefix(probe), cfg.exists_calls))
            for name, res in ex.items():
                p50 = [r[1] for r in res]
                p99 = [r[2] for r in res]
                rows.append(make_row(BENCH, name, "exists", 0, 128, [r[0] for r in res], buffers="",
                                     objects=n, latency_us_p50=statistics.median(p50), latency_us_p50_min=min(p50),
                                     latency_us_p50_max=max(p50), latency_us_p99=statistics.median(p99)))
        finally:
            await ro.close()
            await store.close()
    return rows


# -- driver ------------------------------------------------------------------------------------


async def bench(cfg) -> tuple[list[dict], list[str]]:
    notes: list[str] = []
    work = WorkDir(cfg, DEFAULT_DIR, "umbp-bench-store-", "bench store")
    directory = work.path
    rows: list[dict] = []
    huge = HugePages()
    mem = None
    try:
        if "put" in cfg.ops or "get" in cfg.ops:
            buffers = list(cfg.buffers)
            nbytes = cfg.batch_pages * OBJECTS_PER_PAGE * max(cfg.sizes)
            if "huge" in buffers:
                ok, why = huge.reserve(nbytes + HUGE_PAGE_BYTES)
                if not ok:
                    notes.append(f"huge buffers skipped: {why}")
                    buffers.remove("huge")
            mem = Memory(nbytes, buffers, notes)
            if not mem.bufs:
                raise RuntimeError("no memory kind could be allocated")
            rows += await bench_throughput(cfg, directory, mem, notes)
            mem.close()
            mem = None
            huge.restore()
        if "exists" in cfg.ops or "reopen" in cfg.ops or "rebuild" in cfg.ops:
            rows += await bench_large(cfg, directory, notes)
    finally:
        if mem is not None:
            mem.close()
        huge.restore()
        work.cleanup()
    return rows, notes


def print_extra(rows: list[dict], file=None) -> None:
    lat = [r for r in rows if "latency_us_p50" in r]
    if not lat:
        return
    print("", file=file)
    print("latency rows (latency_us_p50 med [min-max]):", file=file)
    for r in sorted(lat, key=lambda r: (r["op"], r["system"])):
        extra = f"  p99 {r['latency_us_p99']:.1f} us" if "latency_us_p99" in r else ""
        secs = f"  = {r['seconds_p50']:.3f} s" if "seconds_p50" in r else ""
        print(f"  {r['op']:<12} {r['system']:<14} objects={r.get('objects')}  {r['latency_us_p50']:.1f} us "
              f"[{r['latency_us_p50_min']:.1f}-{r['latency_us_p50_max']:.1f}]{secs}{extra}", file=file)


def ratio_target(op: str, object_bytes: int) -> float:
    """The issue's store/raw target for a put or get row: small puts pay an index record per object."""
    if op == "put" and object_bytes <= SMALL_PUT_BYTES:
        return TARGETS["put_small_vs_raw"]
    return TARGETS["put_vs_raw" if op == "put" else "get_vs_raw"]


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["system"] == "umbp_store" and r["op"] in ("put", "get") and r.get("vs_umbp_uring") is not None:
            v = r["vs_umbp_uring"]
            t = ratio_target(r["op"], r["object_bytes"])
            out.append(f"{r['op']} {r['object_bytes'] >> 10} KiB {r['buffers']}: store/raw = {v:.3f} "
                       f"(target >= {t}) {'MET' if v >= t else 'NOT MET'}")
        if r["system"] == "umbp_store" and r["op"] == "exists":
            v = r["latency_us_p50"]
            out.append(f"exists_prefix(128) p50 = {v:.1f} us (target <= 100) {'MET' if v <= 100 else 'NOT MET'}")
        if r["op"] == "reopen":
            v = r["seconds_p50"]
            scale = "" if r.get("objects") == 1_000_000 else f" (at {r.get('objects')} objects; the target is for 1 M)"
            out.append(f"reopen = {v:.3f} s (target <= 2 s){scale} {'MET' if v <= 2 else 'NOT MET'}")
        if r["op"] == "rebuild":
            v = r["seconds_p50"]
            per_m = v * 1_000_000 / max(1, r.get("objects") or 1)
            out.append(f"rebuild = {v:.3f} s for {r.get('objects')} objects ({per_m:.1f} s per 1 M; target <= "
                       f"{TARGETS['rebuild_s']:g}) {'MET' if per_m <= TARGETS['rebuild_s'] else 'NOT MET'}")
    return out


def main(argv=None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    if cfg.scale is not None:
        return scale.main(cfg)
    if cfg.roots:
        from . import drives

        rows, notes = asyncio.run(drives.bench_drives(cfg))
        print(f"multi-drive store benchmark: {len(rows)} rows, {cfg.runs} alternating runs over "
              f"{len(cfg.roots)} roots, {time.perf_counter() - started:.0f} s total")
        print_table(rows, ratio_keys=("drives", "vs_n_x_1drive", "vs_before"))
        finish(cfg, rows, notes, targets=drives.targets(rows), title="MultiDriveStore on 1, 2, 4 drives", source="issue 12")
        return 0
    if cfg.device == "ram":
        from . import store_ram

        rows, notes = store_ram.run(cfg, bench)
        store_ram.report(cfg, rows, notes, time.perf_counter() - started)
        return 0
    rows, notes = asyncio.run(bench(cfg))
    print(f"store benchmark: {len(rows)} rows, {cfg.runs} alternating runs, {cfg.batch_pages} pages x "
          f"{OBJECTS_PER_PAGE} objects per call, {time.perf_counter() - started:.0f} s total")
    print_table([r for r in rows if r["op"] in ("put", "get")], ratio_keys=("vs_umbp_uring",))
    print_extra(rows)
    finish(cfg, rows, notes, targets=targets(rows), plot_rows=[r for r in rows if r["op"] in ("put", "get")],
           title="PageStore vs raw io_uring engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
