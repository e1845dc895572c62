"""Reads first, part 2: write batches reach the device in bounded slices; reads go ahead (issue 13).

The FakeDevice tests run on a virtual-time loop (tests/support/virtual_time.py) with the Arbiter on
that loop's clock: "sleep 12 ms, then look" sees what 12 ms of device time produce, never what a
loaded machine's scheduler let through (a wall-clock version failed once under load).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from conftest import open_direct
from support.virtual_time import run_virtual
from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.config import StoreConfig, load_config
from umbp_nvme.engine.arbiter import READ_SLICE_FLOOR, WINDOW_SLICES, Arbiter, slice_bounds, write_sliced
from umbp_nvme.engine.priority import OFF
from umbp_nvme.engine.uring import UringEngine

MiB = 1 << 20


def test_slice_bounds_cover_every_op_once_in_order():
    lens = np.array([1, 2, 3, 4, 10, 1, 1, 1], np.int64) * MiB
    b = slice_bounds(lens, 4 * MiB)
    assert b[0][0] == 0 and b[-1][1] == len(lens)
    assert all(e0 == s1 for (_, e0), (s1, _) in zip(b, b[1:]))
    for s, e in b:
        assert e > s
        assert lens[s:e].sum() <= 4 * MiB or e - s == 1  # only a single op may exceed a slice
    assert b == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 8)]


class FakeDevice:
    """run(...) for write_sliced: each call is one slice at the device, taking `per_mib_s` per MiB of
    the running loop's time (virtual in these tests); slices run side by side."""

    def __init__(self, per_mib_s=0.002):
        self.per_mib_s = per_mib_s
        self.inflight = 0
        self.max_inflight = 0
        self.log = []  # (event, t, bytes)
        self.sizes = []  # bytes of each slice, in submit order

    async def run(self, fds, offs, addrs, lens):
        n = int(np.sum(lens))
        self.sizes.append(n)
        self.inflight += n
        self.max_inflight = max(self.max_inflight, self.inflight)
        loop = asyncio.get_running_loop()
        self.log.append(("start", loop.time(), self.inflight))
        t_end = loop.time() + self.per_mib_s * n / MiB
        try:
            await asyncio.sleep(t_end - loop.time())
        except asyncio.CancelledError:  # like the kernel: a started op runs to its end first
            await asyncio.sleep(max(0.0, t_end - loop.time()))
            self.inflight -= n
            raise
        self.inflight -= n
        self.log.append(("end", loop.time(), n))
        return np.asarray(lens, np.int64) - 1  # distinguishable per-op results


@pytest.mark.parametrize("window", [None, 1, 2])  # None: the default (WINDOW_SLICES)
def test_write_window_bounds_bytes_in_flight_and_keeps_results_in_op_order(window):
    async def main(loop):
        dev, arb = FakeDevice(), Arbiter(4 * MiB, window_slices=window, clock=loop.time)
        assert arb.window_slices == (WINDOW_SLICES if window is None else window)
        n = 40
        lens = np.full(n, MiB, np.int64) + np.arange(n)  # 40 ops of ~1 MiB: ~10 slices
        res = await write_sliced(dev.run, arb, 3, np.arange(n) * 2 * MiB, np.arange(n, dtype=np.uint64) + 1, lens)
        assert res.tolist() == (lens - 1).tolist()
        assert dev.max_inflight <= arb.window_slices * 4 * MiB
        assert arb.stats["write_slices"] == len(slice_bounds(lens, 4 * MiB)) >= 9
        # two concurrent batches share the one window
        dev2 = FakeDevice()
        a, b = (write_sliced(dev2.run, arb, 3, np.zeros(20), np.ones(20, np.uint64), np.full(20, MiB))
                for _ in range(2))  # fmt: skip
        ra, rb = await asyncio.gather(a, b)
        assert ra.tolist() == rb.tolist() == [MiB - 1] * 20 and dev2.max_inflight <= arb.window_slices * 4 * MiB

    run_virtual(main)


