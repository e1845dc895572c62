"""Crash survival: a child process runs the backend and is SIGKILLed in a chosen phase (write,
sync, index commit, eviction, or by the parent at a random time); the parent reopens the store and
verifies every acknowledged page byte for byte (``crash_run``)."""

from __future__ import annotations

import multiprocessing as _mp
import os
import random as _random
import signal as _signal
import time as _time
from dataclasses import dataclass

from umbp_nvme.store.layout import segment_disk_bytes

from .backends import find_store_dirs, make_backend
from .host_pool import KiB, MiB, HostPool, page_key

CRASH_PHASES = ("parent", "write-before", "write-after", "sync", "commit", "evict")
_CTX = None


def mp_context():
    """forkserver with the heavy imports preloaded: a child starts in ~20 ms instead of seconds."""
    global _CTX
    if _CTX is None:
        ctx = _mp.get_context("forkserver")
        ctx.set_forkserver_preload(["support.crash_survival", "support.soak", "umbp_nvme.sglang_backend", "umbp_nvme.store"])
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
    """The child: random batch_set_v1 / batch_get_v1 / batch_exists until it is killed."""
    import logging

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)  # the parent reports; keep stderr quiet
    rng = _random.Random(spec.seed)
    factory = _install_kill_hooks(spec, rng)
    pool = HostPool(page_num=2 * spec.batch, page_size=spec.page_size)
    be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment,
                      engine_factory=factory)  # fmt: skip
    fd = os.open(spec.ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    universe = [page_key(i, spec.salt) for i in range(spec.universe)]
    acked: list[str] = []
    ready.set()
    B = spec.batch
    while True:
        r = rng.random()
        if r < 0.6:
            keys = rng.sample(universe, B)
            for p, k in enumerate(keys):
                pool.fill(p, k)
            old = [be.exists(k) for k in keys]  # a re-put keeps the old entry (and its LRU age)
            res = be.batch_set_v1(keys, pool.indices(0, B))
            # admission may decline a new page (its put answers True, docs/cache-policy.md):
            # "-" acknowledged but not stored, owed nothing; "+" stored now, owed from here on
            there = [be.exists(k) for k in keys]
            ok = [k for k, good, t in zip(keys, res, there) if good and t]
            lines = "".join(f"{'~' if o else '+' if t else '-'}{k}\n" for k, o, good, t in zip(keys, old, res, there) if good)
            os.write(fd, (lines + "=\n").encode())  # one write per batch; "=": batch boundary
            acked.extend(ok)
        elif r < 0.9 and acked:
            keys = rng.sample(acked, min(B, len(acked)))
            pool.clear_pages(B, len(keys))
            res = be.batch_get_v1(keys, pool.indices(B, len(keys)))
            bad = [k for p, (k, good) in enumerate(zip(keys, res)) if good and not pool.holds(B + p, k)]
            os.write(fd, ("".join(f"!{k}\n" for k in bad) + "r\n").encode())  # "r": a read refreshed LRU
        else:
            be.batch_exists(rng.sample(universe, B))


@dataclass
class Acks:
    acked: set  # every page a batch_set_v1 acknowledged and the store held right after
    last_batch: set  # pages the last acknowledged batch newly wrote (LRU cannot have evicted them)
    child_wrong: int
    reads_after_last: int


def read_acks(path: str) -> Acks:
    acked: set = set()
    last: set = set()
    cur: set = set()
    wrong = reads = 0
    try:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    continue  # torn last line (a batch's lines are one write, so this is rare)
                c = line[0]
                if c in "+~":
                    acked.add(line[1:-1])
                    if c == "+":
                        cur.add(line[1:-1])
                elif c == "=":
                    last, cur, reads = cur, set(), 0
                elif c == "!":
                    wrong += 1
                elif c == "r":
                    reads += 1
    except FileNotFoundError:
        pass
    return Acks(acked, last, wrong, reads)


@dataclass
class VerifyResult:
    reopened: bool = False
    existing: int = 0
    wrong_bytes: int = 0
    unreadable: int = 0
    lost_acknowledged: int = 0
    over_capacity: int = 0
    raised: int = 0
    error: str = ""


def verify_store(spec: CrashSpec, acks: Acks, *, all_acks_must_exist: bool) -> VerifyResult:
    """Reopen through the backend; every page batch_exists reports must read back exactly."""
    v = VerifyResult()
    pool = HostPool(page_num=64, page_size=spec.page_size)
    be = None
    try:
        be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment)
        v.reopened = True
        universe = [page_key(i, spec.salt) for i in range(spec.universe)]
        existing = [k for k in universe if be.batch_exists([k]) == 1]
        v.existing = len(existing)
        ex = set(existing)
        if all_acks_must_exist:
            must = acks.acked
        else:  # under eviction only the newest pages are sure to be kept; reads refresh others
            must = acks.last_batch if acks.reads_after_last <= 2 else set()
        v.lost_acknowledged = len(must - ex)
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
                elif not pool.holds(p, k):
                    v.wrong_bytes += 1
        if not pool.guards_intact():
            v.wrong_bytes += 1
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
    """``kills`` SIGKILLs of a child writer on one store directory, verified after each."""
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
               raised_from_v1=0, hangs=0, phases={}, errors=[], existing_max=0, fill_failed_batches=0)
    phases = [p for p in CRASH_PHASES if not (p == "sync" and mode != "strict")]
    if not evicting:
        phases = [p for p in phases if p != "evict"]
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
        acks = read_acks(spec.ack_path)
        v = verify_store(spec, acks, all_acks_must_exist=not evicting)
        out["wrong_bytes"] += v.wrong_bytes + acks.child_wrong
        out["lost_acknowledged"] += v.lost_acknowledged
        out["unreadable"] += v.unreadable
        out["over_capacity"] += v.over_capacity
        out["raised_from_v1"] += v.raised
        out["existing_max"] = max(out["existing_max"], v.existing)
        if v.reopened and not (v.wrong_bytes or v.lost_acknowledged or v.unreadable or v.over_capacity or v.raised):
            out["kills_survived"] += 1
        elif v.error or not v.reopened:
            out["errors"].append(f"kill {i} ({died}): {v.error or 'reopen failed'}")
        if log:
            log(f"  {mode} {'evict' if evicting else 'keep'} kill {i + 1}/{kills} ({died}): {v.existing} pages, "
                f"wrong={v.wrong_bytes + acks.child_wrong} lost={v.lost_acknowledged} unreadable={v.unreadable}")
    if evicting:
        failed, over = fill_test(spec)
        out["fill_failed_batches"] = failed
        out["over_capacity"] += int(over > 0)
    return out
