"""Owed deletes are acknowledged only once a log on disk records them (store/drive_probe.py).

A degraded drive cannot delete: the delete is owed, and the owe must be durable (appended and
fsynced to OWED_DELETES.jsonl on a healthy drive) before the call says True, or a restart would
serve the key from that drive again. Here the append fails (OSError) or hangs past the store's
wait (a patched ``owed_deletes.append``); every check reads real bytes after a reopen (a close
keeps no in-memory owe, as a SIGKILL would not).
"""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest

from conftest import payload, small_config
from support.drive_pages import page_keys as _keys
from support.drive_stores import degrade_by_eio, filled_writer
from support.waits import until
from umbp_nvme.store import PageStore, owed_deletes

OBJ = 16 << 10


async def _read(st, keys, tag: str = "") -> tuple[list[bool], int]:
    """(hits, wrong): wrong counts hits whose bytes are not payload(key + tag)."""
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    return res, sum(1 for ok, k, o in zip(res, keys, outs) if ok and not np.array_equal(o, payload(k + tag, OBJ)))


class _Mode(list):
    release: threading.Event


@pytest.fixture
def log_fails(monkeypatch):
    """``mode[0]``: None (the log works), "error" (append raises EIO) or "hang" (append blocks
    until ``mode.release`` is set or the test ends, then raises: it never lands)."""
    mode = _Mode([None])
    release = mode.release = threading.Event()
    real = owed_deletes.append

    def append(root, entries):
        if mode[0] == "error":
            raise OSError(5, "injected EIO appending the owed-deletes log")
        if mode[0] == "hang":
            release.wait(30)
            raise OSError(5, "injected: a hung append that never landed")
        return real(root, entries)

    monkeypatch.setattr(owed_deletes, "append", append)
    yield mode
    release.set()


async def _degraded(tmp_path):
    """A writer over 2 drives whose drive 1 answers EIO to reads (degraded, never re-admitted
    here), with pages on both. Returns (roots, st, keys on drive 1)."""
    roots, plan, st, keys = await filled_writer(tmp_path, 40)
    on1 = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    await degrade_by_eio(plan, st, roots[1], on1)
    assert st.stats()["drives"][1]["state"] == "degraded"
    return roots, st, on1


async def test_a_delete_owed_durably_is_acknowledged_and_stays_deleted_after_a_restart(tmp_path, log_fails):
    roots, st, on1 = await _degraded(tmp_path)
    assert await st.delete_many(on1[:4] + ["never-stored_0_k"]) == [True] * 4 + [False]
    assert owed_deletes.load(roots[:1]).keys == {roots[1]: set(on1[:4])}
    await st.close()
    await _first_four_gone_after_a_restart(roots, on1)


async def _first_four_gone_after_a_restart(roots, on1) -> None:
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)
    res, wrong = await _read(st, on1)
    assert wrong == 0 and res == [False] * 4 + [True] * (len(on1) - 4)
    await st.close()


@pytest.mark.parametrize("mode", ["error", "hang"])
async def test_an_owed_delete_no_log_records_is_not_acknowledged_until_a_retry_records_it(tmp_path, log_fails, mode):
    roots, st, on1 = await _degraded(tmp_path)
    if mode == "hang":
        st.timeout_s = 0.3  # the multi-drive store's wait for an append (io_timeout_s), shortened
    log_fails[0] = mode
    assert await st.delete_many(on1[:4]) == [False] * 4
    assert st.exists_many_nowait(on1[:4]) == [False] * 4  # hidden here; owed in memory
    assert owed_deletes.load(roots[:1]).keys == {}
    log_fails[0] = None
    if mode == "hang":  # the hung append held drive 0's log thread: let it end (never landing)
        log_fails.release.set()
        await st.close()
        assert owed_deletes.load(roots[:1]).keys == {}
        return
    assert await st.delete_many(on1[:4]) == [True] * 4  # owed again, now recorded
    assert owed_deletes.load(roots[:1]).keys == {roots[1]: set(on1[:4])}
    await st.close()
    await _first_four_gone_after_a_restart(roots, on1)


