"""The cells of ``bench scheduler`` for one drive count, in their own process: per scenario a
fresh backend on SGLang's real host pool (under ``ROOT/sched-SCENARIO`` on each drive, removed
after), and ``get_stats()`` timed on the calling thread as SGLang's scheduler calls it, once per
pass (a short sleep between calls stands for the rest of the pass), then ``clear()`` timed.

    python umbp_nvme/bench/sched_probe.py --roots D0,D1 --scenarios idle,backups --json OUT

Self-contained on purpose (absolute imports of names every umbp_nvme checkout has, nothing from
this package's newer modules): ``bench scheduler --baseline-src DIR`` runs this very file against
another checkout's ``umbp_nvme`` (``PYTHONPATH=DIR``), so the before and after figures come from
the same probe in the same run.

Scenarios: ``idle``; ``backups`` (a thread writes fresh pages with ``batch_set_v1`` back to back,
evicting once the store is full); ``hung`` (the same, with the last drive's I/O never completing
until the end: an engine hook, as a stalled drive looks to io_uring, or with ``--stall-tool`` the
drive stalled in the kernel by fake-drives); ``loop_blocked`` (the same,
with a hook that blocks the store's event-loop thread itself, the worst a hung syscall there can
do). The hooks are released before the store closes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time

SCENARIOS = ("idle", "backups", "hung", "loop_blocked")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="sched_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", required=True, help="one directory per drive, comma-separated")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, run in this order")
    p.add_argument("--clears", type=int, default=2, help="clear() calls timed after the get_stats() calls")
    p.add_argument("--calls", type=int, default=2000, help="get_stats() calls timed")
    p.add_argument("--interval-s", type=float, default=0.0005, help="sleep between two calls (a scheduler pass)")
    p.add_argument("--cell-s", type=float, default=15.0, help="stop calling after this long (a call that waits "
                   "for a blocked loop takes its whole timeout)")
    p.add_argument("--pages", type=int, default=64, help="pages per backup batch")
    p.add_argument("--capacity", type=int, default=96 << 20, help="ssd_capacity_bytes (all drives together)")
    p.add_argument("--io-timeout-s", type=float, default=1.0, help="io_timeout_s of the store")
    p.add_argument("--settle-s", type=float, default=0.5, help="backups run this long before the first timed call")
    p.add_argument("--stall-tool", help="hung: stall the last drive with this fake-drives tool (`TOOL stall I`, "
                   "resumed at the end) instead of the engine hook; --roots are its mount points d0, d1, ... in order")
    p.add_argument("--json", required=True, help="where the result goes")
    p.add_argument("-v", "--verbose", action="store_true", help="show the store's log lines (the hangs log warnings)")
    return p.parse_args(argv)


def _pct(sorted_us: list[float], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


class Hang:
    """Engine hooks: I/O on fds under ``root`` waits until released (``hung``), or the first such
    call blocks the loop thread until released (``loop_blocked``). With ``tool`` (fake-drives) the
    hook only watches (``hit``) and drive ``index`` is stalled in the kernel instead."""

    def __init__(self, root: str | None, block_loop: bool, tool: str | None = None, index: int = -1):
        self.root = None if root is None else os.path.realpath(root) + os.sep
        self.block_loop = block_loop
        self.tool, self.index = tool, index
        self.stalled = False
        self.on = threading.Event()  # set: the hang is in force
        self.released = threading.Event()
        self.hit = threading.Event()  # an I/O call met the hang
        self._aevents: list = []

    def _ours(self, fd) -> bool:
        if self.root is None or not self.on.is_set():
            return False
        try:
            return os.readlink(f"/proc/self/fd/{int(fd)}").startswith(self.root)
        except (OSError, TypeError, ValueError):
            return False

    def start(self) -> None:
        if self.tool:
            subprocess.run([self.tool, "stall", str(self.index)], check=True, capture_output=True, timeout=60)
            self.stalled = True
        self.on.set()

    async def wait(self, fd) -> None:
        if not self._ours(fd):
            return
        self.hit.set()
        if self.tool:
            return  # the kernel holds this I/O
        if self.block_loop:
            self.released.wait()  # the loop thread itself stops here
            return
        ev = asyncio.Event()
        self._aevents.append((asyncio.get_running_loop(), ev))
        if self.released.is_set():
            return
        await ev.wait()

    def release(self) -> None:
        if self.stalled:  # first: a thread waiting on a stalled drive cannot even be killed
            subprocess.run([self.tool, "resume", str(self.index)], check=True, capture_output=True, timeout=60)
            self.stalled = False
        self.released.set()
        for loop, ev in self._aevents:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that loop is closed
                pass

    def factory(self):
        from umbp_nvme.engine import open_engine
        from umbp_nvme.engine.files import split_files

        hang = self

        class Hooked:
            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            @staticmethod
            def _first_fd(files):
                try:
                    fds = split_files(files)[0]
                    return int(fds[0]) if hasattr(fds, "__len__") else int(fds)
                except (IndexError, TypeError, ValueError):
                    return -1

            async def read_many(self, files, *a):
                await hang.wait(self._first_fd(files))
                return await self.inner.read_many(files, *a)

            async def write_many(self, files, *a):
                await hang.wait(self._first_fd(files))
                return await self.inner.write_many(files, *a)

            async def sync(self, fd, datasync=True):
                await hang.wait(fd)
                return await self.inner.sync(fd, datasync=datasync)

        async def make(backend, queue_depth):
            return Hooked(await open_engine(backend, queue_depth))

        return make


def backup_loop(backend, idx, pages: int, stop: threading.Event, out: dict) -> None:
    """batch_set_v1 of fresh page hashes, back to back (SGLang's backup thread under load)."""
    while not stop.is_set():
        hashes = [os.urandom(32).hex() for _ in range(pages)]
        res = backend.batch_set_v1(hashes, idx)
        out["batches"] += 1
        out["pages_ok"] += sum(1 for r in res if r)


SLOW_S = 0.001  # a call over this is explained (thread CPU time, garbage collections during it)


class GcLog:
    """The garbage collections of this process (any thread's) while it is on, with their times:
    a call that overlapped one waited for it (the collector runs holding the GIL)."""

    def __init__(self):
        self.done: list[tuple[int, float, float]] = []  # (generation, start, end), perf_counter seconds
        self._start = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info):
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.done.append((info.get("generation", -1), self._start, time.perf_counter()))

    def stop(self) -> None:
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)

    def explain(self, t0: float, t1: float, cpu_us: float) -> dict:
        """What a slow call was: its wall and on-CPU time (the rest it was off the CPU: preempted,
        or waiting for the GIL) and the collections it overlapped."""
        hits = [(g, (e - s) * 1e3) for g, s, e in self.done if s < t1 and e > t0]
        return {"wall_us": round((t1 - t0) * 1e6, 1), "cpu_us": round(cpu_us, 1),
                "gc": [f"gen{g} {ms:.1f} ms" for g, ms in hits]}  # fmt: skip