def test_without_slicing_the_whole_batch_goes_at_once():
    async def main(loop):
        dev = FakeDevice()
        res = await write_sliced(dev.run, None, 3, np.zeros(16), np.ones(16, np.uint64), np.full(16, MiB))
        assert res.tolist() == [MiB - 1] * 16 and dev.max_inflight == 16 * MiB
        dev = FakeDevice()
        await write_sliced(dev.run, Arbiter(0), 3, np.zeros(16), np.ones(16, np.uint64), np.full(16, MiB))
        assert dev.max_inflight == 16 * MiB

    run_virtual(main)


def test_a_read_behind_a_queued_write_batch_finishes_before_its_last_slice():
    async def main(loop):
        # one cut slice beside reads (read_window_slices=1), so the narrowing is visible against the full window
        dev = FakeDevice(per_mib_s=0.004)
        arb = Arbiter(2 * MiB, quiet_s=1.0, window_slices=2, read_window_slices=1, clock=loop.time)
        n = 32  # 32 MiB in 16 slices of 2 MiB, 8 ms each
        write = asyncio.ensure_future(
            write_sliced(dev.run, arb, 3, np.zeros(n), np.ones(n, np.uint64), np.full(n, MiB)))
        await asyncio.sleep(0.012)  # the batch is at the device and most of it queued in the window
        assert dev.inflight == 2 * 2 * MiB  # no reads yet: the full window
        arb.read_started()
        t_read0 = loop.time()
        await asyncio.sleep(0.040)  # the read's own time at the device
        arb.read_done()
        t_read1 = loop.time()
        await write
        ends = [t for ev, t, _ in dev.log if ev == "end"]
        assert t_read1 < max(ends)  # the read did not wait for the batch
        after = [inflight for ev, t, inflight in dev.log if ev == "start" and t > t_read0 + 0.010]
        # once the slices queued before the read ended, one slice at a time: during and quiet_s after it
        assert after and max(after) <= 2 * MiB
        assert arb.stats["write_slices_held"] > 0

    run_virtual(main)


@pytest.mark.parametrize("hold_reads", [True, False])
def test_the_window_widens_again_once_reads_are_quiet(hold_reads):
    async def main(loop):
        dev = FakeDevice(per_mib_s=0.004)
        arb = Arbiter(MiB, quiet_s=0.03, window_slices=2, hold_reads=hold_reads, read_window_slices=1,
                      clock=loop.time)  # fmt: skip
        arb.read_started()
        arb.read_done()  # a read just ended: one slice at a time for 30 ms (unless reads never narrow it)
        n = 40  # 40 slices of 4 ms (the fake device runs the two of a full window side by side)
        t0 = loop.time()
        await write_sliced(dev.run, arb, 3, np.zeros(n), np.ones(n, np.uint64), np.full(n, MiB))
        starts = [(t - t0, inflight) for ev, t, inflight in dev.log if ev == "start"]
        early = [i for t, i in starts if t < 0.02]
        late = [i for t, i in starts if t > 0.045]
        assert max(early) == (MiB if hold_reads else 2 * MiB)
        assert max(late) == 2 * MiB  # quiet: the next slice is queued behind the running one again

    run_virtual(main)


def test_a_never_ending_read_stream_still_lets_the_backup_move():
    async def main(loop):
        dev, arb = FakeDevice(per_mib_s=0.001), Arbiter(MiB, window_slices=2, clock=loop.time)
        arb.read_started()  # a read stream that never ends
        try:
            res = await asyncio.wait_for(
                write_sliced(dev.run, arb, 3, np.zeros(8), np.ones(8, np.uint64), np.full(8, MiB)), 30.0
            )  # a starved backup never returns: 30 s of virtual time pass at once and this raises
            assert res.tolist() == [MiB - 1] * 8
            assert arb.read_window_slices == 2  # the default: two cut slices, every slice moved
            assert dev.max_inflight == 2 * MiB
        finally:
            arb.read_done()

    run_virtual(main)


