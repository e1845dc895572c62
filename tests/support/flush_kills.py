"""A relaxed writer's flush SIGKILLed at each of its steps (store/flushing.py).

The flush is several steps: every segment fdatasynced, then segment by segment the record blocks
that left memory holding unconfirmed records read back, confirmed and written, then a sync again
and the index's sync. The child puts, re-puts (new versions in freed slots) and deletes with no
record cache (``ssd_record_cache_bytes=0``: every block leaves memory once written, so the flush
must read them all back), then flushes under an engine wrapper that counts the flush's engine
calls (read_many, write_many, sync) and kills the process before or after call ``k``; with ``k``
past the last call it kills itself after the flush returned. ``flush_calls`` is the count the
wrapper saw in a child that was not killed. The parent checks every key against the version
oracle (support/versions.py) after a reopen and after a rebuild from the records alone.

``phase="settle"`` kills the same way inside a relaxed writer's settle instead (flushing.py: the
put batch that fills segment 0, then the settle it starts: sync, confirm, block write), with a
record cache that holds the segment's blocks, so the settle has records in memory to confirm.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from umbp_nvme.config import StoreConfig
from umbp_nvme.engine import open_engine
from umbp_nvme.store import PageStore
from umbp_nvme.store.index import INDEX_FILE

from .version_crash import Session, run_killed
from .versions import AckLog, Tally, VersionModel, read_log, version_in

MiB = 1 << 20
OBJ = 4096
COUNTED = ("read_many", "write_many", "sync")


@dataclass
class FlushKill:
    k: int = -1  # the counted call to kill at (-1: none: report the count and kill after the flush)
    after: bool = False  # kill after the call returned, not before it was made
    keys: int = 320  # over two segments of 1 MiB at 4 KiB: ~20 record blocks
    phase: str = "flush"  # or "settle": the put batch that fills segment 0 and the settle it starts

    def config(self) -> StoreConfig:
        # the settle confirms blocks still in memory: a cache that holds a segment's (15 blocks)
        cache = 0 if self.phase == "flush" else 64 * 4096
        return StoreConfig(ssd_capacity_bytes=16 * MiB, ssd_segment_size_bytes=1 * MiB, ssd_durability_mode="relaxed",
                           ssd_record_cache_bytes=cache, ssd_queue_depth=64, io_timeout_s=20.0)  # fmt: skip

    def names(self) -> list[str]:
        return [f"flush-{i:04d}" for i in range(self.keys)]


class CountingEngine:
    """The real engine; while armed, counts COUNTED calls and SIGKILLs the process at one."""

    def __init__(self, inner, plan: dict):
        self.inner, self.plan = inner, plan

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in COUNTED:
            return attr

        async def counted(*a, **kw):
            p = self.plan
            if not p["armed"]:
                return await attr(*a, **kw)
            n = p["calls"]
            p["calls"] += 1
            if n == p["k"] and not p["after"]:
                os.kill(os.getpid(), signal.SIGKILL)
            out = await attr(*a, **kw)
            if n == p["k"] and p["after"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        return counted


def flush_child(c: FlushKill, path: str, log_path: str, count_path: str) -> None:
    import logging

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)
    plan = {"armed": False, "calls": 0, "k": c.k, "after": c.after}

    async def factory(backend, qd):
        return CountingEngine(await open_engine(backend, qd), plan)

    async def main():
        st = await PageStore.open(path, c.config(), engine_factory=factory)
        s = Session(st, OBJ, VersionModel(), AckLog(log_path), 1)
        keys = c.names()
        a = st.writer.alloc
        for lo in range(0, len(keys), 16):
            if c.phase == "settle" and a.seg_used[0] + 16 >= a.slots(OBJ):  # this batch fills segment 0
                plan["armed"] = True
                await s.put(keys[lo : lo + 16])
                while st.writer.settles:  # the settle it started: sync, confirm, block write
                    await asyncio.sleep(0.005)
                ok = True
                break
            await s.put(keys[lo : lo + 16])
        if c.phase == "flush":
            await s.reput(keys[::5])  # new versions into freed slots: the old versions' records are dead
            await s.delete(keys[1::7])  # tombstones in blocks that left memory
            plan["armed"] = True
            ok = await st.flush()
        with open(count_path, "w") as f:
            f.write(f"{plan['calls']} {int(ok)}")
        os.kill(os.getpid(), signal.SIGKILL)  # past the last step: killed after the flush

    asyncio.run(main())


def run_child(c: FlushKill, path: str, log_path: str, count_path: str) -> None:
    """``flush_child`` in a fresh interpreter; it must end by its SIGKILL."""
    run_killed("support.flush_kills", "FlushKill", "flush_child", c, path, log_path, count_path)


async def check(st: PageStore, model: VersionModel, keys: list[str], tally: Tally) -> None:
    """Every key as the store serves it; a process kill loses nothing acknowledged (page cache)."""
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    got = await st.get_many(keys, outs)
    there = await st.exists_many(keys)
    for k, g, o, t in zip(keys, got, outs, there):
        tally.check(model, k, [version_in(k, o)] if g else None, durable=True)
        if t and not g:  # exists said yes and the read failed: counted as a loss above
            tally.examples.append(f"{k}: exists but the read failed")


async def survive(c: FlushKill, path: str, log_path: str) -> Tally:
    """What the kill left, checked twice: rebuilt from the records alone, as the kill left them (on
    a copy: an open after an unclean close rewrites the records from the index), and reopened."""
    model = read_log(log_path, killed=True).model
    tally = Tally()
    copy = path + "-records"
    shutil.copytree(path, copy)
    os.unlink(os.path.join(copy, INDEX_FILE))
    for p in (copy, path):
        st = await PageStore.open(p, c.config())
        try:
            await check(st, model, c.names(), tally)
        finally:
            await st.close()
    return tally


def flush_kill_run(work: str, log=None, phase: str = "flush") -> dict:
    """Every kill point of the flush (before and after each counted call, and after it returned):
    a child killed there, then ``survive``. Figures in the chaos report's terms. ``phase="settle"``:
    the same for a relaxed writer's settle of a segment (flushing.py) and the put that starts it."""
    say = log or (lambda s: None)
    out = dict(kills=0, kills_survived=0, versions_checked=0, wrong_bytes=0, stale_served=0, resurrected=0,
               lost_acknowledged=0, flush_calls=0, errors=[], examples=[])  # fmt: skip
    os.makedirs(work, exist_ok=True)

    def child(c: FlushKill, name: str) -> tuple[str, str, str]:
        d = os.path.join(work, name)
        os.makedirs(d)
        paths = (os.path.join(d, "store"), os.path.join(d, "acks"), os.path.join(d, "count"))
        run_child(c, *paths)
        return paths

    whole = child(FlushKill(phase=phase), "whole")
    calls, ok = map(int, open(whole[2]).read().split())
    out["flush_calls"] = calls
    if not ok:
        out["errors"].append("the flush that was not killed answered False")
    def point(k: int, after: bool) -> Tally:
        c = FlushKill(k=k, after=after, phase=phase)
        path, log_path, count = whole if k < 0 else child(c, f"k{k}-{int(after)}")
        if k >= 0 and os.path.exists(count):
            raise RuntimeError(f"kill point {k} ({'after' if after else 'before'}) was never reached")
        return asyncio.run(survive(c, path, log_path))

    points = [(-1, False)] + [(k, a) for k in range(calls) for a in (False, True)]
    with ThreadPoolExecutor(2) as pool:  # two points at a time, each in its own directory (a second core)
        done = [pool.submit(point, k, after) for k, after in points]
    for (k, after), f in zip(points, done):
        try:
            t = f.result()
        except Exception as e:  # noqa: BLE001 - counted, the run goes on
            out["kills"] += 1
            out["errors"].append(f"flush kill {k}/{after}: {e!r}")
            continue
        out["kills"] += 1
        out["kills_survived"] += 1
        for f, v in t.figures().items():
            out[f] += v
        out["examples"] += t.examples[: 8 - len(out["examples"])]
        say(f"flush kill {k} {'after' if after else 'before'}: {t.figures()}")
    return out
