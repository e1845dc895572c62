"""Crash survival: a child process runs the backend and is SIGKILLed in a chosen phase (write,
sync, index commit, eviction, or by the parent at a random time); the parent reopens the store,
after a rebuild of its index by one route in turn, and checks every page against the acknowledged
state the ack log describes (``crash_run``; the version oracle: support/versions.py)."""

from __future__ import annotations

import multiprocessing as _mp
import os
import random as _random
import signal as _signal
import time as _time
from dataclasses import dataclass

from umbp_nvme.store.layout import segment_disk_bytes

from .backends import find_store_dirs, make_backend, object_keys
from .host_pool import KiB, MiB, HostPool, page_key
from .version_crash import ROUTES, rebuild_by
from .versions import (OK, RESURRECTED, STALE, WRONG, AckLog, LogState, Tally, fill_page, history, page_versions,
                       read_log, seal_after_kill)  # fmt: skip

CRASH_PHASES = ("parent", "write-before", "write-after", "sync", "commit", "evict")
_CTX = None


def mp_context():
    """forkserver with the heavy imports preloaded: a child starts in ~20 ms instead of seconds."""
    global _CTX
    if _CTX is None:
        ctx = _mp.get_context("forkserver")
        ctx.set_forkserver_preload(["support.crash_survival", "support.soak", "umbp_nvme.sglang.backend", "umbp_nvme.store"])
        _CTX = ctx
    return _CTX


@dataclass
class CrashSpec:
    root: str
    ack_path: str
    mode: str = "strict"
    capacity: int = 32 * MiB
    segment: int = 1 * MiB
    universe: int = 600
    batch: int = 16
    page_size: int = 16
    seed: int = 0
    phase: str = "parent"
    kill_p: float = 0.01
    salt: str = "crash"


def _install_kill_hooks(spec: CrashSpec, rng: _random.Random):
    """The engine_factory that kills the child in its phase (None for index phases: Index.commit is
    wrapped instead, in this child only)."""
    from umbp_nvme.store import index as index_mod

    from .faults import FaultPlan, FaultRule

    def die():
        os.kill(os.getpid(), _signal.SIGKILL)

    if spec.phase in ("write-before", "write-after", "sync"):
        ops = ("sync",) if spec.phase == "sync" else ("write",)
        when = rng.choice(("before", "after")) if spec.phase == "sync" else spec.phase.split("-")[1]
        plan = FaultPlan([FaultRule("kill", ops=ops, probability=spec.kill_p, when=when)], seed=spec.seed)
        return plan.engine_factory()
    elif spec.phase in ("commit", "evict"):
        orig_commit = index_mod.Index.commit
        lock_rng = _random.Random(spec.seed)

        def commit(self, puts=(), deletes=(), **kw):
            hit = (spec.phase == "commit" and puts) or (spec.phase == "evict" and deletes and not puts)
            if hit and lock_rng.random() < spec.kill_p * 5:
                if lock_rng.random() < 0.5:
                    die()  # before the transaction
                orig_commit(self, puts, deletes, **kw)
                die()  # committed, not yet acknowledged
            return orig_commit(self, puts, deletes, **kw)

        index_mod.Index.commit = commit
    return None


