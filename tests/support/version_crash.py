"""Version-aware crash cases (issue 25): a put killed between its data+records and its index
commit, then the next session deletes / re-puts / clears, then every rebuild route, then every key
is checked against the acknowledged state with the version oracle (support/versions.py).

The layout is the one that exposed the bugs: segment 0 full of ``fill`` keys (some re-put with a
new version, so older versions exist on disk), the ``victims`` put in segment 1 and deleted (it is
left empty), many hits (they tick the generation clock), then a put of ``pads`` and the victims
with new versions, killed once its data and records are on disk (strict: after the fdatasync;
relaxed: after the record write). The victims' records lie beyond record block 0 of an empty
segment, where the next session's first put does not overwrite them.

``run_version_cases(root, quick=True)`` kills one child and runs each (action, route) on a copy of
what it left; the full mode kills one child per layout (both durability modes, two size classes,
more victims and pads) and runs every combination on each.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

from umbp_nvme.config import StoreConfig
from umbp_nvme.cli.maintenance import rebuild_index_dir
from umbp_nvme.store import PageStore, layout
from umbp_nvme.store.index import INDEX_FILE, Index
from umbp_nvme.store.rebuild import rebuild_records
from umbp_nvme.store.records import area_blocks

from .versions import AckLog, Tally, VersionModel, read_log, seal_after_kill, version_in, versioned

ROUTES = ("power_loss", "index_lost", "index_damaged", "verify")
ACTIONS = ("mixed", "clear")
MiB = 1 << 20


@dataclass
class Layout:
    mode: str = "strict"
    obj: int = 4096
    victims: int = 8
    pads: int = 16
    hits: int = 64
    seed: int = 0
    segment: int = 1 * MiB
    capacity: int = 16 * MiB

    def config(self) -> StoreConfig:
        return StoreConfig(ssd_capacity_bytes=self.capacity, ssd_segment_size_bytes=self.segment,
                           ssd_durability_mode=self.mode, ssd_queue_depth=64, io_timeout_s=20.0)  # fmt: skip

    @property
    def fill(self) -> int:  # objects that fill segment 0
        return layout.record_slots(self.segment, self.obj)


def layouts(quick: bool) -> list[Layout]:
    if quick:
        return [Layout()]
    out = []
    for i, (mode, obj, victims, pads) in enumerate(
        [(m, o, v, p) for m in ("strict", "relaxed") for o in (4096, 8192) for v, p in ((8, 16), (12, 20), (4, 32))]
    ):
        out.append(Layout(mode=mode, obj=obj, victims=victims, pads=pads, seed=i))
    return out


def rebuild_by(route: str, path: str, capacity: int) -> None:
    """Make the next open rebuild the index from the segments' records, as ``route`` would."""
    ipath = os.path.join(path, INDEX_FILE)
    if route == "power_loss":  # the machine restarted under a writer: its index may be behind
        ix = Index(ipath, readonly=False, map_size=layout.map_size_bytes(capacity), durable=False)
        ix.set_writer_state(b"open:another-boot")
        ix.close()
    elif route == "index_lost":
        os.unlink(ipath)
    elif route == "index_damaged":
        st = os.stat(ipath)  # a killed writer's file spans its map, sparse: its written blocks
        with open(ipath, "r+b") as f:
            f.write(os.urandom(min(st.st_size, st.st_blocks * 512)))
    elif route == "verify":
        rebuild_index_dir(path)
    else:
        raise ValueError(f"unknown rebuild route {route!r}")


