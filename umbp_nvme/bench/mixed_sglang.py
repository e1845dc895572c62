"""``bench mixed --sglang``: prefetch while backup through the SGLang backend, on real host pools.

The same cells as ``bench mixed`` (spaced and back-to-back gets, rounds of [backup alone, gets
beside it, gets alone], ratios within a round), driven the way SGLang's cache controller drives
L3: ``UMBPNvmeStore`` made by the dynamic loader on an ``MHATokenToKVPoolHost`` (page_first,
bf16), prefetch = ``batch_get_v1`` of P pages into free host slots, backup = ``batch_set_v1`` of
24 pages (48 K/V objects) back to back in another thread. Object sizes: 1 MiB (page 16, 8 KV
heads) and 4 MiB (page 64, Llama-3-8B). Every prefetched page is compared with the bytes it was
backed up from, in place: memcmp of its K and V views against the source page's, after a memset
zeroed them (no copies: the check takes little of the 2 cores from the backup thread). Needs sglang (``tools/install_sglang.sh``); without it: a note, no rows.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import statistics
import threading
import time

import numpy as np

from ..sglang.keys import KeyScheme
from .engine import phys_runs
from .mixed_measure import SPACING_X, LoopProbe, loaded_gets, pct, row, solo_window

SHAPES = {1 << 20: dict(page_size=16, layers=32, heads=8, head_dim=128), 4 << 20: dict(page_size=64, layers=32, heads=8, head_dim=128)}
BACKUP_PAGES = 24  # 48 K/V objects per batch_set_v1
READ_PAGES = 32

_libc = ctypes.CDLL(None)
_libc.memcmp.restype, _libc.memcmp.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


class Backend:
    """One backend on one host pool: pages [0, READ_PAGES) hold the read set, then the backup
    batch's pages, then the prefetch destination."""

    def __init__(self, env, directory: str, size: int, max_get_pages: int, knob: str, slice_bytes: int,
                 crc_keys: dict):
        from .hicache import Pool

        shape = SHAPES[size]
        self.pool = Pool(env, shape, READ_PAGES + BACKUP_PAGES + max_get_pages, "4k")
        self.tokens = shape["page_size"]
        shutil.rmtree(directory, ignore_errors=True)
        config = env.storage_config(directory, extra={
            "ssd_capacity_bytes": 4 << 30, "ssd_segment_size_bytes": 256 << 20, "ssd_durability_mode": "strict",
            "ssd_io_backend": "io_uring", "ssd_read_priority": knob, "ssd_write_slice_bytes": slice_bytes,
            **crc_keys,
        })  # fmt: skip
        self.backend = env.load_backend(config, self.pool.host)
        self.scheme = KeyScheme.from_storage_config(config)
        self.read_keys = [f"read-{size}-{j}" for j in range(READ_PAGES)]
        kv = self.pool.host.kv_buffer  # the pool's bytes repeat every 16 MiB: mark each page apart
        for j in range(READ_PAGES):
            kv[:, self.slots(j, 1)[0]] = float(j)
        if not all(self.backend.batch_set_v1(self.read_keys, self.slots(0, READ_PAGES))):
            raise RuntimeError("backing up the read set failed")
        self.views = [self.page_views(p) for p in range(READ_PAGES + BACKUP_PAGES + max_get_pages)]

    def page_views(self, page: int):
        """(K, V) of one page as contiguous views of the pool (page_first: a page's tokens are
        adjacent), so the check reads them in place."""
        kv, idx = self.pool.host.kv_buffer, self.slots(page, 1)
        first = int(idx[0])
        if [int(t) for t in idx] != list(range(first, first + self.tokens)):
            raise RuntimeError(f"host pool page {page} is not {self.tokens} adjacent token slots")
        views = kv[0, first : first + self.tokens], kv[1, first : first + self.tokens]
        assert all(v.is_contiguous() for v in views)
        return views

    def segs(self, first_page: int, pages: int) -> float | None:
        """Mean physically contiguous runs per K/V object of these pages (None: not root)."""
        runs = [phys_runs("self", v.data_ptr(), v.numel() * v.element_size(), v.numel() * v.element_size())
                for p in range(first_page, first_page + pages) for v in self.views[p]]  # fmt: skip
        return None if not runs or None in runs else round(float(np.mean(runs)), 1)

    def slots(self, first_page: int, pages: int):
        return self.pool.indices[first_page * self.tokens : (first_page + pages) * self.tokens]

    def put(self, keys) -> int:
        return sum(self.backend.batch_set_v1(keys, self.slots(READ_PAGES, len(keys))))

    def delete(self, keys) -> None:
        self.backend.store.delete_many(self.scheme.v1_keys(keys))

    def get(self, pick: list[int]) -> float:
        """batch_get_v1 of the picked pages into the destination slots; its seconds (the zeroing
        before it and the byte check after it are not timed)."""
        dst = READ_PAGES + BACKUP_PAGES
        keys = [self.read_keys[j] for j in pick]
        for k in range(len(keys)):  # stale bytes of an earlier get must not pass the check
            for v in self.views[dst + k]:
                ctypes.memset(v.data_ptr(), 0, v.numel() * v.element_size())
        t0 = time.perf_counter()
        ok = self.backend.batch_get_v1(keys, self.slots(dst, len(keys)))
        took = time.perf_counter() - t0
        if not all(ok):
            raise RuntimeError(f"batch_get_v1 missed {ok.count(False)} of {len(keys)} backed-up pages")
        for k, j in enumerate(pick):
            for half, got, want in zip("KV", self.views[dst + k], self.views[j]):
                if _libc.memcmp(got.data_ptr(), want.data_ptr(), got.numel() * got.element_size()):
                    raise RuntimeError(f"page {keys[k]} read back wrong bytes ({half} object)")
        return took

    def close(self) -> None:
        self.backend.close()
        self.pool.close()


