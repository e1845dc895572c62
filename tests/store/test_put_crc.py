"""A put's CRC32C never runs ahead of a get's completion handling: while reads are about it goes to
low-priority worker threads; with none about, small batches stay on the loop thread and large ones
on the default executor. Every stored CRC is still its object's."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from conftest import KiB, MiB, damage_object, payload, small_config
from support.waits import until
from umbp_nvme._uring import crc32c_many
from umbp_nvme.config import StoreConfig
from umbp_nvme.engine.arbiter import Arbiter
from umbp_nvme.store import PageStore, put_crc, put_path


CFG = StoreConfig()  # the worker settings a store runs with by default (ssd_crc_*)


def _low(fn, *args, policy: str = CFG.ssd_crc_policy):
    return put_crc.run_low(fn, *args, policy=policy, nice=CFG.ssd_crc_nice)


def _crcs(nbytes_each: list[int]):
    bufs = [payload(f"k{i}", n) for i, n in enumerate(nbytes_each)]
    src = np.array([b.ctypes.data for b in bufs], np.uint64)
    nbytes = np.array(nbytes_each, np.int64)
    return bufs, src, nbytes, np.zeros(len(bufs), np.uint32)


def _me():
    tid = threading.get_native_id()
    return tid, put_crc.thread_policy(tid)


def _alive(tid: int) -> bool:
    return os.path.exists(f"/proc/self/task/{tid}")


@pytest.mark.parametrize("policy,sched", [("nice", os.SCHED_OTHER), ("batch", os.SCHED_BATCH), ("idle", os.SCHED_IDLE)])
async def test_jobs_run_on_one_worker_at_the_policy_which_ends_when_idle(monkeypatch, policy, sched):
    # one long-lived thread per policy: starting a thread per job stalled the loop 2-4 ms per put
    monkeypatch.setattr(put_crc, "IDLE_EXIT_S", 0.05)
    got = [await _low(_me, policy=policy) for _ in range(3)]
    (tid,) = {tid for tid, _ in got}
    assert tid != threading.get_native_id()
    assert put_crc.Counts.applied == policy  # this kernel accepted it (a thread may always lower itself)
    for _, (got_sched, got_nice) in got:
        assert got_sched == sched
        if policy != "idle":
            assert got_nice == CFG.ssd_crc_nice
    assert put_crc.thread_policy(threading.get_native_id()) == (os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0))
    # idle for IDLE_EXIT_S (an earlier test's worker: up to its 2 s): it ends
    assert await until(lambda: not _alive(tid), 30, every_s=0.01)
    again, _ = await _low(_me, policy=policy)  # and the next job starts a new one
    assert again != tid and _alive(again)


async def test_overlapping_jobs_run_side_by_side_up_to_the_cap(monkeypatch):
    # several drives' puts in one process: one worker thread would checksum them one after another
    monkeypatch.setattr(put_crc, "CRC_WORKERS_MAX", 2)
    both = threading.Barrier(2, timeout=5.0)  # each job waits for the other: only side by side do they end

    def meet():
        both.wait()
        return threading.get_native_id()

    a, b = await asyncio.wait_for(asyncio.gather(_low(meet), _low(meet)), 10.0)
    assert a != b
    monkeypatch.setattr(put_crc, "CRC_WORKERS_MAX", 1)  # the cap holds: queued jobs wait, none is lost
    got = await asyncio.wait_for(asyncio.gather(*(_low(lambda i=i: i) for i in range(20))), 10.0)
    assert got == list(range(20))


def test_a_forked_child_starts_its_own_worker():
    # the parent's worker thread does not exist in a child: its jobs must not queue for it forever
    async def job(v):
        return await asyncio.wait_for(_low(lambda: v), 30)

    assert asyncio.run(job(5)) == 5  # the parent's worker is alive now
    pid = os.fork()
    if pid == 0:  # the child: one job, bounded wait; exit code says how it went
        code = 1
        try:
            got = asyncio.run(job(7))
            code = 0 if got == 7 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


async def test_the_job_computes_the_crcs_and_hands_back_errors():
    jobs = put_crc.Counts.jobs
    bufs, src, nbytes, out = _crcs([4096, 1 * MiB + 7, 300 * KiB])
    await _low(crc32c_many, src, nbytes, out)
    want = np.zeros_like(out)
    crc32c_many(src, nbytes, want)  # on this thread
    assert out.tolist() == want.tolist() and len(set(out.tolist())) == 3

    def boom():
        raise OSError(5, "bad")

    with pytest.raises(OSError, match="bad"):
        await _low(boom)
    assert (await _low(lambda: 42)) == 42
    assert put_crc.Counts.jobs == jobs + 3


async def test_unknown_policy_is_refused_and_its_jobs_still_run():
    with pytest.raises(ValueError, match="CRC policy must be one of"):
        put_crc.lower_priority("fast", CFG.ssd_crc_nice)
    with pytest.raises(ValueError, match="ssd_crc_policy must be one of"):
        StoreConfig(ssd_crc_policy="fast")  # a store never gets one
    # a worker that cannot apply it must not strand the put
    assert await asyncio.wait_for(_low(lambda: 3, policy="fast"), 30) == 3
    assert put_crc.Counts.applied == "normal"


async def test_dispatch_by_reads_and_batch_size():
    big = put_path.INLINE_CRC_BYTES + 1
    bufs, src, nbytes, out = _crcs([64 * KiB])
    arb, quiet = Arbiter(8 * MiB), Arbiter(8 * MiB, hold_reads=False)
    no_worker = StoreConfig(ssd_crc_worker=False)
    jobs = put_crc.Counts.jobs

    assert put_crc.dispatch(arb, crc32c_many, src, nbytes, out, big, CFG) is None  # no reads: inline
    assert put_crc.Counts.jobs == jobs
    large = put_crc.dispatch(arb, crc32c_many, src, nbytes, out, 1024, CFG)  # no reads, large: executor
    assert isinstance(large, asyncio.Future) and put_crc.Counts.jobs == jobs
    await large

    for a in (arb, quiet):
        a.read_started()
    try:  # a read in flight: the worker, whatever the size
        out[:] = 0
        await put_crc.dispatch(arb, crc32c_many, src, nbytes, out, big, CFG)
        assert put_crc.Counts.jobs == jobs + 1 and out[0] != 0
        # ssd_read_priority=off (reads never narrow anything) and no arbiter: the size split
        assert put_crc.dispatch(quiet, crc32c_many, src, nbytes, out, big, CFG) is None
        assert put_crc.dispatch(None, crc32c_many, src, nbytes, out, big, CFG) is None
        # ssd_crc_worker=False: the size split even with a read in flight
        assert put_crc.dispatch(arb, crc32c_many, src, nbytes, out, big, no_worker) is None
        assert isinstance(put_crc.dispatch(arb, crc32c_many, src, nbytes, out, 1024, no_worker), asyncio.Future)
    finally:
        for a in (arb, quiet):
            a.read_done()
    assert arb.reads_about()  # within the quiet window after the read ended: still the worker
    await put_crc.dispatch(arb, crc32c_many, src, nbytes, out, big, CFG)
    assert put_crc.Counts.jobs == jobs + 2


async def test_puts_beside_a_read_checksum_on_the_worker_and_verify(store_dir):
    cfg = small_config(ssd_capacity_bytes=96 * MiB, ssd_segment_size_bytes=8 * MiB, ssd_durability_mode="strict",
                       ssd_crc_policy="batch")  # not the default: the store's own config reaches the worker
    st = await PageStore.open(store_dir, cfg)
    try:
        assert st.state.arbiter is not None
        sizes = {"s": [200 * KiB + 7 * i for i in range(10)], "l": [1 * MiB] * 20}  # inline-sized and large
        data = {t: ([f"{t}{i}" for i in range(len(n))], [payload(f"{t}{i}", x) for i, x in enumerate(n)])
                for t, n in sizes.items()}  # fmt: skip
        jobs = put_crc.Counts.jobs
        st.state.arbiter.read_started()  # as a get in flight would
        try:
            for keys, vals in data.values():
                assert await st.put_many(keys, vals) == [True] * len(keys)
        finally:
            st.state.arbiter.read_done()
        assert put_crc.Counts.jobs == jobs + 2 and put_crc.Counts.applied == "batch"
        for keys, vals in data.values():  # every stored CRC is its object's: all verify
            outs = [np.zeros(len(v), np.uint8) for v in vals]
            assert await st.get_many(keys, outs) == [True] * len(keys)
            assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
        damage_object(store_dir, st, "s4", 100, b"\xde\xad")
        outs = [np.zeros(len(v), np.uint8) for v in data["s"][1]]
        assert await st.get_many(data["s"][0], outs) == [i != 4 for i in range(10)]
        assert st.stats()["crc_errors"] == 1
    finally:
        await st.close()