class Session:
    """One writer session whose operations are logged (child) or applied to the model (parent)."""

    def __init__(self, st: PageStore, obj: int, model: VersionModel, log: AckLog | None, next_version: int):
        self.st, self.obj, self.model, self.log, self.v = st, obj, model, log, next_version

    def _note(self, lines: list[str]) -> None:
        if self.log is not None:
            self.log.write(lines)

    async def put(self, keys: list[str]) -> None:
        """Each key absent in the store gets a new version; a present one is a dedup (acknowledged,
        old bytes kept)."""
        there = await self.st.exists_many(keys)
        vers = []
        for _ in keys:
            vers.append(self.v)
            self.v += 1
        self._note([f"?{k} {v}" for k, v, t in zip(keys, vers, there) if not t])
        for k, v, t in zip(keys, vers, there):
            if not t:
                self.model.begin_put(k, v)
        res = await self.st.put_many(keys, [versioned(k, v, self.obj) for k, v in zip(keys, vers)])
        lines = []
        for k, v, t, ok in zip(keys, vers, there, res):
            if ok:
                self.model.put_acked(k, v, wrote=not t)
                lines.append(f"{'~' if t else '+'}{k} {v}")
            else:
                self.model.put_refused(k, v)
                lines.append(f"x{k} {v}")
        self._note(lines + ["="])

    async def delete(self, keys: list[str]) -> None:
        self._note([f"D{k}" for k in keys])
        for k in keys:
            self.model.begin_delete(k)
        await self.st.delete_many(keys)
        for k in keys:
            self.model.delete_done(k)
        self._note([f"-{k}" for k in keys])

    async def reput(self, keys: list[str]) -> None:
        """New bytes under keys that may be stored: delete first (a put would be a dedup)."""
        await self.delete(keys)
        await self.put(keys)

    async def clear(self) -> None:
        self._note(["C"])
        self.model.begin_clear()
        await self.st.clear()
        self.model.clear_done()
        self._note(["c"])


def names(c: Layout) -> tuple[list[str], list[str], list[str]]:
    return ([f"fill-{i:03d}" for i in range(c.fill)], [f"victim-{i:02d}" for i in range(c.victims)],
            [f"pad-{i:02d}" for i in range(c.pads)])  # fmt: skip


def killed_child(c: Layout, path: str, log_path: str) -> None:
    """Session 1, in a child process that kills itself in its last put (see the module docstring)."""
    import logging

    from .faults import FaultPlan, FaultRule

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)
    fills, victims, pads = names(c)
    rng = random.Random(c.seed)

    async def main():
        plan = FaultPlan()
        st = await PageStore.open(path, c.config(), engine_factory=plan.engine_factory())
        s = Session(st, c.obj, VersionModel(), AckLog(log_path), 1)
        await s.put(fills)
        await s.reput(rng.sample(fills, 24))  # into their freed slots; the older versions' records are dead
        await s.put(victims)
        await s.delete(victims)  # segment 1 is empty again
        outs = [np.zeros(c.obj, np.uint8) for _ in range(2)]
        for _ in range(c.hits):  # hits tick the clock past the last commit
            await st.get_many(rng.sample(fills, 2), outs)
        if c.mode == "strict":  # after the data and the records are synced, before the commit
            rule = FaultRule("kill", ops=("sync",), when="after")
        else:  # after the record blocks are written (relaxed has no sync), before the commit
            area = c.segment - area_blocks(c.segment, c.obj) * 4096
            rule = FaultRule("kill", ops=("write",), when="after", predicate=lambda op, fd, off, n: off >= area)
        plan.set_rules([rule])
        await s.put(pads + victims)

    asyncio.run(main())


def kill_child(c: Layout, path: str, log_path: str) -> None:
    """Run ``killed_child`` in a fresh interpreter (it imports only the store: well under a second)."""
    run_killed("support.version_crash", "Layout", "killed_child", c, path, log_path)


def run_killed(module: str, spec: str, func: str, c, *args: str) -> None:
    """``module.func(module.spec(**asdict(c)), *args)`` in a fresh interpreter on the same umbp_nvme as
    this process; it must end by a SIGKILL. ``args`` are (store path, ack log path, ...): the log is
    sealed after the kill."""
    import umbp_nvme

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    product = os.path.dirname(os.path.dirname(os.path.abspath(umbp_nvme.__file__)))
    code = (f"import sys; sys.path[:0] = [{product!r}, {tests!r}]\n"
            f"from {module} import {spec}, {func}\n"
            f"{func}({spec}(**{dataclasses.asdict(c)!r}), *{args!r})")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if p.returncode != -signal.SIGKILL:
        raise RuntimeError(f"{c}: the child ended with {p.returncode}, not by its kill: {p.stderr[-2000:]}")
    seal_after_kill(args[1])


