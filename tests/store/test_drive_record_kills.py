"""The drive-membership change killed at every step (issue 34): a writer over A,B (C absent) is
SIGKILLed before each of its DRIVES.json writes in turn (at open, before its first write, at close),
once the writes before it have landed: the session record is then on some drives and not on
others. The next reader and writer over A,B,C must serve every acknowledged version and nothing
else: no stale, resurrected or wrong page, and no acknowledged page of A or B lost (C missed the
session: losing its pages is allowed, serving one it replaced is not).

The writer runs in a child (tests/support/versions.py's ack log carries what it acknowledged
across the kill); the kill comes through the ``StoreHooks.drive_record`` seam.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT, small_config
from support.drive_pages import page_keys as _keys
from support.versions import AckLog, Tally, read_log, seal_after_kill, version_in, versioned
from umbp_nvme.store import PageStore

OBJ = 16 << 10
SHARE = 5 << 20
RECORD_WRITES = 6  # a complete child: 2 drives x (open, before the first write, close)

_CHILD = textwrap.dedent("""
    import asyncio, json, os, signal, sys, threading
    from conftest import small_config
    from support.versions import AckLog, versioned
    from umbp_nvme.store import PageStore
    from umbp_nvme.store.hooks import StoreHooks

    roots, kill_at, log_path, plan = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    state = {"calls": 0, "done": 0}
    cond = threading.Condition()

    def hook(real, path, rec):
        with cond:
            state["calls"] += 1
            me = state["calls"]
            if me == kill_at:  # the writes before this one have landed: kill between two drives' records
                cond.wait_for(lambda: state["done"] == me - 1, timeout=30)
                os.kill(os.getpid(), signal.SIGKILL)
        real(path, rec)
        with cond:
            state["done"] += 1
            cond.notify_all()

    async def main():
        cfg = small_config(ssd_capacity_bytes=%d * len(roots))
        st = await PageStore.open(roots, cfg, hooks=StoreHooks(drive_record=hook))
        log = AckLog(log_path)
        redo, moved, gone = plan["redo"], plan["moved"], plan["gone"]
        log.write([f"D{k}" for k in redo + gone])
        res = await st.delete_many(redo + gone)
        log.write([f"-{k}" for k, ok in zip(redo + gone, res) if ok])
        keys = redo + moved
        log.write([f"?{k} 2" for k in keys])
        res = await st.put_many(keys, [versioned(k, 2, %d) for k in keys])
        log.write([f"+{k} 2" if ok else f"x{k} 2" for k, ok in zip(keys, res)] + ["="])
        await st.close()
        print("completed", state["calls"])

    asyncio.run(main())
""" % (SHARE, OBJ))


def _cfg(roots):
    return small_config(ssd_capacity_bytes=SHARE * len(roots))


async def _read_all(roots, keys, readonly: bool) -> list[int | None]:
    st = await PageStore.open(roots, _cfg(roots), readonly=readonly, probe_interval_s=60)
    try:
        outs = [np.zeros(OBJ, np.uint8) for _ in keys]
        res = await st.get_many(keys, outs)
        return [version_in(k, o) if ok else None for ok, k, o in zip(res, keys, outs)]
    finally:
        await st.close()


@pytest.mark.parametrize("kill_at", list(range(1, RECORD_WRITES + 2)))  # the last: not killed
async def test_a_writer_killed_between_drive_records_loses_and_brings_back_nothing(tmp_path, kill_at):
    A, B, C = [str(tmp_path / f"drive{i}" / "store") for i in range(3)]
    keys = _keys(30)
    ack = str(tmp_path / "acks.log")
    st = await PageStore.open([A, B, C], _cfg([A, B, C]))
    log = AckLog(ack)
    log.write([f"?{k} 1" for k in keys])
    assert await st.put_many(keys, [versioned(k, 1, OBJ) for k in keys]) == [True] * len(keys)
    log.write([f"+{k} 1" for k in keys] + ["="])
    log.close()
    where = dict(zip(keys, st.drive_of(keys)))
    await st.close()
    on_ab = [k for k in keys if where[k] != 2]
    on_c = [k for k in keys if where[k] == 2]
    plan = {"redo": on_ab[:6], "gone": on_ab[6:10], "moved": on_c[:6]}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CHILD, f"{A},{B}", str(kill_at), ack, json.dumps(plan), cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    if kill_at <= RECORD_WRITES:
        assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        seal_after_kill(ack)
    else:
        assert proc.returncode == 0 and out.split()[:2] == [b"completed", str(RECORD_WRITES).encode()], err.decode()[-2000:]
    model = read_log(ack).model
    for readonly in (True, False):  # a reader first (it holds out what is not current), then a writer (it clears)
        tally = Tally()
        for k, v in zip(keys, await _read_all([A, B, C], keys, readonly)):
            # C was absent: its pages may be gone (it missed a session that wrote); A's and B's may not,
            # nor a page of C's re-put (acknowledged) on A or B
            durable = where[k] != 2 or model.state(k).version == 2
            tally.check(model, k, None if v is None else [v], durable=durable)
        assert tally.bad() == 0, (kill_at, readonly, tally.figures(), tally.examples)
