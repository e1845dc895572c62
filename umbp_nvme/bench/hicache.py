"""HiCache benchmark: our SGLang backend against SGLang's HiCacheFile, on real SGLang host pools.

    python tools/bench_hicache.py [--dir DIR] [--quick | --smoke] [--json PATH] [--plot PATH]
    python -m umbp_nvme.bench hicache [same args]

Needs sglang (tools/install_sglang.sh); without it (or with UMBP_BENCH_NO_SGLANG=1) the benchmark
says so, writes an empty JSON list when --json is given, and exits 0.

Systems, all driven the way SGLang's cache controller drives them, in 128-page batches:
  umbp_nvme_backend  UMBPNvmeStore created through StorageBackendFactory ("dynamic") and
                     registered like the controller does; batch_set_v1 / batch_get_v1 (zero
                     copy: K and V objects straight from / into the host pool), batch_exists.
  hicache_file       sglang's HiCacheFile through its legacy flat-page path (the controller's
                     _generic_page_set / _generic_page_get): batch_set(keys,
                     [host_pool.get_data_page(first token)]), batch_get(keys,
                     [host_pool.get_dummy_flat_data_page() ...]) then set_from_flat_data_page per
                     page, and the base batch_exists (one exists() per key).
  fio / fio_huge     fio --ioengine=io_uring --direct=1 random reads / writes of the object size
                     (bench_engine's runner) on its own test file, streaming at iodepth 32, 128
                     and 256 (--fio-qd); fio_huge uses --iomem=shmhuge. fio[_huge]_batch: one
                     call's objects submitted together, the next batch once all completed (a
                     synchronous call's pattern). vs_fio is against the batch job (like for
                     like), vs_fio_best against the fastest streaming job of the round
                     (bench/hicache_fio.py says why).

Host pools are sglang's MHATokenToKVPoolHost (layout page_first, bf16, pin_memory off, built by
bench/sglang_pools.py as SGLang's assembler builds them) allocated by SGLang's own allocator:
"4k" on plain pages, "huge" with SGLANG_HUGEPAGE_SIZE=2MB (hugetlb pages reserved through
/proc/sys/vm/nr_hugepages as root and restored at exit; the run checks the pool really landed
on hugetlb pages and skips the kind with a note otherwise).

Shapes (per rank, page_first):
  llama8b  page 64, 32 layers, 8 KV heads, head dim 128: K and V objects of 4 MiB, 8 MiB pages.
           Host pool: --pool-batches (2) x 128 pages = 2 GiB per memory kind (one kind at a
           time), plus 1 GiB of dummy flat pages HiCacheFile's read path allocates per batch.
  small    page 16, 32 layers, 1 KV head (Llama-3-8B at TP 8), head dim 128: 128 KiB objects,
           256 KiB pages.

Each round, per (shape, memory kind): set (umbp, hicache_file, fio write), exists (umbp,
hicache_file), then sync + drop_caches (root; untimed), get (umbp, hicache_file, fio read),
then a check that every system read back the bytes it wrote, and an untimed clear of both
stores. A sample moves --sample-bytes (default 2 GiB: 2 batches of 128 pages for llama8b),
cycling batches through the host pool's slots with fresh keys. Rows: "bench": "hicache";
object_bytes is the K/V object size (page_bytes = 2 x that: one HiCacheFile file); ops and
cpu_us_per_op count objects of object_bytes; queue_depth is pages per call (fio: its iodepth).
Writes are what the caller waits for: HiCacheFile's are buffered (page cache), so rows also
carry sync_s (an untimed syncfs right after) and gbps_incl_sync. Ratios are paired per round:
vs_fio (fio for 4k, fio_huge for huge) and vs_hicache_file.

Prefetch while backup (issue 13: get latency beside a saturating batch_set_v1 stream) is not
measured here: ``umbp-nvme bench mixed --sglang`` (bench/mixed_sglang.py) does it on the same pools.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import os
import shutil
import statistics
import sys
import time
import warnings

import numpy as np


from .engine import HugePages, make_test_file, run_fio
from .common import Sample, WorkDir, Skip, Stopwatch, check_buffers, drop_caches, finish, make_row, parse_bytes, print_table, write_json
from .hicache_fio import fio_batch_label, ratio_fields, run_fio_batch_for, targets  # noqa: F401 - targets kept for callers

from umbp_nvme.buffers import HUGE_PAGE_BYTES

BENCH = "hicache"
DEFAULT_DIR = "/tmp/umbp-bench-hicache"
MiB, GiB = 1 << 20, 1 << 30

SHAPES = {
    "llama8b": dict(page_size=64, layers=32, heads=8, head_dim=128),
    "small": dict(page_size=16, layers=32, heads=1, head_dim=128),
    "tiny": dict(page_size=16, layers=2, heads=2, head_dim=64),  # --smoke
}
TARGETS = {"get_vs_fio": 0.9, "set_vs_hicache_file": 3.0, "exists_us": 150.0}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="umbp-nvme bench hicache", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help=f"directory for the stores and fio's file (default {DEFAULT_DIR}); what "
                   "the run makes there is removed at the end unless --keep")
    p.add_argument("--keep", action="store_true", help="keep what the run wrote in --dir")
    p.add_argument("--shapes", default=None, help="llama8b,small (default both; --smoke tiny)")
    p.add_argument("--buffers", default=None, help="host pool memory kinds: 4k,huge (default both; --smoke 4k)")
    p.add_argument("--batch-pages", type=int, default=None, help="pages per call (default 128, SGLang's STORAGE_BATCH_SIZE)")
    p.add_argument("--pool-batches", type=int, default=None, help="batches the host pool holds (default 2; --quick 1)")
    p.add_argument("--sample-bytes", default=None, help="bytes per measurement (default 2g; --quick 256m)")
    p.add_argument("--runs", type=int, default=None, help="alternating rounds (default 3; --quick 2; --smoke 1)")
    p.add_argument("--durability", default="strict", choices=("strict", "relaxed"), help="our store's durability mode")
    p.add_argument("--exists-calls", type=int, default=None, help="batch_exists calls per run (default 300)")
    p.add_argument("--fio-qd", default="32,128,256", help="streaming fio iodepths (default 32,128,256; vs_fio_best "
                   "is against the fastest; vs_fio against a batch job of one call's objects)")
    p.add_argument("--fio-file-size", default=None, help="fio test file size (default 2g; --quick 512m)")
    p.add_argument("--fio-duration", type=float, default=None, help="seconds per fio run (default 1.0)")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before reads")
    p.add_argument("--quick", action="store_true", help="small run, under a minute")
    p.add_argument("--smoke", action="store_true", help="tiny run for tests (a few small pages)")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    a = p.parse_args(argv)
    q, s = a.quick, a.smoke
    a.shapes = [x for x in (a.shapes or ("tiny" if s else "llama8b,small")).split(",") if x]
    a.buffers = [b for b in (a.buffers or ("4k" if s else "4k,huge")).split(",") if b]
    a.batch_pages = a.batch_pages or (8 if s else 32 if q else 128)
    a.pool_batches = a.pool_batches or (1 if (q or s) else 2)
    a.sample_bytes = parse_bytes(a.sample_bytes or ("128k" if s else "256m" if q else "2g"))
    a.runs = a.runs or (1 if s else 2 if q else 3)
    a.exists_calls = a.exists_calls or (50 if s else 300)
    a.fio_file_size = parse_bytes(a.fio_file_size or ("16m" if s else "512m" if q else "2g"))
    a.fio_duration = a.fio_duration or (0.1 if s else 0.5 if q else 1.0)
    a.drop_caches = not (a.no_drop_caches or s)
    a.fio_qds = sorted({int(x) for x in a.fio_qd.split(",") if x}) if a.fio_qd else []
    if (q or s) and a.fio_qd == "32,128,256":
        a.fio_qds = [2 * a.batch_pages]  # as deep as one of our calls: 2 objects per page in flight
    for sh in a.shapes:
        if sh not in SHAPES:
            p.error(f"unknown shape {sh!r}; expected some of {', '.join(SHAPES)}")
    check_buffers(p, a.buffers)
    if a.batch_pages < 1 or a.pool_batches < 1 or a.runs < 1:
        p.error("--batch-pages, --pool-batches and --runs must be >= 1")
    return a


# -- sglang ------------------------------------------------------------------------------------


def load_sglang():
    """bench/sglang_pools.py (real sglang host pools, the dynamic loader); ImportError without sglang."""
    from . import sglang_pools

    if os.environ.get("UMBP_BENCH_NO_SGLANG", "") not in ("", "0"):
        raise ImportError("UMBP_BENCH_NO_SGLANG is set")
    if not sglang_pools.sglang_installed():
        raise ImportError("sglang is not installed (tools/install_sglang.sh installs sglang==0.5.23)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sglang_pools.sglang_imports()
    return sglang_pools


def shape_bytes(shape: dict) -> int:
    """Bytes of one K (or V) object of a page: layers x page x heads x head_dim x 2 (bf16)."""
    return shape["layers"] * shape["page_size"] * shape["heads"] * shape["head_dim"] * 2


def hugetlb_free_pages() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("HugePages_Free:"):
                return int(line.split()[1])
    return 0


def hugetlb_backed(addr: int) -> bool | None:
    """Whether the mapping holding addr uses 2 MiB (or larger) kernel pages; None if unknown."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and line.startswith("KernelPageSize:"):
                    return int(line.split()[1]) >= 2048
    except (OSError, ValueError):
        return None
    return None


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: str) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t = time.perf_counter()
        _libc.syncfs(fd)
        return time.perf_counter() - t
    finally:
        os.close(fd)


