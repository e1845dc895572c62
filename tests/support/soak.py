"""Races: SGLang's three controller threads + eviction under a tight cap + a follower process
(``soak_run``): no wrong byte, no stale version, no hang, no raise, bounded RSS growth, no leaked
thread.

Every page the backup thread writes anew (evicted or never stored) gets a new version
(support/versions.py); it is the only writer, so it knows each page's current version exactly. A
read must serve a version at least as new as the one current when it started (an older one is
``stale_served``: an evicted page's bytes coming back); the follower, which cannot see the
writer's versions, must never see a page's version go backwards."""

from __future__ import annotations

import os
import random as _random
import signal as _signal
import threading as _threading
import time as _time

from .backends import Caller, make_backend, object_keys
from .crash_survival import mp_context
from .host_pool import KiB, MiB, HostPool, page_key
from .versions import fill_page, page_versions


class VersionedCaller(Caller):
    """A Caller whose pages carry versions: ``shared`` (key -> current version, and the lock) on
    the writer's side; without it (a follower) each page's versions must only go forward."""

    def __init__(self, be, pool, bound_s, shared=None):
        super().__init__(be, pool, bound_s)
        self.shared = shared
        self.seen: dict = {}
        self.stale = self.checked = 0

    def set(self, keys, first_page=0) -> list:
        cur, lock = self.shared
        held = self.be.store.exists_many(object_keys(self.be, keys))  # MLA: one object a page; one writer
        with lock:
            cur["next"] += len(keys)
            vers = [cur.get(k) if h else cur["next"] - i for i, (k, h) in enumerate(zip(keys, held))]
        for p, (k, v) in enumerate(zip(keys, vers)):
            fill_page(self.pool, first_page + p, k, v if v is not None else 0)
        r = self._timed(self.be.batch_set_v1, keys, self.pool.indices(first_page, len(keys)))
        r = r if isinstance(r, list) and len(r) == len(keys) else [False] * len(keys)
        with lock:
            for k, v, h, ok in zip(keys, vers, held, r):
                if ok and not h:
                    cur[k] = v
        return r

    def get(self, keys, first_page=0) -> list:
        if self.shared is not None:
            with self.shared[1]:
                floor = [self.shared[0].get(k) for k in keys]
        else:
            floor = [self.seen.get(k) for k in keys]
        self.pool.clear_pages(first_page, len(keys), 0xEE)
        r = self._timed(self.be.batch_get_v1, keys, self.pool.indices(first_page, len(keys)))
        if not isinstance(r, list) or len(r) != len(keys):
            return [False] * len(keys)
        for p, (k, ok, f) in enumerate(zip(keys, r, floor)):
            if not ok:
                continue
            self.checked += 1
            (v,) = page_versions(self.pool, first_page + p, k)
            if v is None:
                self.wrong += 1
                self.errors.append(f"wrong bytes for page {k[:12]}")
            elif f is not None and v < f:
                self.stale += 1
                self.errors.append(f"page {k[:12]} served version {v} after version {f}")
            elif self.shared is None:
                self.seen[k] = v
        if not self.pool.guards_intact():
            self.wrong += 1
            self.errors.append("write outside the registered pool memory")
        return r


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


SOAK_UNIVERSE = 800
MIN_CHECKED = 200  # reads checked on the writer's side before a short soak may end


def _soak_extra(root: str) -> dict:
    return dict(mode="relaxed", capacity=2 * MiB, segment=128 * KiB, io_timeout_s=5.0)


def soak_follower(root: str, seconds: float, result_q) -> None:
    """A TP-rank-1 MLA process: read-only on the leader's directory, verifying every hit."""
    import logging

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)  # misses under eviction are expected
    pool = HostPool(page_num=16, mla=True)
    stats = dict(calls=0, hits=0, wrong=0, raised=0, hangs=0, max_s=0.0)
    be = None
    try:
        be = make_backend(root, pool, mla=True, tp_rank=1, tp_size=2, **_soak_extra(root))
        rng = _random.Random(7)
        c = VersionedCaller(be, pool, bound_s=30.0)
        universe = [page_key(i, "soak") for i in range(SOAK_UNIVERSE)]
        end = _time.monotonic() + seconds
        while _time.monotonic() < end:
            keys = rng.sample(universe, 16)
            r = c.get(keys)
            stats["hits"] += sum(r)
            c.exists(keys)
        stats.update(calls=c.calls, wrong=c.wrong, raised=c.raised, hangs=c.hangs, max_s=round(c.max_s, 2),
                     stale=c.stale, checked=c.checked)  # fmt: skip
        # a set on a follower must answer True per page without writing (docs/sglang.md §6)
        r = be.batch_set_v1(universe[:4], pool.indices(0, 4))
        if r != [True] * 4:
            stats["raised"] += 1
    except Exception as e:  # noqa: BLE001
        stats["raised"] += 1
        stats["error"] = repr(e)
    finally:
        if be is not None:
            be.close()
    result_q.put(stats)