def nothing():
    return None


def run_cell(a, scenario: str, drive_roots: list[str], first_in_process: bool) -> dict:
    from umbp_nvme.bench import sglang_pools as sp

    roots = [os.path.join(r, f"sched-{scenario}") for r in drive_roots]
    hang = None
    if scenario in ("hung", "loop_blocked"):
        tool = a.stall_tool if scenario == "hung" else None
        hang = Hang(roots[-1], scenario == "loop_blocked", tool, len(roots) - 1)
    extra = {"ssd_capacity_bytes": a.capacity, "ssd_segment_size_bytes": 4 << 20, "io_timeout_s": a.io_timeout_s}
    cfg = sp.storage_config(",".join(roots), enable_storage_metrics=True, extra=extra)
    pool = sp.mha_pool(pages=2 * a.pages + 8, layers=4, heads=4, head_dim=64)
    t0 = time.perf_counter()
    if hang is None:
        backend = sp.load_backend(cfg, pool.host)  # StorageBackendFactory, as the cache controller does
    else:
        from umbp_nvme.sglang_backend import UMBPNvmeStore  # the factory takes no engine hook

        backend = UMBPNvmeStore(cfg, {}, engine_factory=hang.factory())
        backend.register_mem_pool_host(pool.host)
        backend.on_host_pools_registered()
    open_s = time.perf_counter() - t0
    idx = pool.alloc_pages(a.pages)
    sp.fill_random(pool.host, idx, seed=1)
    t0 = time.perf_counter()
    first = backend.get_stats()
    first_us = (time.perf_counter() - t0) * 1e6
    reported = sum(first.backup_pgs)

    stop = threading.Event()
    done = {"batches": 0, "pages_ok": 0}
    writer = None
    if scenario != "idle":
        writer = threading.Thread(target=backup_loop, args=(backend, idx, a.pages, stop, done), daemon=True)
        writer.start()
        time.sleep(a.settle_s)
        if hang is not None:
            hang.start()
            hang.hit.wait(timeout=30)  # the next write to the last drive meets the hang
    samples, clears, slow, floor = [], [], [], []
    drives_seen = 0
    last_degraded = False  # get_stats() showed the last drive degraded (the hang took effect)
    gcs = GcLog()
    try:
        end = time.monotonic() + a.cell_s
        for _ in range(a.calls):
            if time.monotonic() > end:
                break
            time.sleep(a.interval_s)  # the machine's own floor now: the same timing around nothing
            t0 = time.perf_counter()
            nothing()
            floor.append((time.perf_counter() - t0) * 1e6)
            time.sleep(a.interval_s)  # the rest of the scheduler's pass (releases the GIL)
            c0 = time.thread_time()
            t0 = time.perf_counter()
            m = backend.get_stats()
            t1 = time.perf_counter()
            cpu_us = (time.thread_time() - c0) * 1e6
            samples.append((t1 - t0) * 1e6)
            if t1 - t0 > SLOW_S:
                slow.append((t0, t1, cpu_us))
            reported += sum(m.backup_pgs)
            rows = getattr(m, "drives", None) or ()
            drives_seen = max(drives_seen, len(rows))
            if rows and rows[-1].get("state") == "degraded":
                last_degraded = True
        for _ in range(a.clears if hang is None else min(a.clears, 1)):  # a blocked loop: each waits the bound
            t0 = time.perf_counter()
            backend.clear()
            clears.append((time.perf_counter() - t0) * 1e6)
    finally:
        gcs.stop()
        hang_met = hang is not None and hang.hit.is_set()
        if hang is not None:
            hang.release()
        stop.set()
        if writer is not None:
            writer.join(timeout=300)
    reported += sum(backend.get_stats().backup_pgs)  # what the writer's last batches left
    t0 = time.perf_counter()
    backend.close()
    close_s = time.perf_counter() - t0
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    s, f = sorted(samples), sorted(floor)
    return {
        "scenario": scenario,
        "drives": len(roots),
        "calls": len(s),
        "p50_us": _pct(s, 0.50),
        "p99_us": _pct(s, 0.99),
        "max_us": s[-1],
        "floor_p50_us": _pct(f, 0.50),
        "floor_p99_us": _pct(f, 0.99),
        "floor_max_us": f[-1],
        "first_us": first_us,
        "first_in_process": first_in_process,
        "clear_us": clears,
        "open_s": open_s,
        "close_s": close_s,
        "drive_rows": drives_seen,
        "backup_batches": done["batches"],
        "backup_pages_ok": done["pages_ok"],
        "backup_pages_reported": reported,
        "hang_met": hang_met,
        "last_drive_degraded": last_degraded,
        "slow": [gcs.explain(t0, t1, cpu_us) for t0, t1, cpu_us in slow],
    }


def main(argv=None) -> int:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    scenarios = [x for x in a.scenarios.split(",") if x]
    bad = [x for x in scenarios if x not in SCENARIOS]
    if bad:
        raise SystemExit(f"unknown scenario(s) {bad}; expected some of {', '.join(SCENARIOS)}")
    if not a.verbose:  # the hangs are on purpose: the store's warnings about them are expected
        logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)
    from umbp_nvme.bench import sglang_pools as sp

    sp.sglang_imports()
    drive_roots = [r for r in a.roots.split(",") if r]
    cells = [run_cell(a, sc, drive_roots, i == 0) for i, sc in enumerate(scenarios)]
    out = {"umbp_nvme": os.path.dirname(os.path.abspath(sys.modules["umbp_nvme"].__file__)), "cells": cells}
    with open(a.json, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