@pytest.mark.parametrize("op_mib", [1, 4])
def test_beside_reads_the_read_window_keeps_that_many_cut_slices_in_flight(op_mib):
    """read_window_slices=2: the next cut slice is queued behind the running one (the device never
    waits for the loop between slices), never a third; an op larger than the cut is one slice."""

    async def main(loop):
        dev, arb = FakeDevice(per_mib_s=0.002), Arbiter(8 * MiB, read_window_slices=2, clock=loop.time)
        assert arb.read_slice_bytes == 2 * MiB
        arb.read_started()
        try:
            n = 32 // op_mib
            res = await write_sliced(dev.run, arb, 3, np.zeros(n), np.ones(n, np.uint64), np.full(n, op_mib * MiB))
        finally:
            arb.read_done()
        assert res.tolist() == [op_mib * MiB - 1] * n
        starts = [inflight for ev, _, inflight in dev.log if ev == "start"]
        assert max(starts) == 2 * max(2, op_mib) * MiB  # two slices side by side, not three
        assert set(dev.sizes) == {max(2, op_mib) * MiB}  # every slice cut to the read slice (or one op)
        assert arb.granted == (0, 0)  # every grant handed back

    run_virtual(main)
    with pytest.raises(ValueError, match="read_window_slices"):
        Arbiter(8 * MiB, read_window_slices=0)


def test_the_slice_beside_reads_is_a_fraction_of_the_full_one_with_a_floor():
    assert Arbiter(8 * MiB).read_slice_bytes == 2 * MiB  # the default: a quarter (the sweep in docs/benchmarks.md)
    assert Arbiter(8 * MiB, read_slice_fraction=0.5).read_slice_bytes == 4 * MiB
    assert Arbiter(8 * MiB, read_slice_fraction=0.75).read_slice_bytes == 6 * MiB
    assert Arbiter(8 * MiB, read_slice_fraction=1).read_slice_bytes == 8 * MiB  # never cut
    assert Arbiter(8 * MiB, read_slice_fraction=0.1).read_slice_bytes == READ_SLICE_FLOOR == 2 * MiB
    assert Arbiter(3 * MiB).read_slice_bytes == 2 * MiB  # floor, not 1.5 MiB
    assert Arbiter(MiB).read_slice_bytes == MiB  # slices below the floor are not cut further
    assert Arbiter(0).read_slice_bytes == 0 and not Arbiter(0).enabled
    for bad in (0, -0.5, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="read_slice_fraction"):
            Arbiter(8 * MiB, read_slice_fraction=bad)



def test_module_constants_are_read_when_an_arbiter_is_made(monkeypatch):
    """bench mixed's sweep flags set these before a store opens; an arbiter made later follows them."""
    from umbp_nvme.engine import arbiter as mod

    before = Arbiter(8 * MiB)
    monkeypatch.setattr(mod, "READ_SLICE_FRACTION", 0.125)
    monkeypatch.setattr(mod, "READ_SLICE_FLOOR", MiB)
    monkeypatch.setattr(mod, "READ_QUIET_S", 0.02)
    after = Arbiter(8 * MiB)
    assert (before.read_slice_bytes, before.quiet_s) == (2 * MiB, 0.1)
    assert (after.read_slice_bytes, after.quiet_s) == (MiB, 0.02)
    assert Arbiter(8 * MiB, quiet_s=0.5, read_slice_fraction=0.5).quiet_s == 0.5  # explicit values win


