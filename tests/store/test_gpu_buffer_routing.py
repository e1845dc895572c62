"""CUDA buffers route to the GDS engine (or staging); without GPU I/O they are per-key False.

On this CPU machine "device memory" is host memory behind a CudaPointer and device copies are
memmoves; the GDS route is the real one -- GdsGate -> open_gds_engine (settings, probe) ->
KvikioEngine -- over tests/support/fake_kvikio.py installed behind `import kvikio` (or the real kvikio
Python layer over the fake core when a wheel is at hand). What is tested is the store's routing,
CRC and publish through KvikioEngine, and which path kvikio says served the bytes.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest

from support import fake_kvikio as fk
from conftest import KiB, payload, small_config
from umbp_nvme.engine import gds
from umbp_nvme.store import PageStore


class HostDeviceOps:
    def __init__(self, core):
        self.core = core

    def alloc(self, nbytes):
        return self.core.alloc(nbytes)

    def allocation_base(self, addr):
        got = self.core.allocation_of(addr)
        return got[0] if got else None

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


def dev(arr: np.ndarray) -> gds.CudaPointer:
    return gds.CudaPointer(int(arr.ctypes.data), arr.nbytes)


@pytest.fixture(scope="session")
def real_layer_dir(tmp_path_factory):
    wheel = fk.find_kvikio_wheel()
    return fk.extract_python_layer(wheel, str(tmp_path_factory.mktemp("kvikio-real"))) if wheel else None


@pytest.fixture(params=["fake", "real"])
def kvikio_core(request, real_layer_dir):
    if request.param == "real":
        if real_layer_dir is None:
            pytest.skip("no kvikio-cu12/-cu13 wheel at hand (tools/fetch_kvikio_wheel.sh)")
        inst = fk.install_real(real_layer_dir)
    else:
        inst = fk.install()
    yield inst.core
    inst.uninstall()


@pytest.fixture
def fake_gpu(monkeypatch, kvikio_core):
    """A machine where GDS is available: the store's gate opens the real KvikioEngine over kvikio."""
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps(kvikio_core))
    monkeypatch.setattr(gds, "gds_available", lambda: (True, "fake kvikio"))
    engines = []
    real_open = gds.open_gds_engine

    async def opener(*a, **kw):
        e = await real_open(*a, **kw)
        engines.append(e)
        return e

    monkeypatch.setattr(gds, "open_gds_engine", opener)

    def staging_only():
        class StagingGate(gds.GdsGate):  # what gds_staging=True gives on a machine without GDS
            def __init__(self, **kw):
                super().__init__(**{**kw, "staging": True})

        monkeypatch.setattr(gds, "gds_available", lambda: (False, "no GPU in this test"))
        monkeypatch.setattr(gds, "GdsGate", StagingGate)

    return types_ns(core=kvikio_core, engines=engines, staging_only=staging_only)


def types_ns(**kw):
    import types

    return types.SimpleNamespace(**kw)


@pytest.mark.parametrize("staging", [False, True])
async def test_cuda_buffers_round_trip_through_gds_route(store_dir, fake_gpu, staging):
    if staging:
        fake_gpu.staging_only()
    st = await PageStore.open(store_dir, small_config())
    keys = [f"g{i}" for i in range(4)]
    src = [payload(k, 64 * KiB + 7 * i) for i, k in enumerate(keys)]
    assert await st.put_many(keys, [dev(a) for a in src]) == [True] * 4
    # the CRC recorded from device memory matches a host read of the same bytes
    host_out = [np.zeros(len(a), np.uint8) for a in src]
    assert await st.get_many(keys, host_out) == [True] * 4
    assert [bytes(o) for o in host_out] == [bytes(a) for a in src]
    dev_out = [np.zeros(len(a), np.uint8) for a in src]
    mixed = [dev(dev_out[0]), host_out[1], dev(dev_out[2]), dev(dev_out[3])]
    assert await st.get_many(keys, mixed) == [True] * 4
    assert [bytes(dev_out[i]) for i in (0, 2, 3)] == [bytes(src[i]) for i in (0, 2, 3)]
    calls = fake_gpu.core.calls
    if staging:
        assert fake_gpu.engines == [] and calls == []  # io_uring/posix + copies; kvikio untouched
    else:
        (e,) = fake_gpu.engines
        assert isinstance(e, gds.KvikioEngine)
        writes = [c for c in calls if c[0] == "pwrite"]
        reads = [c for c in calls if c[0] == "pread"]
        assert len(writes) == 4 and len(reads) == 1 + 3  # the probe and 3 device reads (host reads: io_uring)
        assert {c[4] for c in calls} == {"GDS"}  # every op went to cuFile
        served = e.stats()["served"]
        assert served["write"]["cufile"] == sum(a.nbytes for a in src) and served["write"]["posix"] == 0
        assert e.path() == "gds"
        assert set(e.file_paths().values()) == {"cufile"}
    await st.close()
    if not staging:
        assert all(f.closed() for f in fake_gpu.core.opened)  # the store's close dropped every CuFile


async def test_store_reports_posix_when_kvikio_falls_back(store_dir, fake_gpu):
    fake_gpu.core.cufile_available = False  # AUTO without /run/udev: every file POSIX
    st = await PageStore.open(store_dir, small_config())
    src = payload("p", 32 * KiB)
    assert await st.put_many(["p"], [dev(src)]) == [True]
    out = np.zeros_like(src)
    assert await st.get_many(["p"], [dev(out)]) == [True] and bytes(out) == bytes(src)
    (e,) = fake_gpu.engines
    assert e.path() == "posix" and {c[4] for c in fake_gpu.core.calls} == {"POSIX"}
    assert e.describe()["compat_decision"] == "posix"
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