async def test_no_acknowledged_delete_or_re_put_comes_back_wrong_after_a_restart(tmp_path, log_fails):
    """A re-put while the old copy sits on the degraded drive and no log records the owe: the old
    version must never be served for a key whose later delete (or re-put) said True."""
    roots, st, on1 = await _degraded(tmp_path)
    reput = on1[:4]
    log_fails[0] = "error"
    put_ok = await st.put_many(reput, [payload(k + "v2", OBJ) for k in reput])
    del_ok = await st.delete_many(reput[:2])
    log_fails[0] = None
    await st.close()
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)
    for k, p_ok, d_ok in zip(reput, put_ok, del_ok + [False, False]):
        (hit,), wrong_v1 = await _read(st, [k])
        (_,), wrong_v2 = await _read(st, [k], "v2")
        if d_ok:
            assert not hit, f"{k}: its delete was acknowledged, yet it is served after the restart"
        elif p_ok:
            assert hit and wrong_v2 == 0, f"{k}: its re-put was acknowledged, yet the old version is served"
        else:
            assert wrong_v1 == 0 or wrong_v2 == 0  # either version, never other bytes
    await st.close()


async def test_a_clear_no_log_records_for_a_degraded_drive_raises(tmp_path, log_fails):
    roots, st, on1 = await _degraded(tmp_path)
    log_fails[0] = "error"
    with pytest.raises(OSError, match="recorded on no drive"):
        await st.clear()
    assert st.stats()["drives"][0]["objects"] == 0  # the healthy drive cleared
    log_fails[0] = None
    await st.clear()  # recorded now: returns
    await st.close()
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)
    res, _ = await _read(st, on1)
    assert res == [False] * len(on1)
    await st.close()


async def test_a_drive_rejoins_only_once_a_log_records_its_owes_settled(tmp_path, log_fails):
    roots, plan, st, keys = await filled_writer(tmp_path, 40, probe_interval_s=0.05)
    on1 = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    await degrade_by_eio(plan, st, roots[1], on1)
    assert await st.delete_many(on1[:4]) == [True] * 4
    log_fails[0] = "error"
    plan.set_rules([])  # drive 1 reads back: the probe applies the owes but cannot record them settled
    # applied on the drive by a probe (waited for: a loaded machine runs fewer probes in a given time)
    assert await until(lambda: st.stats()["drives"][1]["objects"] == len(on1) - 4, 30)
    await asyncio.sleep(0.3)  # more probes: each applies them, none can record them settled
    assert st.stats()["drives"][1]["state"] == "degraded"
    log_fails[0] = None
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 10)
    assert not owed_deletes.load(roots).owes(roots[1])
    res, wrong = await _read(st, on1)
    assert wrong == 0 and res == [False] * 4 + [True] * (len(on1) - 4)
    await st.close()


_KILLED_CHILD = r"""
import asyncio, json, os, signal, sys
sys.path[:0] = [TESTS, os.path.join(TESTS, "store")]
import numpy as np
from conftest import payload, small_config
from support.faults import FaultPlan, FaultRule, on_files_under
from umbp_nvme.store import PageStore, owed_deletes

OBJ = 16 << 10

def failing_append(root, entries):
    raise OSError(5, "injected EIO appending the owed-deletes log")

async def main(roots):
    plan = FaultPlan()
    st = await PageStore.open(roots, small_config(ssd_durability_mode="strict"),
                                    engine_factory=plan.engine_factory(), probe_interval_s=60)
    keys = [f"p{i:04d}_0_{c}" for i in range(40) for c in "kv"]
    assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 80
    on1 = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    plan.set_rules([FaultRule("eio", ops=("read",), predicate=on_files_under(roots[1]))])
    await st.get_many(on1[:1], [np.zeros(OBJ, np.uint8)])
    assert st.stats()["drives"][1]["state"] == "degraded"
    owed_deletes.append = failing_append  # no log takes an owe from here on
    put_ok = await st.put_many(on1[:4], [payload(k + "v2", OBJ) for k in on1[:4]])
    del_ok = await st.delete_many(on1[:2] + on1[4:8])
    print(json.dumps([on1, put_ok, del_ok]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close: only what is on disk survives

asyncio.run(main(json.loads(sys.argv[1])))
"""