def page_hashes(tag: str, n: int) -> list[str]:
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


class Pool:
    """One sglang host pool of ``pool_batches`` x ``batch_pages`` pages on one memory kind."""

    def __init__(self, env, shape: dict, pages: int, kind: str):
        torch = env.sglang_imports().torch
        before = hugetlb_free_pages()
        saved = os.environ.get("SGLANG_HUGEPAGE_SIZE")
        if kind == "huge":
            os.environ["SGLANG_HUGEPAGE_SIZE"] = "2MB"
        else:
            os.environ.pop("SGLANG_HUGEPAGE_SIZE", None)
        try:
            self.bundle = env.mha_pool(
                "page_first", pages=pages, page_size=shape["page_size"], layers=shape["layers"],
                heads=shape["heads"], head_dim=shape["head_dim"], dtype=torch.bfloat16,
            )
        finally:
            if saved is None:
                os.environ.pop("SGLANG_HUGEPAGE_SIZE", None)
            else:
                os.environ["SGLANG_HUGEPAGE_SIZE"] = saved
        self.host = self.bundle.host
        self.page_size = shape["page_size"]
        self.nbytes = self.host.kv_buffer.numel() * self.host.kv_buffer.element_size()
        if kind == "huge":
            backed = hugetlb_backed(int(self.host.kv_buffer.data_ptr()))
            if backed is False or (backed is None and (before - hugetlb_free_pages()) * HUGE_PAGE_BYTES < self.nbytes):
                raise Skip(f"sglang's allocator did not put the {self.nbytes >> 20} MiB pool on hugetlb pages "
                           f"(HugePages_Free {before} before; see sglang's 'Hugepage mmap via libc failed' log)")
        self.indices = self.bundle.alloc_pages(pages)  # token indices, page after page
        flat = self.host.kv_buffer.view(-1).view(torch.uint8).numpy()
        block = np.random.default_rng(11).integers(0, 256, min(16 * MiB, flat.size), dtype=np.uint8)
        for off in range(0, flat.size, block.size):
            n = min(block.size, flat.size - off)
            flat[off : off + n] = block[:n]
        self.flat = flat

    def slot(self, b: int, batch_pages: int):
        """Host token indices of batch slot b (batch_pages pages)."""
        t = batch_pages * self.page_size
        return self.indices[b * t : (b + 1) * t]

    def close(self) -> None:
        self.flat = None
        self.indices = None
        self.host = None
        self.bundle = None
        gc.collect()