def test_bench_mixed_sweep_flags_set_the_arbiter_and_bad_ones_are_refused(monkeypatch, capsys):
    from umbp_nvme.bench import mixed
    from umbp_nvme.engine import arbiter as mod

    for name in ("READ_SLICE_FRACTION", "READ_SLICE_FLOOR", "READ_QUIET_S", "READ_WINDOW_SLICES"):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    from umbp_nvme.config import StoreConfig

    cfg = mixed.parse_args(["--read-fraction", "0.25", "--read-floor", "1M", "--quiet-ms", "30", "--read-window", "3"])
    want = {"read_fraction": 0.25, "read_floor": MiB, "read_window": 3, "quiet_ms": 30.0,
            "crc": StoreConfig().ssd_crc_policy}  # fmt: skip
    assert mixed.arbiter_settings(cfg) == want
    assert Arbiter(8 * MiB).read_slice_bytes == 2 * MiB and Arbiter(8 * MiB).quiet_s == 0.03
    assert Arbiter(8 * MiB).read_window_slices == 3
    assert mixed.arbiter_settings(mixed.parse_args([]))["read_fraction"] == 0.25  # no flags: left as they are

    # the CRC flags reach every store through its config, nothing process-wide
    def made(argv):
        c = mixed.parse_args(argv)
        return mixed.arbiter_settings(c)["crc"], mixed.store_config("/s", "on", 8 * MiB, 512 * MiB, c.crc_keys)

    default = StoreConfig().ssd_crc_policy
    crc, sc = made([])
    assert (crc, sc.ssd_crc_policy, sc.ssd_crc_worker) == (default, default, True) and sc == StoreConfig(
        ssd_storage_dir="/s", ssd_capacity_bytes=512 * MiB, ssd_durability_mode="strict", ssd_io_backend="io_uring")
    crc, sc = made(["--crc-policy", "idle"])
    assert (crc, sc.ssd_crc_policy, sc.ssd_crc_worker) == ("idle", "idle", True)
    crc, sc = made(["--crc-off"])
    assert (crc, sc.ssd_crc_worker) == ("no-worker", False)
    for bad in (["--read-fraction", "0"], ["--read-fraction", "1.5"], ["--read-floor", "0"], ["--quiet-ms", "-1"],
                ["--crc-policy", "fast"], ["--read-window", "0"]):
        with pytest.raises(SystemExit):
            mixed.parse_args(bad)
        assert bad[0] in capsys.readouterr().err