def soak_run(root: str, *, seconds: float = 60.0, follower: bool = True, log=None) -> dict:
    B = 16
    n_threads0 = _threading.active_count()
    pool = HostPool(page_num=3 * B, mla=True)
    be = make_backend(root, pool, mla=True, tp_rank=0, tp_size=2, **_soak_extra(root))
    universe = [page_key(i, "soak") for i in range(SOAK_UNIVERSE)]
    stop = _threading.Event()
    last = {}
    shared = ({"next": 0}, _threading.Lock())  # page -> its current version; "next": the last handed out
    callers = {name: VersionedCaller(be, pool, bound_s=30.0, shared=shared) for name in ("exists", "io", "backup")}
    counts = dict(exists=0, io=0, backup=0, hits=0, acked=0)

    def prefetch_exists():
        rng = _random.Random(1)
        c = callers["exists"]
        while not stop.is_set():
            s = rng.randrange(SOAK_UNIVERSE - 64)
            c.exists(universe[s : s + rng.randrange(1, 64)])
            counts["exists"] += 1
            _time.sleep(0.0005)  # SGLang's prefetch thread waits on its queue between queries
            last["exists"] = _time.monotonic()

    def prefetch_io():
        rng = _random.Random(2)
        c = callers["io"]
        while not stop.is_set():
            r = c.get(rng.sample(universe, B), B)
            counts["io"] += 1
            counts["hits"] += sum(r)
            last["io"] = _time.monotonic()

    def backup():
        rng = _random.Random(3)
        c = callers["backup"]
        while not stop.is_set():
            r = c.set(rng.sample(universe, B), 0)
            counts["backup"] += 1
            counts["acked"] += sum(r)
            last["backup"] = _time.monotonic()

    fproc = fq = None
    if follower:
        ctx = mp_context()
        fq = ctx.Queue()
        fproc = ctx.Process(target=soak_follower, args=(root, seconds, fq), daemon=True)
    threads = [_threading.Thread(target=f, name=f"soak-{f.__name__}", daemon=True) for f in (prefetch_exists, prefetch_io, backup)]
    t0 = _time.monotonic()
    for k in ("exists", "io", "backup"):
        last[k] = t0
    for t in threads:
        t.start()
    if fproc is not None:
        fproc.start()
    rss_warm = None
    hangs = 0
    # On a loaded machine the first seconds can pass in start-up (threads, the follower's imports):
    # run on, up to 4x as long, until the writer side has checked some reads.
    while _time.monotonic() - t0 < seconds or (
        sum(c.checked for c in callers.values()) < MIN_CHECKED and _time.monotonic() - t0 < 4 * seconds
    ):
        _time.sleep(0.5)
        now = _time.monotonic()
        if rss_warm is None and now - t0 >= seconds * 0.25:
            rss_warm = _rss_bytes()
        stalled = [k for k, v in last.items() if now - v > 30.0]
        if stalled:
            hangs += len(stalled)
            if log:
                log(f"  soak: threads {stalled} made no progress for 30 s")
            break
    stop.set()
    for t in threads:
        t.join(60)
        if t.is_alive():
            hangs += 1
    elapsed = _time.monotonic() - t0
    rss_end = _rss_bytes()
    fstats = {}
    if fproc is not None:
        try:
            fstats = fq.get(timeout=seconds + 60)
        except Exception:  # noqa: BLE001
            fstats = dict(error="follower reported nothing", hangs=1)
        fproc.join(30)
        if fproc.is_alive():
            os.kill(fproc.pid, _signal.SIGKILL)
    st = be.store_stats().get("store", {})
    be.close()
    pool.close()
    _time.sleep(0.2)
    threads_leaked = max(0, _threading.active_count() - n_threads0)
    wrong = sum(c.wrong for c in callers.values()) + int(fstats.get("wrong", 0))
    raised = sum(c.raised for c in callers.values()) + int(fstats.get("raised", 0))
    hangs += sum(c.hangs for c in callers.values()) + int(fstats.get("hangs", 0))
    growth = (rss_end - (rss_warm or rss_end)) / MiB
    out = dict(
        soak_seconds=round(elapsed, 1),
        wrong_bytes=wrong,
        stale_served=sum(c.stale for c in callers.values()) + int(fstats.get("stale", 0)),
        versions_checked=sum(c.checked for c in callers.values()) + int(fstats.get("checked", 0)),
        raised_from_v1=raised,
        hangs=hangs,
        calls=counts,
        evictions=st.get("evictions"),
        bytes_used=st.get("bytes_used"),
        capacity=2 * MiB,
        rss_growth_mib=round(growth, 1),
        threads_leaked=threads_leaked,
        max_call_s=max(c.max_s for c in callers.values()),
        follower=fstats,
        errors=[e for c in callers.values() for e in c.errors[:3]],
    )
    if log:
        log(f"  soak {elapsed:.0f} s: {counts}, evictions={out['evictions']}, follower={fstats}, "
            f"rss +{growth:.1f} MiB, wrong={wrong} hangs={hangs} raised={raised}")
    return out