# -- systems -----------------------------------------------------------------------------------


class Umbp:
    name = "umbp_nvme_backend"

    def __init__(self, env, directory: str, pool: Pool, cfg, capacity: int):
        shutil.rmtree(directory, ignore_errors=True)
        config = env.storage_config(directory, extra={
            "ssd_capacity_bytes": capacity,
            "ssd_segment_size_bytes": 256 * MiB if not cfg.smoke else 16 * MiB,
            "ssd_durability_mode": cfg.durability,
            "ssd_io_backend": "io_uring",
        })
        self.backend = env.load_backend(config, pool.host)
        self.directory = directory

    def set(self, keys, idx) -> bool:
        return all(self.backend.batch_set_v1(keys, idx))

    def get(self, keys, idx, pool: Pool) -> bool:
        return all(self.backend.batch_get_v1(keys, idx))

    def exists(self, keys) -> int:
        return self.backend.batch_exists(keys)

    def clear(self) -> None:
        self.backend.clear()

    def close(self) -> None:
        self.backend.close()
        self.backend = None


class HiFile:
    name = "hicache_file"

    def __init__(self, env, directory: str, cfg):
        ns = env.sglang_imports()
        shutil.rmtree(directory, ignore_errors=True)
        os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
        config = env.storage_config(directory, interface_v1=False)
        config.extra_config = {"file_storage_path": directory}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.backend = ns.HiCacheFile(config, file_path=directory)
        self.directory = directory

    def set(self, keys, idx, pool: Pool) -> bool:
        # the controller's _generic_page_set
        host, p = pool.host, pool.page_size
        data = [host.get_data_page(idx[i * p]) for i in range(len(keys))]
        return bool(self.backend.batch_set(keys, data))

    def get(self, keys, idx, pool: Pool) -> bool:
        # the controller's _generic_page_get
        host, p = pool.host, pool.page_size
        dummy = [host.get_dummy_flat_data_page() for _ in keys]
        pages = self.backend.batch_get(keys, dummy)
        if pages is None:
            return False
        for i in range(len(keys)):
            if pages[i] is None:
                return False
            host.set_from_flat_data_page(idx[i * p], pages[i])
        return True

    def exists(self, keys) -> int:
        return self.backend.batch_exists(keys)

    def clear(self) -> None:
        self.backend.clear()

    def close(self) -> None:
        self.backend = None


