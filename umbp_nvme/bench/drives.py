"""Multi-drive store benchmark: ``umbp-nvme bench store --roots D0,D1,...`` (issue 12).

For N = 1, 2, 4 (up to the roots given) a MultiDriveStore over the first N roots: puts then cold
gets of every --sizes object size, ``--batch-pages`` pages x 2 objects per call, one call at a
time, as SGLang's controller issues them. Rounds alternate over N, so ``vs_n_x_1drive`` (N-drive
GB/s / (N x 1-drive GB/s) of the same round, median over rounds) is free of drift. Rows are the
store benchmark's, with ``"drives": N``.

``--stall I`` (needs the fake-drives tool, ``--stall-tool`` or $FAKE_DRIVES): on the 4-drive store,
cold get passes with two calls in flight; drive I is stalled mid-run, and the rows give the GB/s of
hits before the stall and from the first call started after the drive was reported degraded
(``vs_before``: target >= 0.8 x 3/4), the wrong bytes (0), and, after ``resume``, whether the drive
rejoined and served its pages again. Run it under ``fake-drives run`` so the caps apply.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import subprocess
import time

import numpy as np

from umbp_nvme.config import StoreConfig
from umbp_nvme.store.drives import MultiDriveStore
from umbp_nvme.store.page_store import PageStore

from .common import Sample, Stopwatch, make_row, page_keys, paired_ratio

BENCH = "store"


def _counts(n_roots: int) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= n_roots]


class Batches:
    """Keys and source bytes: object j of batch b holds slot j's random bytes, its first 8 bytes b."""

    def __init__(self, tag: str, size: int, n_obj: int, batches: int):
        self.size, self.n_obj, self.n = size, n_obj, batches
        pages = n_obj // 2
        self.keys = [page_keys(f"{tag}/{size}/{b}", pages) for b in range(batches)]
        self.src_map = mmap.mmap(-1, n_obj * size)
        self.src = np.frombuffer(self.src_map, np.uint8)
        self.src[:] = np.random.default_rng(size).integers(0, 256, self.src.size, dtype=np.uint8)

    def stamp(self, b: int) -> None:
        v = self.src.reshape(self.n_obj, self.size)
        v[:, :8] = np.frombuffer(np.int64(b).tobytes(), np.uint8)

    def tuples(self, arr: np.ndarray) -> list[tuple[int, int]]:
        a0 = arr.ctypes.data
        return [(a0 + j * self.size, self.size) for j in range(self.n_obj)]

    def wrong(self, b: int, dst: np.ndarray, res: list[bool]) -> int:
        """Objects reported hits whose bytes are not batch b's (any byte off counts the object)."""
        self.stamp(b)
        s, d = self.src.reshape(self.n_obj, self.size), dst.reshape(self.n_obj, self.size)
        return sum(1 for j, ok in enumerate(res) if ok and not np.array_equal(s[j], d[j]))


def _config(cfg, root_spec, capacity: int, **kw) -> StoreConfig:
    return StoreConfig(
        ssd_storage_dir=root_spec, ssd_capacity_bytes=capacity, ssd_segment_size_bytes=cfg.segment_bytes,
        ssd_durability_mode=cfg.durability, ssd_io_backend="io_uring", ssd_queue_depth=256, **kw,
    )  # fmt: skip


def _dirs(roots: list[str], n: int, name: str) -> list[str]:
    out = [os.path.join(r, name) for r in roots[:n]]
    for d in out:
        shutil.rmtree(d, ignore_errors=True)
    return out


