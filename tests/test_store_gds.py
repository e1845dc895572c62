"""CUDA buffers route to the GDS engine (or staging); without GPU I/O they are per-key False.

On this CPU machine "device memory" is host memory behind a CudaPointer, the GDS engine is a posix
engine, and device copies are memmoves: what is tested is the store's routing, CRC and publish.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import pytest

from conftest import KiB, payload, small_config
from umbp_nvme.engine import gds
from umbp_nvme.engine.posix import PosixEngine
from umbp_nvme.store import PageStore


class HostDeviceOps:
    def copy_d2h(self, pairs):
        for dev, host, n in pairs:
            ctypes.memmove(host, dev, n)

    def copy_h2d(self, pairs):
        for host, dev, n in pairs:
            ctypes.memmove(dev, host, n)

    def pin(self, addr, nbytes):
        return False

    def unpin(self, addr):
        pass

    def available(self):
        return True, "host fake"


class FakeGdsEngine(PosixEngine):
    """Like kvikio, opens the store's files again by /proc/self/fd (buffered here), never by fd."""

    def __init__(self, qd):
        super().__init__(qd)
        self._own: dict[int, int] = {}

    def _map(self, fds):
        out = []
        for fd in np.broadcast_to(np.asarray(fds), (len(fds),)).tolist():
            if fd not in self._own:
                self._own[fd] = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            out.append(self._own[fd])
        return np.asarray(out, np.int32)

    async def read_many(self, fds, offsets, addrs, lengths):
        return await super().read_many(self._map(fds), offsets, addrs, lengths)

    async def write_many(self, fds, offsets, addrs, lengths):
        return await super().write_many(self._map(fds), offsets, addrs, lengths)

    def forget_fd(self, fd):
        own = self._own.pop(fd, None)
        if own is not None:
            os.close(own)


def dev(arr: np.ndarray) -> gds.CudaPointer:
    return gds.CudaPointer(int(arr.ctypes.data), arr.nbytes)


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())

    async def opener(queue_depth, probe_dir=None):
        return FakeGdsEngine(queue_depth)

    def make(staging: bool):
        gate = gds.GdsGate(queue_depth=16, opener=opener if not staging else _unavailable, staging=staging,
                           staging_bytes=1 << 20)
        return gate

    return make


async def _unavailable(queue_depth, probe_dir=None):
    raise gds.gds_unavailable_error("no GPU in this test")


@pytest.mark.parametrize("staging", [False, True])
async def test_cuda_buffers_round_trip_through_gds_route(store_dir, fake_gpu, staging):
    st = await PageStore.open(store_dir, small_config())
    st._gds_gate = fake_gpu(staging)
    keys = [f"g{i}" for i in range(4)]
    src = [payload(k, 64 * KiB + 7 * i) for i, k in enumerate(keys)]
    assert await st.put_many(keys, [dev(a) for a in src]) == [True] * 4
    assert st._gds_gate.mode == ("staging" if staging else "gds")
    # the CRC recorded from device memory matches a host read of the same bytes
    host_out = [np.zeros(len(a), np.uint8) for a in src]
    assert await st.get_many(keys, host_out) == [True] * 4
    assert [bytes(o) for o in host_out] == [bytes(a) for a in src]
    dev_out = [np.zeros(len(a), np.uint8) for a in src]
    mixed = [dev(dev_out[0]), host_out[1], dev(dev_out[2]), dev(dev_out[3])]
    assert await st.get_many(keys, mixed) == [True] * 4
    assert [bytes(dev_out[i]) for i in (0, 2, 3)] == [bytes(src[i]) for i in (0, 2, 3)]
    await st.close()


async def test_cuda_buffer_without_gpu_io_is_false_with_one_clear_line(store_dir, monkeypatch, caplog):
    monkeypatch.setattr(gds, "gds_available", lambda: (False, "libcuda.so.1 cannot be loaded"))
    st = await PageStore.open(store_dir, small_config())
    host = payload("h", 4096)
    d = np.zeros(4096, np.uint8)
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.store"):
        assert await st.put_many(["h", "d"], [host, dev(d)]) == [True, False]
        assert await st.get_many(["h"], [dev(d)]) == [False]
    msgs = [r.getMessage() for r in caplog.records if r.name == "umbp_nvme.store"]
    assert len(msgs) == 2 and all("GPUDirect Storage is unavailable" in m for m in msgs)
    assert (d == 0).all()
    await st.close()