# -- one (shape, kind) cell --------------------------------------------------------------------


def bench_cell(env, cfg, shape_name: str, kind: str, directory: str, fio_path: str | None, notes: list[str]) -> list[dict]:
    shape = SHAPES[shape_name]
    obj = shape_bytes(shape)
    page_bytes = 2 * obj
    bp = cfg.batch_pages
    batch_bytes = bp * page_bytes
    k_batches = max(cfg.pool_batches, -(-cfg.sample_bytes // batch_bytes))
    slots = min(cfg.pool_batches, k_batches)
    try:
        pool = Pool(env, shape, slots * bp, kind)
    except Skip as e:
        notes.append(f"{shape_name}/{kind}: skipped ({e})")
        return []
    except (OSError, RuntimeError, MemoryError) as e:
        notes.append(f"{shape_name}/{kind}: host pool of {slots * batch_bytes >> 20} MiB not allocated ({e})")
        return []
    capacity = max(1 * GiB, -(-(2 * k_batches * batch_bytes + 8 * 256 * MiB) // (256 * MiB)) * (256 * MiB))
    umbp = Umbp(env, os.path.join(directory, f"umbp-{shape_name}-{kind}"), pool, cfg, capacity)
    hf = HiFile(env, os.path.join(directory, f"hicache-file-{shape_name}-{kind}"), cfg)
    samples: dict[tuple[str, str], list[Sample]] = {}
    extra: dict[tuple[str, str], list[float]] = {}
    n_obj = k_batches * bp * 2  # objects of `obj` bytes per sample (HiCacheFile: 2 per file)
    total = k_batches * batch_bytes
    # fio_runs: bench_engine's run_fio may record fio's buffer layout there
    fio_cfg = argparse.Namespace(fio=cfg.fio, duration=cfg.fio_duration, fio_runs=[])
    fio_name = "fio_huge" if kind == "huge" else "fio"
    fio_ok = fio_path is not None and not cfg.fio_skip.get(fio_name)
    batch_label = fio_batch_label(fio_name, 2 * bp)  # one call's objects at once

    def fio_round(op: str, rw: str) -> bool:
        """fio at every --fio-qd for this op; False (and fio skipped from then on) when fio cannot run."""
        try:
            for qd in cfg.fio_qds:
                samples.setdefault((op, f"{fio_name}@{qd}"), []).append(
                    run_fio(fio_path, cfg.fio_file_size, rw, obj, qd, kind == "huge", fio_cfg))
            samples.setdefault((op, batch_label), []).append(
                run_fio_batch_for(cfg, fio_path, op, rw, obj, 2 * bp, kind == "huge"))
        except Skip as e:
            cfg.fio_skip[fio_name] = True
            notes.append(f"{fio_name}: skipped ({e})")
            return False
        return True

    # first and last page of every slot: checked after each system's reads
    check_at = sorted({b * bp * page_bytes + o for b in range(slots) for o in (0, (bp - 1) * page_bytes)})
    try:
        # untimed warm-up: segment files created, thread pools and first faults out of the way
        for system in (umbp, hf):
            wkeys = page_hashes(f"warmup/{shape_name}/{kind}/{system.name}", bp)
            idx = pool.slot(0, bp)
            ok = system.set(wkeys, idx) if system is umbp else system.set(wkeys, idx, pool)
            if not (ok and system.get(wkeys, idx, pool)):
                raise RuntimeError(f"{system.name}: warm-up set/get of {bp} pages failed ({shape_name}/{kind})")
            system.clear()
        for rnd in range(cfg.runs):
            keys = {s: [page_hashes(f"{shape_name}/{kind}/{rnd}/{s}/{b}", bp) for b in range(k_batches)]
                    for s in (umbp.name, hf.name)}
            ref = [pool.flat[a : a + page_bytes].copy() for a in check_at]
            # --- set: A B C
            for system in (umbp, hf):
                gc.collect()
                with Stopwatch() as sw:
                    for b in range(k_batches):
                        idx = pool.slot(b % slots, bp)
                        ok = system.set(keys[system.name][b], idx) if system is umbp else system.set(keys[system.name][b], idx, pool)
                        if not ok:
                            raise RuntimeError(f"{system.name}: batch_set of {bp} pages failed ({shape_name}/{kind})")
                samples.setdefault(("set", system.name), []).append(sw.sample(total, n_obj))
                extra.setdefault(("sync_s", system.name), []).append(syncfs(system.directory))
            if fio_ok:
                fio_ok = fio_round("set", "write")
            # --- exists (warm, as in steady state)
            probe = {s: keys[s][0] for s in keys}
            for system in (umbp, hf):
                if system.exists(probe[system.name]) != bp:
                    raise RuntimeError(f"{system.name}: batch_exists did not find the {bp} pages just written")
                lat = np.empty(cfg.exists_calls)
                pc = time.perf_counter
                with Stopwatch() as sw:
                    for i in range(cfg.exists_calls):
                        t = pc()
                        system.exists(probe[system.name])
                        lat[i] = pc() - t
                samples.setdefault(("exists", system.name), []).append(sw.sample(0, cfg.exists_calls))
                extra.setdefault(("exists_p50", system.name), []).append(float(np.percentile(lat, 50) * 1e6))
                extra.setdefault(("exists_p99", system.name), []).append(float(np.percentile(lat, 99) * 1e6))
            # --- cold get: A B C
            for system in (umbp, hf):
                pool.flat[:] = 0
                if cfg.drop_caches and not drop_caches():
                    notes.append("drop_caches failed (not root?): HiCacheFile reads may be warm")
                    cfg.drop_caches = False
                gc.collect()
                with Stopwatch() as sw:
                    for b in range(k_batches):
                        idx = pool.slot(b % slots, bp)
                        if not system.get(keys[system.name][b], idx, pool):
                            raise RuntimeError(f"{system.name}: batch_get of {bp} pages missed ({shape_name}/{kind})")
                samples.setdefault(("get", system.name), []).append(sw.sample(total, n_obj))
                for a, want in zip(check_at, ref):
                    if not np.array_equal(pool.flat[a : a + page_bytes], want):
                        raise RuntimeError(f"{system.name}: page read back differs from the page written ({shape_name}/{kind})")
            if fio_ok:
                fio_ok = fio_round("get", "read")
            umbp.clear()
            hf.clear()
    finally:
        umbp.close()
        hf.close()
        pool.close()
        for d in (umbp.directory, hf.directory):
            shutil.rmtree(d, ignore_errors=True)
    rows = []
    common = dict(buffers=kind, shape=shape_name, page_size=shape["page_size"], page_bytes=page_bytes,
                  pages_per_sample=k_batches * bp, host_pool_bytes=slots * batch_bytes)
    for op in ("set", "get"):
        for label in [umbp.name, hf.name] + [f"{fio_name}@{qd}" for qd in cfg.fio_qds] + [batch_label]:
            ss = samples.get((op, label))
            if not ss:
                continue
            is_fio = label.startswith("fio")
            system = label.split("@")[0]
            row = make_row(BENCH, system, op, obj, int(label.split("@")[1]) if is_fio else bp, ss, **common)
            if not is_fio:
                row.update(ratio_fields(samples, extra, op, system, fio_name, cfg.fio_qds, batch_label))
            row["cold"] = op == "get" and cfg.drop_caches
            rows.append(row)
    for system in (umbp.name, hf.name):
        ss = samples.get(("exists", system))
        if ss:
            p50 = extra[("exists_p50", system)]
            rows.append(make_row(BENCH, system, "exists", obj, bp, ss, **common,
                                 latency_us_p50=statistics.median(p50), latency_us_p50_min=min(p50),
                                 latency_us_p50_max=max(p50), latency_us_p99=statistics.median(extra[("exists_p99", system)]),
                                 vs_hicache_file=None))
    ex = {r["system"]: r for r in rows if r["op"] == "exists"}
    if umbp.name in ex and hf.name in ex and ex[umbp.name]["latency_us_p50"] > 0:
        ex[umbp.name]["hicache_file_over_us"] = ex[hf.name]["latency_us_p50"] / ex[umbp.name]["latency_us_p50"]
    return rows


# -- driver ------------------------------------------------------------------------------------


def bench(cfg, env) -> tuple[list[dict], list[str]]:
    notes: list[str] = []
    work = WorkDir(cfg, DEFAULT_DIR, "umbp-bench-hicache-", "bench hicache")
    directory = work.path
    cfg.fio = shutil.which("fio")
    cfg.fio_skip = {}
    huge = HugePages()
    rows: list[dict] = []
    fio_path = None
    try:
        if cfg.fio:
            fio_path = os.path.join(directory, "fio.dat")
            make_test_file(fio_path, cfg.fio_file_size)
        else:
            notes.append("fio not on PATH: no fio rows, no vs_fio")
        kinds = list(cfg.buffers)
        if "huge" in kinds:
            need = 0
            for sh in cfg.shapes:
                bb = cfg.batch_pages * 2 * shape_bytes(SHAPES[sh])
                slots = min(cfg.pool_batches, max(cfg.pool_batches, -(-cfg.sample_bytes // bb)))
                need = max(need, slots * bb)
            fio_bytes = 2 * max(cfg.fio_qds + [2 * cfg.batch_pages]) * max(shape_bytes(SHAPES[sh]) for sh in cfg.shapes) + 4 * HUGE_PAGE_BYTES
            ok, why = huge.reserve(need + fio_bytes + 2 * HUGE_PAGE_BYTES)
            if not ok:
                notes.append(f"huge host pools and fio_huge skipped: {why}")
                kinds.remove("huge")
        for sh in cfg.shapes:
            for kind in kinds:
                rows += bench_cell(env, cfg, sh, kind, directory, fio_path, notes)
    finally:
        huge.restore()
        if fio_path:
            try:
                os.unlink(fio_path)
            except OSError:
                pass
        work.cleanup()
    for sh in cfg.shapes:
        o = shape_bytes(SHAPES[sh])
        notes.append(f"shape {sh}: {SHAPES[sh]}, bf16, page_first: K/V objects {o >> 10} KiB, pages {2 * o >> 10} KiB")
    if not cfg.drop_caches:
        notes.append("page cache not dropped before reads (--no-drop-caches, --smoke or not root)")
    return rows, notes


def main(argv=None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        env = load_sglang()
    except ImportError as e:
        print(f"hicache benchmark: skipped: sglang is not importable here ({e})")
        if cfg.json:
            write_json([], cfg.json)
        return 0
    started = time.perf_counter()
    rows, notes = bench(cfg, env)
    print(f"hicache benchmark: {len(rows)} rows, {cfg.runs} alternating runs, {cfg.batch_pages} pages per call, "
          f"{time.perf_counter() - started:.0f} s total")
    for sh in cfg.shapes:
        sub = [r for r in rows if r.get("shape") == sh and r["op"] in ("set", "get")]
        if sub:
            print(f"\nshape {sh}:")
            print_table(sub, ratio_keys=("vs_fio", "vs_fio_best", "vs_hicache_file", "gbps_incl_sync"))
    lat = [r for r in rows if r["op"] == "exists"]
    if lat:
        print(f"\nbatch_exists({cfg.batch_pages} pages), latency_us_p50 med [min-max]:")
        for r in lat:
            print(f"  {r['shape']:<8} {r['buffers']:<5} {r['system']:<18} {r['latency_us_p50']:.1f} us "
                  f"[{r['latency_us_p50_min']:.1f}-{r['latency_us_p50_max']:.1f}]  p99 {r['latency_us_p99']:.1f} us")
    finish(cfg, rows, notes, targets=targets(rows), plot_rows=[r for r in rows if r["op"] in ("set", "get")],
           title="HiCache L3: umbp_nvme vs HiCacheFile vs fio")
    return 0


if __name__ == "__main__":
    sys.exit(main())