async def _open(cfg, dirs: list[str], per_drive: int, **kw):
    seg = cfg.segment_bytes
    cap = len(dirs) * (-(-int(per_drive * 1.5 + 2 * seg) // seg) * seg)
    return await PageStore.open(dirs if len(dirs) > 1 else dirs[0], _config(cfg, dirs, cap, **kw))


async def one_round(cfg, roots: list[str], n: int, size: int, dst: np.ndarray, rnd: int) -> dict:
    n_obj = cfg.batch_pages * 2
    k = max(1, -(-cfg.sample_bytes // (n_obj * size)))
    data = Batches(f"drives{n}/r{rnd}", size, n_obj, k)
    dirs = _dirs(roots, n, f"umbp-bench-drives-{n}")
    store = await _open(cfg, dirs, cfg.sample_bytes // n)
    out = {}
    try:
        src, dsts = data.tuples(data.src), data.tuples(dst)
        for a, nb in ((data.src.ctypes.data, data.src.nbytes), (dst.ctypes.data, dst.nbytes)):
            store.register_memory(a, nb)
        with Stopwatch() as sw:
            for b in range(k):
                data.stamp(b)
                res = await store.put_many(data.keys[b], src)
                if not all(res):
                    raise RuntimeError(f"{n} drives: put_many failed for {res.count(False)} of {n_obj} objects")
        out["put"] = sw.sample(k * n_obj * size, k * n_obj)
        with Stopwatch() as sw:
            for b in range(k):
                res = await store.get_many(data.keys[b], dsts)
                if not all(res):
                    raise RuntimeError(f"{n} drives: get_many missed {res.count(False)} of {n_obj} objects")
        out["get"] = sw.sample(k * n_obj * size, k * n_obj)
        wrong = data.wrong(k - 1, dst, res)  # the last batch is still in dst: checked off the clock
        if wrong:
            raise RuntimeError(f"{n} drives: {wrong} objects read back wrong")
        st = store.stats()
        out["o_direct"] = st.get("o_direct")
    finally:
        await store.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return out


async def bench_drives(cfg) -> tuple[list[dict], list[str]]:
    roots, notes, rows = cfg.roots, [], []
    counts = _counts(len(roots))
    n_obj = cfg.batch_pages * 2
    dst_map = mmap.mmap(-1, n_obj * max(cfg.sizes))
    for size in cfg.sizes:
        dst = np.frombuffer(dst_map, np.uint8)[: n_obj * size]
        samples: dict[tuple[str, int], list[Sample]] = {}
        for rnd in range(cfg.runs):
            for n in counts:
                r = await one_round(cfg, roots, n, size, dst, rnd)
                if r.get("o_direct") is False:
                    notes.append(f"{n} drives: O_DIRECT refused, reads were not cold")
                for op in ("put", "get"):
                    samples.setdefault((op, n), []).append(r[op])
        for op in ("put", "get"):
            one = samples[op, 1]
            for n in counts:
                ss = samples[op, n]
                scaled = [Sample(s.nbytes * n, s.ops, s.wall_s, s.cpu_s) for s in one]  # N x the 1-drive figure
                vs = paired_ratio(ss, scaled) if n > 1 else None
                rows.append(make_row(BENCH, "umbp_store", op, size, n_obj, ss, drives=n, cold=op == "get",
                                     vs_n_x_1drive=vs))  # fmt: skip
    if cfg.stall is not None:
        rows += await bench_stall(cfg, roots, notes)
    return rows, notes


def _tool(cfg, *args) -> None:
    tool = cfg.stall_tool or os.environ.get("FAKE_DRIVES") or "fake-drives"
    r = subprocess.run([tool, *args], capture_output=True, text=True, timeout=60)
    if r.returncode:
        raise RuntimeError(f"{tool} {' '.join(args)} failed: {r.stderr.strip()}")


async def _get_pass(store, data: Batches, pool: list[np.ndarray], inflight: set, on_done, stuck_s: float) -> None:
    """Cold get of every batch, two calls in flight. A call running longer than ``stuck_s`` is
    stuck on a stalled drive: it keeps its buffer (the kernel may own it) but not its slot."""

    def live():
        now = time.perf_counter()
        return [t for t in inflight if not t.done() and now - t.t0 < stuck_s]

    async def room(limit: int):
        while len(live()) > limit or not pool:
            done, _ = await asyncio.wait(inflight, timeout=0.05, return_when=asyncio.FIRST_COMPLETED)
            inflight.difference_update(done)

    for b in range(data.n):
        await room(1)
        dst = pool.pop()

        async def one(b=b, dst=dst):
            t0 = time.perf_counter()
            res = await store.get_many(data.keys[b], data.tuples(dst))
            on_done(b, dst, res, t0, time.perf_counter())
            pool.append(dst)

        task = asyncio.ensure_future(one())
        task.t0 = time.perf_counter()
        inflight.add(task)
    await room(0)


async def bench_stall(cfg, roots: list[str], notes: list[str]) -> list[dict]:
    n = 4
    if len(roots) < n:
        notes.append("stall run skipped: it needs 4 roots")
        return []
    size = cfg.sizes[0]
    n_obj = cfg.batch_pages * 2
    k = max(4, -(-cfg.sample_bytes // (n_obj * size)))
    data = Batches("stall", size, n_obj, k)
    dirs = _dirs(roots, n, "umbp-bench-drives-stall")
    # room per drive for three passes of puts, one of them on 3 drives, far below the watermarks
    store: MultiDriveStore = await _open(cfg, dirs, cfg.sample_bytes, io_timeout_s=cfg.stall_timeout_s)
    store.probe_interval_s = 0.5
    maps = [mmap.mmap(-1, n_obj * size) for _ in range(4)]
    pool = [np.frombuffer(m, np.uint8) for m in maps]
    for arr in pool + [data.src]:
        store.register_memory(arr.ctypes.data, arr.nbytes)
    log: list[tuple[float, float, int, int, int]] = []  # (start, end, hit bytes, misses, wrong)

    def on_done(b, dst, res, t0, t1):
        log.append((t0, t1, sum(res) * size, len(res) - sum(res), data.wrong(b, dst, res)))

    inflight: set = set()
    stuck = cfg.stall_timeout_s + 0.5  # past the store's io_timeout_s: the drive is reported by then
    stalled = resumed = False
    try:
        src = data.tuples(data.src)
        if (await _put_pass(store, data, data.keys, src))[0] != k * n_obj * size:  # also warms the files up
            raise RuntimeError("stall run: a put failed before the stall")
        put_before = await _put_pass(store, data, [[f"pre/{key}" for key in keys] for keys in data.keys], src)
        t_a = time.perf_counter()
        await _get_pass(store, data, pool, inflight, on_done, stuck)
        before = (sum(x[2] for x in log), time.perf_counter() - t_a)
        log.clear()
        _tool(cfg, "stall", str(cfg.stall))
        stalled, t_stall = True, time.perf_counter()
        await _get_pass(store, data, pool, inflight, on_done, stuck)  # the first calls hit the stall
        h = store.health[cfg.stall]
        detected = h.since if not h.healthy else None
        if detected is None:
            raise RuntimeError("stall run: the stalled drive was never reported degraded")
        t_det = time.perf_counter() - (time.monotonic() - detected)
        log.clear()
        t_b = time.perf_counter()
        await _get_pass(store, data, pool, inflight, on_done, stuck)  # every call starts after detection
        after = (sum(x[2] for x in log if x[0] >= t_det), time.perf_counter() - t_b)
        wrong = sum(x[4] for x in log)
        misses = sum(x[3] for x in log)
        new_keys = [[f"new/{key}" for key in keys] for keys in data.keys]
        put_after = await _put_pass(store, data, new_keys, src)  # new pages: onto the 3 healthy drives
        state = store.stats()["drives"][cfg.stall]
        _tool(cfg, "resume", str(cfg.stall))
        resumed = True
        await asyncio.gather(*inflight)
        inflight.clear()
        for _ in range(int(cfg.stall_timeout_s * 20) + 60):
            if store.health[cfg.stall].healthy:
                break
            await asyncio.sleep(0.1)
        log.clear()
        await _get_pass(store, data, pool, inflight, on_done, stuck)
        await asyncio.gather(*inflight)
        rejoined = store.health[cfg.stall].healthy and all(x[3] == 0 for x in log)
        wrong += sum(x[4] for x in log)
    finally:
        if stalled and not resumed:
            _tool(cfg, "resume", str(cfg.stall))
        await asyncio.gather(*inflight, return_exceptions=True)
        await store.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    rows = []
    for op, pre, post in (("get", before, after), ("put", put_before, put_after)):
        ratio = round((post[0] / post[1]) / (pre[0] / pre[1]), 3)
        for phase, (nb, secs) in (("before_stall", pre), ("after_detection", post)):
            s = Sample(nb, max(1, nb // size), secs, 0.0)
            rows.append(make_row(BENCH, "umbp_store_stall", op, size, n_obj, [s], drives=n, cold=op == "get",
                                 phase=phase, vs_before=ratio if phase == "after_detection" else None,
                                 detect_s=round(t_det - t_stall, 2), wrong_objects=wrong, misses_after=misses,
                                 degraded_reason=state["reason"], degraded_state=state["state"],
                                 rejoined_and_served=rejoined))  # fmt: skip
    return rows


async def _put_pass(store, data: Batches, keys: list[list[str]], src) -> tuple[int, float]:
    """Put every batch, one call at a time: (bytes stored, seconds)."""
    stored, t0 = 0, time.perf_counter()
    for b, ks in enumerate(keys):
        data.stamp(b)
        stored += sum(await store.put_many(ks, src)) * data.size
    return stored, time.perf_counter() - t0


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        v = r.get("vs_n_x_1drive")
        if v is not None:
            out.append(f"{r['op']} {r['object_bytes'] >> 20} MiB on {r['drives']} drives: {r['gbps']:.3f} GB/s = "
                       f"{v:.3f} x N x 1-drive (target >= 0.9) {'MET' if v >= 0.9 else 'NOT MET'}")  # fmt: skip
        if r.get("phase") == "after_detection":
            v = r["vs_before"]
            ok = v >= 0.6 and r["wrong_objects"] == 0 and r["rejoined_and_served"]
            out.append(f"stall of 1 of 4 drives, {r['op']}: {r['gbps']:.3f} GB/s after detection "
                       f"({r['detect_s']} s after the stall) = {v:.3f} x before (target >= 0.8 x 3/4 = 0.6), wrong objects {r['wrong_objects']}, "
                       f"drive {r['degraded_state']} ({r['degraded_reason']}), rejoined and served: "
                       f"{r['rejoined_and_served']} {'MET' if ok else 'NOT MET'}")  # fmt: skip
    return out