def crash_child(spec: CrashSpec, ready) -> None:
    """The child: random puts (a new version for each page not stored), reads checked against the
    model the ack log describes, deletes, a rare clear and batch_exists, until it is killed. Every
    operation is logged before and after it runs (support/versions.py)."""
    import logging

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)  # the parent reports; keep stderr quiet
    rng = _random.Random(spec.seed)
    factory = _install_kill_hooks(spec, rng)
    pool = HostPool(page_num=2 * spec.batch, page_size=spec.page_size)
    be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment,
                      engine_factory=factory)  # fmt: skip
    past = read_log(spec.ack_path)
    model, version = past.model, past.next_version
    log = AckLog(spec.ack_path)
    universe = [page_key(i, spec.salt) for i in range(spec.universe)]
    ready.set()
    B = spec.batch
    n_obj = len(be.scheme.v1_suffixes())

    def delete(keys):
        log.write([f"D{k}" for k in keys])
        be.store.delete_many(object_keys(be, keys))
        for k in keys:
            model.delete_done(k)
        log.write([f"-{k}" for k in keys])

    while True:
        r = rng.random()
        stored = [k for k in universe if model.allowed(k)]
        if r < 0.55:
            keys = rng.sample(universe, B)
            objs = be.store.exists_many(object_keys(be, keys))
            there = [sum(objs[i * n_obj : (i + 1) * n_obj]) for i in range(B)]
            partial = [k for k, t in zip(keys, there) if 0 < t < n_obj]
            if partial:  # new bytes need the old components gone (a put of a stored one is a dedup)
                delete(partial)
            vers = list(range(version, version + B))
            version += B
            held = [t == n_obj for t in there]  # stored whole: the put is a dedup
            log.write([f"?{k} {v}" for k, v, t in zip(keys, vers, held) if not t])
            for p, (k, v) in enumerate(zip(keys, vers)):
                fill_page(pool, p, k, v)
                if not held[p]:
                    model.begin_put(k, v)
            res = be.batch_set_v1(keys, pool.indices(0, B))
            # admission may decline a new page: its put answers True and stores nothing
            # (docs/cache-policy.md), so it is owed nothing: logged as refused
            now = [be.exists(k) for k in keys]
            lines = []
            for k, v, t, good, h in zip(keys, vers, held, res, now):
                if good and (t or h):
                    model.put_acked(k, v, wrote=not t)
                    lines.append(f"{'~' if t else '+'}{k} {v}")
                else:
                    model.put_refused(k, v)
                    lines.append(f"x{k} {v}")
            log.write(lines + ["="])  # one write per batch; "=": batch boundary
        elif r < 0.8 and stored:
            keys = rng.sample(stored, min(B, len(stored)))
            pool.clear_pages(B, len(keys))
            res = be.batch_get_v1(keys, pool.indices(B, len(keys)))
            lines = []
            for p, (k, good) in enumerate(zip(keys, res)):
                if good:
                    verdict = model.classify(k, page_versions(pool, B + p, k))
                    if verdict != OK:
                        lines.append({WRONG: "!", STALE: "S", RESURRECTED: "R"}[verdict] + k)
            log.write([f"r{sum(res)}"] + lines)  # "r": a read refreshed LRU
        elif r < 0.9 and stored:
            delete(rng.sample(stored, min(4, len(stored))))
        elif r < 0.905:
            log.write(["C"])
            model.begin_clear()
            be.clear()
            model.clear_done()
            log.write(["c"])
        else:
            be.batch_exists(rng.sample(universe, B))


@dataclass
class VerifyResult:
    reopened: bool = False
    existing: int = 0
    unreadable: int = 0
    over_capacity: int = 0
    raised: int = 0
    error: str = ""
    tally: Tally = None


def verify_store(spec: CrashSpec, acks: LogState, *, all_acks_must_exist: bool) -> VerifyResult:
    """Reopen through the backend; every page of the universe is checked against the acknowledged
    state: what batch_exists reports must read back as an allowed version, and what it does not
    report must not have been promised (every acknowledged page without eviction, the last batch's
    pages under it)."""
    v = VerifyResult(tally=Tally())
    pool = HostPool(page_num=64, page_size=spec.page_size)
    be = None
    model = acks.model
    if all_acks_must_exist:
        durable = None  # every page the model says must exist
    else:  # under eviction only the newest pages are sure to be kept; reads refresh others
        durable = acks.last_batch if acks.reads_after_last <= 2 else set()
    try:
        be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment)
        v.reopened = True
        universe = [page_key(i, spec.salt) for i in range(spec.universe)]
        existing = [k for k in universe if be.batch_exists([k]) == 1]
        v.existing = len(existing)
        ex = set(existing)
        for k in universe:
            if k not in ex and k in model.keys:  # a key never written promises nothing
                v.tally.check(model, k, None, durable=durable is None or k in durable)
        for i in range(0, len(existing), 64):
            chunk = existing[i : i + 64]
            pool.clear_pages(0, len(chunk), 0xEE)
            try:
                res = be.batch_get_v1(chunk, pool.indices(0, len(chunk)))
            except Exception as e:  # noqa: BLE001 - counted: must never happen
                v.raised += 1
                v.error = repr(e)
                continue
            for p, (k, ok) in enumerate(zip(chunk, res)):
                if not ok:
                    v.unreadable += 1
                else:
                    v.tally.check(model, k, page_versions(pool, p, k), durable=True)
        if not pool.guards_intact():
            v.tally.add(WRONG, "a write outside the pool")
        for d in find_store_dirs(spec.root):
            if segment_disk_bytes(d) > spec.capacity:
                v.over_capacity += 1
    except Exception as e:  # noqa: BLE001
        v.error = repr(e)
    finally:
        if be is not None:
            be.close()
        pool.close()
    return v


def fill_test(spec: CrashSpec, factor: float = 2.0) -> tuple[int, int]:
    """Write factor x capacity of fresh pages: (failed batches, bytes on disk over capacity)."""
    pool = HostPool(page_num=spec.batch, page_size=spec.page_size)
    be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment)
    failed = 0
    try:
        n = int(factor * spec.capacity / (pool.object_bytes * pool.components))
        for i in range(0, n, spec.batch):
            keys = [page_key(j, spec.salt + "-fill") for j in range(i, i + spec.batch)]
            for p, k in enumerate(keys):
                pool.fill(p, k)
            if not all(be.batch_set_v1(keys, pool.indices(0, spec.batch))):
                failed += 1
        over = sum(max(0, segment_disk_bytes(d) - spec.capacity) for d in find_store_dirs(spec.root))
    finally:
        be.close()
        pool.close()
    return failed, over