def killed_records(c: Layout, path: str) -> int:
    """Victims whose killed put left a sound record on disk: the hazard every case must survive
    (their earlier records were cleared by their acknowledged delete)."""
    keys = rebuild_records(path, c.segment, c.capacity // c.segment)[0]
    return len(set(names(c)[1]) & set(keys))


async def check_all(st: PageStore, c: Layout, model: VersionModel, tally: Tally, keys: list[str]) -> None:
    """Every key the workload ever touched, as this store serves it (nothing is evicted here, so
    every acknowledged key must exist)."""
    there = await st.exists_many(keys)
    have = [k for k, t in zip(keys, there) if t]
    outs = [np.zeros(c.obj, np.uint8) for _ in have]
    got = dict(zip(have, zip(await st.get_many(have, outs), outs)))
    for k in keys:
        g = got.get(k)
        if g is not None and not g[0]:  # exists said yes, the read failed: a miss, never a mix-up
            g = None
        tally.check(model, k, None if g is None else [version_in(k, g[1])], durable=True)


async def next_session(c: Layout, path: str, model: VersionModel, next_version: int, action: str, tally: Tally) -> None:
    """Session 2 (same boot, after the kill): check, then delete / re-put / clear."""
    fills, victims, pads = names(c)
    rng = random.Random(c.seed * 7919 + ACTIONS.index(action))
    st = await PageStore.open(path, c.config())
    try:
        await check_all(st, c, model, tally, fills + victims + pads)
        s = Session(st, c.obj, model, None, next_version)
        v = victims[:]
        rng.shuffle(v)
        if action == "mixed":  # each victim one way: re-put, put then delete, delete only, untouched
            q = [v[i::4] for i in range(4)]
            await s.delete(rng.sample(fills, 8))  # these slots of segment 0 take the re-puts below
            await s.reput(rng.sample(fills, 8) + pads[:8])
            await s.put(q[0] + q[1])
            await s.delete(q[1] + q[2])
        else:
            await s.put(v[: len(v) // 2])
            await s.clear()
            await s.put(v[len(v) // 4 :] + rng.sample(fills, 12))
    finally:
        await st.close()


async def run_case(c: Layout, killed: str, model: VersionModel, nv: int, action: str, route: str, work: str) -> Tally:
    """One (action, route) on a copy of the killed directory ``killed`` (the model is copied too):
    the next session, the rebuild, then every key checked."""
    path = os.path.join(work, f"{action}-{route}")
    shutil.copytree(killed, path)
    model = copy.deepcopy(model)
    tally = Tally()
    try:
        await next_session(c, path, model, nv, action, tally)
        rebuild_by(route, path, c.capacity)
        st = await PageStore.open(path, c.config())
        try:
            fills, victims, pads = names(c)
            await check_all(st, c, model, tally, fills + victims + pads)
        finally:
            await st.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return tally


def run_version_cases(root: str, *, quick: bool = True, log=None) -> dict:
    """Every layout x action x route; the figures of each and their sum."""
    import logging

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)  # rebuilds log ERROR lines by design
    total, cases, errors = Tally(), [], []
    for i, c in enumerate(layouts(quick)):
        d = os.path.join(root, f"layout-{i}")
        os.makedirs(d, exist_ok=True)
        killed, log_path = os.path.join(d, "killed"), os.path.join(d, "acks")
        kill_child(c, killed, log_path)
        st = read_log(log_path)
        hazard = killed_records(c, killed)
        if hazard != c.victims:
            errors.append(f"{c}: the kill left {hazard} of {c.victims} victims' records on disk")
        for action in ACTIONS:
            for route in ROUTES:
                t = asyncio.run(run_case(c, killed, st.model, st.next_version, action, route, d))
                total.merge(t)
                cases.append(dict(mode=c.mode, obj=c.obj, victims=c.victims, pads=c.pads, action=action, route=route,
                                  **t.figures(), examples=t.examples))  # fmt: skip
                if log:
                    log(f"  versions {c.mode} {c.obj} B {action} {route}: {t.figures()}")
        shutil.rmtree(d, ignore_errors=True)
    return dict(total.figures(), layouts=len(layouts(quick)), cases=cases, examples=total.examples, errors=errors)