def test_bench_mixed_module_runs_as_a_script():
    """``python -m umbp_nvme.bench.mixed`` used to import and exit silently."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "umbp_nvme.bench.mixed", "--help"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "umbp-nvme bench mixed" in proc.stdout and "--read-fraction" in proc.stdout


def test_slices_are_cut_while_reads_are_about_and_full_when_idle():
    async def main(loop):
        # quiet_s=0: full again once the read ends
        dev, arb = FakeDevice(per_mib_s=0.002), Arbiter(8 * MiB, quiet_s=0.0, clock=loop.time)
        n = 160  # 160 MiB of 1 MiB ops, submitted while idle: 8 MiB slices, two in flight
        write = asyncio.ensure_future(
            write_sliced(dev.run, arb, 3, np.zeros(n), np.ones(n, np.uint64), np.full(n, MiB)))
        await asyncio.sleep(0.020)
        idle = list(dev.sizes)
        assert idle and set(idle) == {8 * MiB} and dev.max_inflight == 16 * MiB
        arb.read_started()  # slices queued before the read are cut when their turn comes
        mark = len(dev.sizes)
        await asyncio.sleep(0.060)
        arb.read_done()
        during = dev.sizes[mark + 1:]  # one slice may have been granted in the same step as the read began
        assert during and set(during) == {2 * MiB}  # a quarter of 8 MiB
        mark = len(dev.sizes)
        res = await write
        assert res.tolist() == [MiB - 1] * n
        after = dev.sizes[mark + 1:-1]  # past one granted beside the read; the last may be a short tail
        assert after and set(after) == {8 * MiB}  # quiet again: full slices
        assert sum(dev.sizes) == n * MiB and arb.stats["write_slices_cut"] >= len(during)
        assert arb.granted[0] == 0 and not arb.waiting

    run_virtual(main)


def test_beside_reads_one_cut_slice_at_a_time_and_small_batches_go_whole():
    async def main(loop):
        dev = FakeDevice(per_mib_s=0.001)
        arb = Arbiter(8 * MiB, read_slice_fraction=0.5, read_window_slices=1, clock=loop.time)  # 4 MiB
        arb.read_started()
        try:
            res = await write_sliced(dev.run, arb, 3, np.zeros(20), np.ones(20, np.uint64), np.full(20, MiB))
            assert res.tolist() == [MiB - 1] * 20
            assert dev.sizes == [4 * MiB] * 5 and dev.max_inflight == 4 * MiB
            dev.sizes.clear()
            await write_sliced(dev.run, arb, 3, np.zeros(3), np.ones(3, np.uint64), np.full(3, MiB))
            await write_sliced(dev.run, arb, 3, np.zeros(6), np.ones(6, np.uint64), np.full(6, MiB))
            assert dev.sizes == [3 * MiB, 4 * MiB, 2 * MiB]
        finally:
            arb.read_done()
        arb.quiet_s = 0.0
        dev.sizes.clear()
        await write_sliced(dev.run, arb, 3, np.zeros(6), np.ones(6, np.uint64), np.full(6, MiB))
        assert dev.sizes == [6 * MiB]  # no reads about: one full-size slice

    run_virtual(main)


def test_a_failed_slice_stops_the_batch_and_frees_the_window():
    async def main(loop):
        dev, arb = FakeDevice(per_mib_s=0.001), Arbiter(2 * MiB, window_slices=1, clock=loop.time)
        calls = []

        async def run(fds, offs, addrs, lens):
            calls.append(len(lens))
            if len(calls) == 2:
                raise OSError(5, "EIO")
            return await dev.run(fds, offs, addrs, lens)

        with pytest.raises(OSError):
            await write_sliced(run, arb, 3, np.zeros(16), np.ones(16, np.uint64), np.full(16, MiB))
        assert len(calls) < 8  # not every slice of the batch was submitted after the failure
        assert arb.granted[0] == 0 and not arb.waiting

    run_virtual(main)


def test_cancelled_sliced_write_waits_for_its_running_slices():
    async def main(loop):
        dev, arb = FakeDevice(per_mib_s=0.01), Arbiter(MiB, clock=loop.time)
        task = asyncio.ensure_future(
            write_sliced(dev.run, arb, 3, np.zeros(8), np.ones(8, np.uint64), np.full(8, MiB)))
        await asyncio.sleep(0.015)  # the second pair of slices at the device, the fifth waiting for a turn
        assert dev.inflight == 2 * MiB and arb.waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert loop.time() == pytest.approx(0.020)  # returned when the running slice ended, not before
        assert dev.inflight == 0  # nothing left at the "device" once the await returned
        assert arb.granted[0] == 0 and not arb.waiting  # the window is whole again

    run_virtual(main)


async def test_uring_engine_keeps_at_most_the_window_of_write_ops_in_the_ring(tmp_path):
    fd = open_direct(tmp_path / "f")
    n, op = 64, 256 << 10
    buf = AlignedBuffer(n * op)
    buf.array[:] = np.arange(n * op, dtype=np.uint64).astype(np.uint8)
    e = await UringEngine.open(256)
    arb = Arbiter(512 << 10)  # 2 ops per slice, so at most 2 x window_slices write ops in flight
    e.set_io_policy(OFF, arb)
    seen = []
    stop = False

    def sample():
        seen.append(e.inflight)
        if not stop:
            asyncio.get_running_loop().call_soon(sample)

    try:
        asyncio.get_running_loop().call_soon(sample)
        offs = np.arange(n, dtype=np.int64) * op
        res = await e.write_many(fd, offs, buf.address + offs.astype(np.uint64), np.full(n, op, np.int64))
        stop = True
        assert res.tolist() == [op] * n
        assert 0 < max(seen) <= 2 * arb.window_slices
        assert arb.stats["write_slices"] == n // 2
        out = AlignedBuffer(n * op)
        got = await e.read_many(fd, offs, out.address + offs.astype(np.uint64), np.full(n, op, np.int64))
        assert got.tolist() == [op] * n and np.array_equal(out.array, buf.array)
        out.close()
    finally:
        e.close()
        buf.close()
        os.close(fd)


def test_knobs_are_validated_and_parsed():
    assert StoreConfig().ssd_read_priority == "on" and StoreConfig().ssd_write_slice_bytes == 8 * MiB
    assert StoreConfig(ssd_write_slice_bytes=0).ssd_write_slice_bytes == 0
    for bad in (1, 100 << 10, (1 << 30) + 1, True, 2.5, "8M"):
        with pytest.raises(ValueError, match="ssd_write_slice_bytes"):
            StoreConfig(ssd_write_slice_bytes=bad)
    for bad in ("yes", True, "", None):
        with pytest.raises(ValueError, match="ssd_read_priority"):
            StoreConfig(ssd_read_priority=bad)
    c = load_config({"ssd_read_priority": "off", "ssd_write_slice_bytes": "16777216"}, env={})
    assert (c.ssd_read_priority, c.ssd_write_slice_bytes) == ("off", 16 * MiB)
    c = load_config({}, env={"UMBP_SSD_READ_PRIORITY": "false", "UMBP_SSD_WRITE_SLICE_BYTES": "0"})
    assert (c.ssd_read_priority, c.ssd_write_slice_bytes) == ("off", 0)
    with pytest.raises(ValueError, match="ssd_write_slice_bytes"):
        load_config({"ssd_write_slice_bytes": 4096}, env={})
    with pytest.raises(ValueError, match="ssd_read_priority"):
        load_config({"ssd_read_priority": "maybe"}, env={})


def test_a_batch_the_empty_window_takes_whole_goes_as_one_run_charged_as_its_slices():
    async def main(loop):
        dev = FakeDevice(per_mib_s=0.001)
        arb = Arbiter(4 * MiB, window_slices=2, clock=loop.time)  # an 8 MiB window
        lens = np.full(8, MiB)
        seen = []

        async def run(*a):
            seen.append(arb.granted)  # charged while at the device: every slice it stands for
            return await dev.run(*a)

        res = await write_sliced(run, arb, 3, np.zeros(8), np.ones(8, np.uint64), lens)
        assert res.tolist() == [MiB - 1] * 8 and dev.sizes == [8 * MiB] and seen == [(8 * MiB, 2)]
        assert arb.stats["write_whole"] == 1 and arb.stats["write_slices"] == 2 and arb.granted == (0, 0)
        dev.sizes.clear()
        await write_sliced(dev.run, arb, 3, np.zeros(9), np.ones(9, np.uint64), np.full(9, MiB))  # over the window
        assert dev.sizes == [4 * MiB, 4 * MiB, MiB] and arb.stats["write_whole"] == 1
        # 3 x 3 MiB: slicing would hold the third slice (6 + 4 > 8 MiB), so it is sliced
        dev.sizes.clear()
        await write_sliced(dev.run, arb, 3, np.zeros(3), np.ones(3, np.uint64), np.full(3, 3 * MiB))
        assert dev.sizes == [3 * MiB] * 3 and arb.stats["write_whole"] == 1
        # a batch already in flight: the next one is sliced as before, the window never exceeded
        dev.sizes.clear()
        a = asyncio.ensure_future(write_sliced(dev.run, arb, 3, np.zeros(4), np.ones(4, np.uint64), np.full(4, MiB)))
        await asyncio.sleep(0)
        await write_sliced(dev.run, arb, 3, np.zeros(4), np.ones(4, np.uint64), np.full(4, MiB))
        await a
        assert dev.max_inflight <= 8 * MiB and arb.stats["write_whole"] == 2 and arb.granted == (0, 0)

    run_virtual(main)