def test_after_a_sigkill_no_delete_acknowledged_without_a_log_comes_back(tmp_path):
    import json
    import os
    import subprocess
    import sys

    roots = [str(tmp_path / f"drive{i}" / "store") for i in range(2)]
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _KILLED_CHILD.replace("TESTS", repr(tests))
    p = subprocess.run([sys.executable, "-c", code, json.dumps(roots)], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr[-2000:]
    on1, put_ok, del_ok = json.loads(p.stdout)
    deleted = dict(zip(on1[:2] + on1[4:8], del_ok))

    async def check():
        st = await PageStore.open(roots, small_config(ssd_durability_mode="strict"), probe_interval_s=60)
        for i, k in enumerate(on1):
            (hit,), wrong_v1 = await _read(st, [k])
            (_,), wrong_v2 = await _read(st, [k], "v2")
            if deleted.get(k):
                assert not hit, f"{k}: its delete was acknowledged, yet it is served after the SIGKILL"
            elif i < 4 and put_ok[i]:
                assert hit and wrong_v2 == 0, f"{k}: its re-put was acknowledged, yet another version is served"
            else:
                assert hit and wrong_v1 == 0  # not acknowledged: the first version, whole
        await st.close()

    asyncio.run(check())
    assert put_ok == [False] * 4 and del_ok == [False] * 6  # no owe could be made durable: none acknowledged


async def test_a_thread_call_given_up_on_that_fails_later_logs_no_unretrieved_exception():
    """drive_probe.retrieved: an append or probe call abandoned at io_timeout_s that fails on its
    thread afterwards is not an asyncio "Future exception was never retrieved" ERROR."""
    from umbp_nvme.store.drive_probe import retrieved

    loop = asyncio.get_running_loop()
    seen = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda lp, ctx: seen.append(ctx.get("message")))
    try:
        for wrap in (False, True):
            fut = loop.create_future()
            if wrap:
                fut = retrieved(fut)
            fut.set_exception(OSError(5, "late failure"))
            await asyncio.sleep(0)  # done callbacks run
            del fut
            gc.collect()
            assert len(seen) == (0 if wrap else 1), seen  # the harness itself: unwrapped, it is reported
            seen.clear()
    finally:
        loop.set_exception_handler(old)


async def test_deletes_of_keys_that_are_not_str_answer_false_per_key_beside_owed_and_healthy_ones(tmp_path):
    roots, st, on1 = await _degraded(tmp_path)
    on0 = [k for k, d in zip(_keys(40), st.drive_of(_keys(40))) if d == 0]
    assert await st.delete_many([["x"], None, 3, "", on1[0], on0[0], "never_0_k"]) == [False] * 4 + [True, True, False]
    res, wrong = await _read(st, [on1[0], on0[0], on1[1], on0[1]])
    assert wrong == 0 and res == [False, False, False, True]  # on1[1]: its drive is degraded
    await st.close()


async def test_a_hung_append_does_not_hold_the_later_owed_deletes_of_its_drive(tmp_path, monkeypatch):
    """One append to drive 0's log hangs (a stalled fsync): the owed deletes after it are still
    recorded there and acknowledged (the hung one is given up at io_timeout_s, never acknowledged)."""
    roots, st, on1 = await _degraded(tmp_path)
    st.timeout_s = 0.3  # the multi-drive store's wait for an append (io_timeout_s), shortened
    release, calls = threading.Event(), []
    real = owed_deletes.append

    def append(root, entries):
        calls.append(root)
        if len(calls) == 1:
            release.wait(30)
            raise OSError(5, "injected: a hung append that never landed")
        return real(root, entries)

    monkeypatch.setattr(owed_deletes, "append", append)
    try:
        assert await st.delete_many(on1[:2]) == [False, False]  # its append hangs: not acknowledged
        st.timeout_s = 30.0  # the real appends below may take seconds on a loaded machine (one failed at 0.3 s)
        assert await st.delete_many(on1[2:4]) == [True, True]  # recorded beside the hung one
        assert await st.delete_many(on1[4:6]) == [True, True]
        assert owed_deletes.load(roots[:1]).keys == {roots[1]: set(on1[2:6])}
    finally:
        release.set()
    await st.close()
    st = await PageStore.open(roots, small_config(), probe_interval_s=60)
    res, wrong = await _read(st, on1[2:])
    assert wrong == 0 and res == [False] * 4 + [True] * (len(on1) - 6)
    await st.close()


async def test_appends_that_keep_hanging_take_a_bounded_number_of_threads(tmp_path, monkeypatch):
    roots, st, on1 = await _degraded(tmp_path)
    st.timeout_s = 0.2
    release = threading.Event()

    def append(root, entries):
        release.wait(30)
        raise OSError(5, "injected: a hung append that never landed")

    monkeypatch.setattr(owed_deletes, "append", append)
    before = {t.ident for t in threading.enumerate()}
    try:
        for i in range(12):
            assert await st.delete_many(on1[i : i + 1]) == [False]
        grown = [t for t in threading.enumerate() if t.ident not in before]
        assert len(grown) <= 4, [t.name for t in grown]
    finally:
        release.set()
    monkeypatch.setattr(owed_deletes, "append", _real_append)
    assert await until(lambda: not any(st.owed_log_appends_running), 10)  # the hung appends returned (failing)
    assert await st.delete_many(on1[:2]) == [True, True]  # their threads serve again: recorded
    await st.close()


_real_append = owed_deletes.append