class Backup:
    """batch_set_v1 of BACKUP_PAGES fresh pages back to back; each batch deleted two batches later."""

    def __init__(self, be: Backend, page_bytes: int, tag: str):
        self.be, self.page_bytes, self.tag = be, page_bytes, tag
        self.stop = threading.Event()
        self.marks: list[tuple[float, int]] = []
        self.failed = 0
        self.thread = threading.Thread(target=self._run, name="bench-backup", daemon=True)

    def _run(self) -> None:
        done, old, gen = 0, [], 0
        while not self.stop.is_set():
            keys = [f"{self.tag}-{gen}-{i}" for i in range(BACKUP_PAGES)]
            gen += 1
            n = self.be.put(keys)
            self.failed += len(keys) - n
            done += n * self.page_bytes
            self.marks.append((time.perf_counter(), done))
            old.append(keys)
            if len(old) > 2:
                self.be.delete(old.pop(0))
        for keys in old:
            self.be.delete(keys)

    def gbps(self, t0: float, t1: float) -> float:
        inside = [m for m in self.marks if t0 <= m[0] <= t1]
        before = [m for m in self.marks if m[0] < t0]
        if not inside or not before or inside[-1][0] <= before[-1][0]:
            return float("nan")
        return (inside[-1][1] - before[-1][1]) / (inside[-1][0] - before[-1][0]) / 1e9


def gets(be: Backend, pages: int, calls: int, gap: float, rng: random.Random) -> list[float]:
    lat, next_t = [], time.perf_counter()
    for _ in range(calls):
        if gap:
            delay = next_t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            next_t += gap
        lat.append(be.get(rng.sample(range(READ_PAGES), pages)) * 1e3)
    return lat


