"""MultiDriveStore.close() cancels and awaits the probes its probe loop started (drive_probe.py):
no task outlives the store, and a drive store a probe was opening is closed (its lock freed)."""

from __future__ import annotations

import asyncio
import gc
import logging
import os

import numpy as np

from conftest import payload, small_config
from support.drive_pages import page_keys as _keys
from support.drive_stores import degrade_by_eio, filled_writer
from support.faults import FaultRule, on_files_under as _on
from support.waits import until
from umbp_nvme.store import drive_probe, owed_deletes
from umbp_nvme.store import PageStore

OBJ = 16 << 10


def _others() -> list[asyncio.Task]:
    me = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not me and not t.done()]


async def test_close_cancels_and_awaits_a_probe_under_way(tmp_path, monkeypatch):
    roots, plan, st, keys = await filled_writer(tmp_path, 20, probe_interval_s=0.02)
    on1 = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    entered, ended = asyncio.Event(), []

    async def slow_read_back(store, h):  # a probe whose read-back takes long (a slow drive)
        entered.set()
        try:
            await asyncio.sleep(30)
        finally:
            ended.append(True)
        return True

    monkeypatch.setattr(drive_probe, "reads_back", slow_read_back)
    plan.set_rules([FaultRule("eio", ops=("read",), predicate=_on(roots[1]))])
    await st.get_many(on1[:1], [np.zeros(OBJ, np.uint8)])
    await asyncio.wait_for(entered.wait(), 30)
    before = _others()
    assert before  # the probe loop and the probe
    await st.close()
    assert ended == [True] and _others() == []
    assert all(t.done() for t in before)


async def test_close_during_a_reopen_closes_the_store_the_probe_opened(tmp_path, monkeypatch, caplog):
    roots = [str(tmp_path / f"drive{i}" / "store") for i in range(2)]
    st = await PageStore.open(roots, small_config())
    keys = _keys(20)
    assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 40
    await st.close()
    parked = str(tmp_path / "parked")
    os.rename(os.path.dirname(roots[1]), parked)
    open(os.path.dirname(roots[1]), "w").close()  # (a file where its directory should be: it cannot open)
    st = await PageStore.open(roots, small_config(), probe_interval_s=0.02)
    assert st.stats()["drives"][1]["state"] == "degraded"
    entered = asyncio.Event()

    async def slow_apply(store, *a, **kw):  # dropping the stale copies of the drive that was out takes long
        entered.set()
        await asyncio.sleep(30)
        return set()

    monkeypatch.setattr(owed_deletes, "apply", slow_apply)
    os.unlink(os.path.dirname(roots[1]))
    os.rename(parked, os.path.dirname(roots[1]))  # back: the probe opens it
    await asyncio.wait_for(entered.wait(), 30)
    await st.close()
    assert _others() == []
    monkeypatch.undo()
    caplog.set_level(logging.ERROR)
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)  # drive 1's lock was freed
    assert [r["state"] for r in st.stats()["drives"]] == ["healthy", "healthy"]
    assert st.stats()["objects"] == 40
    await st.close()
    gc.collect()
    assert not [r for r in caplog.records if "Task was destroyed" in r.getMessage()]


async def test_a_probe_that_rejoins_a_drive_still_works_after_the_change(tmp_path):
    roots, plan, st, keys = await filled_writer(tmp_path, 20, probe_interval_s=0.02)
    on1 = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    await degrade_by_eio(plan, st, roots[1], on1, limit=1)
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 30)
    await st.close()
    assert _others() == []