def crash_run(
    root: str,
    *,
    mode: str,
    kills: int,
    evicting: bool,
    seed: int = 0,
    max_child_s: float = 2.0,
    log=None,
) -> dict:
    """``kills`` SIGKILLs of a child writer on one store directory, verified after each. Kill i
    reopens as it is (i % 5 == 0) or rebuilds the index first by one route (power loss, deleted,
    damaged, ``verify --rebuild-index``), in turn."""
    ctx = mp_context()
    rng = _random.Random(seed)
    spec = CrashSpec(
        root=os.path.join(root, "store"),
        ack_path=os.path.join(root, "acks"),
        mode=mode,
        capacity=3 * MiB if evicting else 64 * MiB,
        segment=256 * KiB if evicting else 1 * MiB,
        universe=600 if evicting else 2400,  # keep: 2400 x 16 KiB stays under the high watermark
        kill_p=0.01 if evicting else 0.02,
        seed=seed,
        salt=f"crash-{mode}-{seed}",
    )
    out = dict(kills=0, kills_survived=0, wrong_bytes=0, lost_acknowledged=0, unreadable=0, over_capacity=0,
               raised_from_v1=0, hangs=0, phases={}, errors=[], existing_max=0, fill_failed_batches=0,
               versions_checked=0, stale_served=0, resurrected=0, rebuilds={}, examples=[], histories=[])  # fmt: skip
    phases = [p for p in CRASH_PHASES if not (p == "sync" and mode != "strict")]
    if not evicting:
        phases = [p for p in phases if p != "evict"]
    seen_child = Tally()
    for i in range(kills):
        spec.seed = rng.randrange(1 << 30)
        spec.phase = phases[i % len(phases)]
        ready = ctx.Event()
        p = ctx.Process(target=crash_child, args=(spec, ready), daemon=True)
        p.start()
        if not ready.wait(30):
            out["hangs"] += 1
            out["errors"].append(f"kill {i}: child never became ready")
        if spec.phase == "parent":
            _time.sleep(rng.uniform(0.02, 0.6))
        else:
            p.join(max_child_s)  # the child kills itself in its phase
        if p.is_alive():
            os.kill(p.pid, _signal.SIGKILL)
            died = "parent"
        else:
            died = spec.phase
        p.join(10)
        if p.exitcode != -_signal.SIGKILL:
            out["errors"].append(f"kill {i}: child exit code {p.exitcode} (phase {spec.phase})")
        out["kills"] += 1
        out["phases"][died] = out["phases"].get(died, 0) + 1
        seal_after_kill(spec.ack_path)
        acks = read_log(spec.ack_path)
        route = ("reopen",) + ROUTES
        route = route[i % len(route)]
        out["rebuilds"][route] = out["rebuilds"].get(route, 0) + 1
        try:
            for d in find_store_dirs(spec.root) if route != "reopen" else ():
                rebuild_by(route, d, spec.capacity)
        except Exception as e:  # noqa: BLE001 - a route that cannot run is a failure of the kill
            out["errors"].append(f"kill {i} ({died}): rebuild by {route} failed: {e!r}")
        v = verify_store(spec, acks, all_acks_must_exist=not evicting)
        t = v.tally
        t.merge(_since(acks.child, seen_child))  # the log holds every child's reads so far
        seen_child = acks.child
        for f in ("wrong_bytes", "lost_acknowledged", "versions_checked", "stale_served", "resurrected"):
            out[f] += getattr(t, f)
        out["examples"] = (out["examples"] + t.examples)[:8]
        for k in t.bad_keys[:2]:  # how the log saw the key, for the report
            if len(out["histories"]) < 4:
                out["histories"].append(dict(kill=i, died=died, route=route, key=k, log=history(spec.ack_path, k)))
        out["unreadable"] += v.unreadable
        out["over_capacity"] += v.over_capacity
        out["raised_from_v1"] += v.raised
        out["existing_max"] = max(out["existing_max"], v.existing)
        if v.reopened and not (t.bad() or v.unreadable or v.over_capacity or v.raised):
            out["kills_survived"] += 1
        elif v.error or not v.reopened:
            out["errors"].append(f"kill {i} ({died}): {v.error or 'reopen failed'}")
        if log:
            log(f"  {mode} {'evict' if evicting else 'keep'} kill {i + 1}/{kills} ({died}, {route}): {v.existing} pages, "
                f"{t.figures()} unreadable={v.unreadable}")
    if evicting:
        failed, over = fill_test(spec)
        out["fill_failed_batches"] = failed
        out["over_capacity"] += int(over > 0)
    return out


def _since(now: Tally, before: Tally) -> Tally:
    d = Tally(examples=now.examples[len(before.examples) :])
    for f in ("versions_checked", "wrong_bytes", "stale_served", "resurrected", "lost_acknowledged"):
        setattr(d, f, getattr(now, f) - getattr(before, f))
    return d