def cell(cfg, be: Backend, size: int, pages: int, pattern: str, gap: float, tag: str, notes: list) -> dict:
    idle, loaded, r50, r99, rput, solos, puts, loop_idle, loop_loaded = [], [], [], [], [], [], [], [], []
    rng = random.Random(size + pages)
    for r in range(cfg.rounds):
        bk = Backup(be, 2 * size, f"{tag}-{r}")
        bk.thread.start()
        time.sleep(cfg.warm_s)
        t0, t1 = solo_window(bk.marks, cfg.solo_s)
        with LoopProbe(be.backend.store) as probe:  # the store's loop, as the store-path rows
            lat_l = loaded_gets(bk.marks, t1, lambda: gets(be, pages, cfg.calls, gap, rng))
        t2 = time.perf_counter()
        bk.stop.set()
        bk.thread.join()
        if bk.failed:
            notes.append(f"{tag}: {bk.failed} backed-up pages failed")
        with LoopProbe(be.backend.store) as probe_idle:
            lat_i = gets(be, pages, len(lat_l), gap, rng)
        loop_idle += probe_idle.lat
        loop_loaded += probe.lat
        idle += lat_i
        loaded += lat_l
        solo = bk.gbps(t0, t1)
        solos.append(solo)
        puts.append(bk.gbps(t1, t2))
        r50.append(pct(lat_l, 50) / pct(lat_i, 50))
        r99.append(pct(lat_l, 99) / pct(lat_i, 99))
        rput.append(puts[-1] / solo if solo > 0 else float("nan"))
    med = lambda v: round(float(np.nanmedian(v)), 2)  # noqa: E731
    return dict(idle=idle, loaded=loaded, loop_idle=loop_idle, loop_loaded=loop_loaded,
                vs_idle_p50=med(r50), vs_idle_p99=med(r99), put_vs_solo=med(rput),
                put_solo_gbps=round(float(np.nanmedian(solos)), 3), put_gbps=round(float(np.nanmedian(puts)), 3))


def bench_sglang(cfg, directory: str, notes: list[str]) -> list[dict]:
    """Rows of system "sglang_on" / "sglang_off" (objects = 2 per page: K and V)."""
    from .hicache import load_sglang

    try:
        env = load_sglang()
    except ImportError as e:
        notes.append(f"--sglang: {e}; no SGLang-path rows")
        return []
    rows = []
    for knob in cfg.knobs:
        for size in cfg.sizes:
            if size not in SHAPES:
                notes.append(f"--sglang: no host-pool shape for {size}-byte objects (1M and 4M only)")
                continue
            page_counts = sorted({max(1, g // 2) for g in cfg.gets})
            be = Backend(env, os.path.join(directory, f"sglang-{knob}"), size, max(page_counts), knob,
                         cfg.slice if knob == "on" else 0, cfg.crc_keys)  # fmt: skip
            try:
                for pages in page_counts:
                    calib = gets(be, pages, cfg.calls, 0.0, random.Random(1))
                    gap = SPACING_X * statistics.median(calib) / 1e3
                    for pattern in ("b2b", "spaced"):
                        c = cell(cfg, be, size, pages, pattern, gap if pattern == "spaced" else 0.0,
                                 f"sg-{knob}-{size}-{pages}-{pattern}", notes)  # fmt: skip
                        system = f"sglang_{knob}"
                        segs = {"src_segs": be.segs(READ_PAGES, BACKUP_PAGES),
                                "dst_segs": be.segs(READ_PAGES + BACKUP_PAGES, pages)}  # fmt: skip
                        rows.append(row(system, "get_idle", size, 2 * pages, pattern, c["idle"],
                                        loop_p99_ms=round(pct(c["loop_idle"], 99), 2), **segs))  # fmt: skip
                        rows.append(row(system, "get_loaded", size, 2 * pages, pattern, c["loaded"],
                                        vs_idle_p50=c["vs_idle_p50"], vs_idle_p99=c["vs_idle_p99"],
                                        put_vs_solo=c["put_vs_solo"], put_solo_gbps=c["put_solo_gbps"],
                                        put_gbps=c["put_gbps"], loop_p99_ms=round(pct(c["loop_loaded"], 99), 2),
                                        **segs))  # fmt: skip
            finally:
                be.close()
                shutil.rmtree(os.path.join(directory, f"sglang-{knob}"), ignore_errors=True)
    return rows
