"""KV events of a multi-drive store whose drive stops and starts serving (store/drive_residency.py).

A router must count only pages a lookup finds: a drive that degrades takes its pages out
(BlockRemoved, once each), what is done to it meanwhile announces nothing, and when it serves
again its surviving pages come back (BlockStored). The oracle replays every announcement into a
set and compares it with the pages ``exists`` finds, after every step.
"""

from __future__ import annotations

import hashlib
import os
from types import SimpleNamespace as NS

from conftest import payload, small_config
from support.drive_stores import OBJ, degrade_by_eio, drive_roots
from support.faults import FaultPlan
from support.waits import until
from umbp_nvme.sglang.kv_residency import Residency, attach
from umbp_nvme.store import PageStore

SFX = ("_0_k", "_0_v")


class Announced:
    """What a subscriber would know: the pages announced stored and not removed since."""

    def __init__(self):
        self.items = []
        self.pages: set[str] = set()
        self.twice = 0  # a page announced stored while already held, or removed while not held
        self.rz = None

    def offer(self, kind, pages):
        for k, p in self.rz.resolve([(kind, pages)]):  # at once, as the publisher's thread would
            self.record(k, list(p))
        return True

    def record(self, kind, pages):
        self.items.append((kind, pages))
        for p in pages:
            if kind == "stored":
                page = p[0]
                self.twice += page in self.pages
                self.pages.add(page)
            else:
                self.twice += p not in self.pages
                self.pages.discard(p)
        return True

    def since(self, n):
        return self.items[n:]


def pages(n, tag):
    return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]


def objects(ps):
    return [p + s for p in ps for s in SFX]


async def put(st, ps):
    ks = objects(ps)
    return await st.put_many(ks, [payload(k, OBJ) for k in ks])


def held(st, ps):
    found = st.exists_many_nowait(objects(ps))
    return {p for i, p in enumerate(ps) if found[2 * i] and found[2 * i + 1]}


async def writer(tmp_path, **kw):
    plan = FaultPlan()
    roots = drive_roots(tmp_path, 2)
    st = await PageStore.open(roots, small_config(), engine_factory=plan.engine_factory(), **kw)
    ann = Announced()
    rz = ann.rz = Residency(ann, SFX)
    attach(NS(store=st), rz)
    return roots, plan, st, ann, rz


async def test_a_degraded_drive_removes_its_pages_and_announces_them_again_once_it_serves(tmp_path):
    roots, plan, st, ann, rz = await writer(tmp_path, probe_interval_s=0.05)
    ps = pages(40, "a")
    assert await put(st, ps) == [True] * 80
    where = dict(zip(ps, st.drive_of(objects(ps))[::2]))
    on1 = [p for p in ps if where[p] == 1]
    assert on1 and len(on1) < len(ps)
    assert ann.pages == set(ps) == held(st, ps)

    n = len(ann.items)
    await degrade_by_eio(plan, st, roots[1], objects(on1))
    assert st.stats()["drives"][1]["state"] == "degraded"
    assert ann.since(n) == [("removed", on1)]  # at once, each page once
    assert ann.pages == held(st, ps) == set(ps) - set(on1)

    # while it is out: a delete it owes and a re-put elsewhere announce what lookups see, nothing more
    n = len(ann.items)
    assert await st.delete_many(objects(on1[:1])) == [True, True]
    assert await put(st, on1[1:2]) == [True, True]  # written to drive 0 now
    assert ann.since(n) == [("stored", [(on1[1], None, None)])]
    fresh = pages(10, "f")
    assert await put(st, fresh) == [True] * 20
    assert ann.pages == held(st, ps + fresh)

    n = len(ann.items)
    plan.clear()
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 60)
    back = {p for kind, items in ann.since(n) if kind == "stored" for p, _, _ in items}
    assert not [k for k, _ in ann.since(n) if k == "removed"]
    assert set(on1[2:]) <= back and on1[0] not in back  # the owed delete was applied first, silently
    assert ann.pages == held(st, ps + fresh) == set(ps + fresh) - {on1[0]}
    assert ann.twice == 0  # on1[1]'s old copy on drive 1 went with the delete it owed
    await st.close()


async def test_a_full_drive_keeps_its_pages_announced(tmp_path):
    _, _, st, ann, _ = await writer(tmp_path, probe_interval_s=60)
    ps = pages(20, "full")
    assert await put(st, ps) == [True] * 40
    n = len(ann.items)
    st.health[1].degrade("full", "test: its file system is full")
    assert ann.since(n) == [] and ann.pages == held(st, ps) == set(ps)  # full drives still serve reads
    on1 = [p for p, d in zip(ps, st.drive_of(objects(ps))[::2]) if d == 1]
    st.health[1].degrade("io_error", "test: worse than full")
    assert ann.since(n) == [("removed", on1)]
    assert ann.pages == held(st, ps)
    await st.close()


async def test_a_drive_that_could_not_open_announces_its_pages_once_it_joins(tmp_path):
    roots = drive_roots(tmp_path, 2)
    first = await PageStore.open(roots, small_config())
    ps = pages(30, "late")
    assert await put(first, ps) == [True] * 60
    on1 = {p for p, d in zip(ps, first.drive_of(objects(ps))[::2]) if d == 1}
    await first.close()
    parked = str(tmp_path / "parked")
    os.rename(os.path.dirname(roots[1]), parked)
    with open(os.path.dirname(roots[1]), "wb"):  # drive 1 cannot open (a writer would create a missing one)
        pass
    st = await PageStore.open(roots, small_config(), probe_interval_s=0.05)
    ann = Announced()
    rz = ann.rz = Residency(ann, SFX)
    attach(NS(store=st), rz)
    assert {p for p, _, _ in rz.snapshot()} == held(st, ps) == set(ps) - on1  # the re-announcement
    assert st.stats()["drives"][1]["state"] == "degraded"
    os.unlink(os.path.dirname(roots[1]))
    os.rename(parked, os.path.dirname(roots[1]))
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 60)
    assert {p for kind, items in ann.items if kind == "stored" for p, _, _ in items} == on1
    assert held(st, ps) == set(ps)
    # hooked from now on: its own changes announce
    victim = sorted(on1)[0]
    assert await st.delete_many(objects([victim])) == [True, True]
    assert ann.items[-1] == ("removed", [victim])
    await st.close()


async def test_the_re_announcement_leaves_out_a_degraded_drives_pages(tmp_path):
    roots, plan, st, ann, rz = await writer(tmp_path, probe_interval_s=60)
    ps = pages(30, "snap")
    assert await put(st, ps) == [True] * 60
    on1 = [p for p, d in zip(ps, st.drive_of(objects(ps))[::2]) if d == 1]
    await degrade_by_eio(plan, st, roots[1], objects(on1))
    assert st.keys() != st.served_keys()  # its store is open, its keys not served
    assert {p for p, _, _ in rz.snapshot()} == held(st, ps) == set(ps) - set(on1)
    await st.close()
