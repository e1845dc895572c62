"""GPUDirect Storage (engine/gds.py): routing and errors on CPU with fakes; real GPU tests skip.

The CPU tests stand a fake ``kvikio`` in for the real one. Its "device" pointers are host memory,
so the engine's logic (fd -> CuFile mapping, futures in flight, EOF clipping, -errno results,
close) is checked byte for byte without a GPU. The ``test_gpu_*`` tests need a CUDA device, the
NVIDIA driver and kvikio, and skip with the reason otherwise (tools/gpu_check.sh runs them).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import threading
import types

import numpy as np
import pytest

from umbp_nvme.engine import gds
from umbp_nvme.engine.base import EngineClosed, EngineUnavailable, IoEngine

PAGE = 4096


# ---------------------------------------------------------------- fakes


class FakeFuture:
    """Deferred: the transfer runs at get(), so 'created but not got' counts ops in flight."""

    def __init__(self, kv, fn):
        self._kv = kv
        self._fn = fn
        with kv.lock:
            kv.outstanding += 1
            kv.max_outstanding = max(kv.max_outstanding, kv.outstanding)

    def get(self):
        try:
            if self._kv.gate is not None:
                self._kv.started.set()
                self._kv.gate.wait(10)
            return self._fn()
        finally:
            with self._kv.lock:
                self._kv.outstanding -= 1

    def done(self):
        return False


class FakeCuFile:
    def __init__(self, kv, path, flags="r"):
        assert flags in ("r", "r+"), f"engine must never open with {flags!r} (kvikio 'w' truncates)"
        self._kv = kv
        self.path = path
        self.flags = flags
        self.fd = os.open(path, os.O_RDWR if "+" in flags else os.O_RDONLY)
        self.closed = False
        kv.opened.append(self)

    @staticmethod
    def _addr(buf):
        iface = buf.__cuda_array_interface__
        return iface["data"][0], iface["shape"][0]

    def pread(self, buf, size, file_offset=0, task_size=None):
        addr, cap = self._addr(buf)
        assert size <= cap
        kv = self._kv

        def run():
            if file_offset in kv.fail_at:
                raise kv.fail_at[file_offset]
            want = size
            if file_offset in kv.short_once:
                kv.short_once.discard(file_offset)
                want = size // 2
            data = os.pread(self.fd, want, file_offset)
            if len(data) < want:
                raise RuntimeError("posix_host_read: EOF")
            if file_offset in kv.corrupt_at:
                data = bytes(b ^ 0xFF for b in data)
            ctypes.memmove(addr, data, len(data))
            return len(data)

        kv.calls.append(("pread", self.path, file_offset, size))
        return FakeFuture(kv, run)

    def pwrite(self, buf, size, file_offset=0, task_size=None):
        addr, cap = self._addr(buf)
        kv = self._kv

        def run():
            if file_offset in kv.fail_at:
                raise kv.fail_at[file_offset]
            return os.pwrite(self.fd, ctypes.string_at(addr, size), file_offset)

        kv.calls.append(("pwrite", self.path, file_offset, size))
        return FakeFuture(kv, run)

    def fileno(self):
        return self.fd

    def close(self):
        if not self.closed:
            self.closed = True
            os.close(self.fd)


def make_fake_kvikio(style="25"):
    kv = types.SimpleNamespace()
    kv.__version__ = "0.0-fake"
    kv.lock = threading.Lock()
    kv.outstanding = 0
    kv.max_outstanding = 0
    kv.opened = []
    kv.calls = []
    kv.fail_at = {}
    kv.short_once = set()
    kv.corrupt_at = set()
    kv.gate = None
    kv.started = threading.Event()
    kv.CuFile = lambda path, flags="r": FakeCuFile(kv, path, flags)
    settings = {"compat_mode": "AUTO", "num_threads": 1, "gds_threshold": 1 << 20}
    kv.settings = settings
    if style == "25":
        kv.defaults = types.SimpleNamespace(get=settings.__getitem__,
                                            set=lambda k, v: settings.__setitem__(k, v))
    else:  # 24.x: no get/set, *_reset functions
        kv.defaults = types.SimpleNamespace(
            compat_mode=lambda: settings["compat_mode"],
            get_num_threads=lambda: settings["num_threads"],
            gds_threshold=lambda: settings["gds_threshold"],
            compat_mode_reset=lambda v: settings.__setitem__("compat_mode", v),
            num_threads_reset=lambda v: settings.__setitem__("num_threads", v),
            gds_threshold_reset=lambda v: settings.__setitem__("gds_threshold", v),
        )
    return kv


class HostDeviceOps:
    """'Device' memory that is host memory, for the probe/staging/CRC paths on CPU."""

    def __init__(self):
        self.copies = 0

    def alloc(self, nbytes):
        a = np.zeros(max(nbytes, 1), dtype=np.uint8)
        return a, int(a.ctypes.data)

    def copy_d2h(self, pairs):
        for dev, host, n in pairs:
            ctypes.memmove(host, dev, n)
            self.copies += 1

    def copy_h2d(self, pairs):
        for host, dev, n in pairs:
            ctypes.memmove(dev, host, n)
            self.copies += 1

    def pin(self, addr, nbytes):
        return False

    def unpin(self, addr):
        pass

    def available(self):
        return True, "ok"


class FakeCudaTensor:
    """Duck-types the torch.Tensor attributes cuda_buffer_address reads."""

    def __init__(self, arr, contiguous=True):
        self.arr = arr
        self.is_cuda = True
        self.shape = arr.shape
        self._contiguous = contiguous

    def data_ptr(self):
        return int(self.arr.ctypes.data)

    def element_size(self):
        return self.arr.itemsize

    def numel(self):
        return self.arr.size

    def is_contiguous(self):
        return self._contiguous

    def stride(self):
        return tuple(s // self.arr.itemsize for s in self.arr.strides)


class CaiObject:
    def __init__(self, **iface):
        self.__cuda_array_interface__ = {"version": 3, **iface}


@pytest.fixture
def kv():
    return make_fake_kvikio()


@pytest.fixture
def engine(kv):
    e = gds.KvikioEngine(8, kvikio=kv)
    yield e
    e.close()


@pytest.fixture
def data_file(tmp_path):
    payload = np.random.default_rng(7).integers(0, 256, 16 * PAGE, dtype=np.uint8).tobytes()
    path = tmp_path / "seg0"
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDWR)
    yield fd, payload, path
    try:
        os.close(fd)
    except OSError:
        pass


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


# ---------------------------------------------------------------- cuda_buffer_address / routing


def test_cuda_pointer_is_a_cuda_buffer():
    assert gds.cuda_buffer_address(gds.CudaPointer(0x7F0000000000, 1 << 20)) == (0x7F0000000000, 1 << 20)


def test_cuda_pointer_rejects_negative_values():
    with pytest.raises(ValueError, match="nbytes"):
        gds.CudaPointer(4096, -1)


def test_cuda_array_interface_object_gives_address_and_bytes():
    obj = CaiObject(data=(0x1000, False), shape=(4, 256), typestr="<f4", strides=None)
    assert gds.cuda_buffer_address(obj) == (0x1000, 4 * 256 * 4)


def test_cuda_array_interface_c_strides_are_contiguous():
    obj = CaiObject(data=(0x2000, False), shape=(2, 3, 1), typestr="<f2", strides=(6, 2, 99))
    assert gds.cuda_buffer_address(obj) == (0x2000, 12)


def test_strided_cuda_array_is_refused():
    obj = CaiObject(data=(0x1000, False), shape=(4, 4), typestr="|u1", strides=(8, 1))
    with pytest.raises(TypeError, match="not C-contiguous"):
        gds.cuda_buffer_address(obj)


def test_read_only_cuda_array_is_refused_as_a_read_destination():
    obj = CaiObject(data=(0x1000, True), shape=(16,), typestr="|u1")
    assert gds.cuda_buffer_address(obj) == (0x1000, 16)  # fine as a write source
    with pytest.raises(TypeError, match="read-only"):
        gds.cuda_buffer_address(obj, writable=True)


def test_masked_cuda_array_is_refused():
    obj = CaiObject(data=(0x1000, False), shape=(16,), typestr="|u1", mask=object())
    with pytest.raises(TypeError, match="masked"):
        gds.cuda_buffer_address(obj)


def test_cuda_tensor_duck_type_gives_address():
    a = np.zeros((3, 5), dtype=np.float32)
    assert gds.cuda_buffer_address(FakeCudaTensor(a)) == (addr(a), 60)


def test_non_contiguous_cuda_tensor_is_refused():
    a = np.zeros((4, 4), dtype=np.float32)
    with pytest.raises(TypeError, match="not contiguous"):
        gds.cuda_buffer_address(FakeCudaTensor(a, contiguous=False))


@pytest.mark.parametrize(
    "buf",
    [np.zeros(16, np.uint8), bytearray(16), memoryview(bytearray(8)), (4096, 4096), b"abc"],
    ids=["numpy", "bytearray", "memoryview", "addr-pair", "bytes"],
)
def test_host_buffers_are_not_cuda_buffers(buf):
    assert gds.cuda_buffer_address(buf) is None


def test_torch_cpu_tensor_is_not_a_cuda_buffer():
    torch = pytest.importorskip("torch")
    assert gds.cuda_buffer_address(torch.zeros(8)) is None


# ---------------------------------------------------------------- availability and the error


def test_gds_is_unavailable_here_with_a_reason():
    gds._reset_availability_cache()
    ok, reason = gds.gds_available()
    if ok:
        pytest.skip("this machine has CUDA and kvikio")
    assert reason and isinstance(reason, str)


def test_gds_available_is_cached(monkeypatch):
    calls = []
    monkeypatch.setattr(gds, "_check_libcuda", lambda: calls.append(1) or "libcuda.so.1 cannot be loaded")
    gds._reset_availability_cache()
    try:
        assert gds.gds_available() == (False, "libcuda.so.1 cannot be loaded")
        assert gds.gds_available()[0] is False
        assert len(calls) == 1
    finally:
        gds._reset_availability_cache()


def test_missing_kvikio_is_named_in_the_reason(monkeypatch):
    monkeypatch.setattr(gds, "_check_libcuda", lambda: None)
    monkeypatch.setattr(gds, "_check_torch_cuda", lambda: None)

    def no_kvikio():
        raise ImportError("No module named 'kvikio'")

    monkeypatch.setattr(gds, "_import_kvikio", no_kvikio)
    gds._reset_availability_cache()
    try:
        ok, reason = gds.gds_available()
        assert not ok and "kvikio" in reason and "install" in reason
    finally:
        gds._reset_availability_cache()


async def test_open_gds_engine_without_cuda_raises_the_clear_error(monkeypatch):
    monkeypatch.setattr(gds, "gds_available", lambda: (False, "libcuda.so.1 cannot be loaded"))
    with pytest.raises(EngineUnavailable) as ei:
        await gds.open_gds_engine()
    msg = str(ei.value)
    assert "CUDA buffer given but GPUDirect Storage is unavailable: libcuda.so.1 cannot be loaded" in msg
    assert "install umbp_nvme[gds] on a CUDA machine or pass host memory" in msg
    assert ei.value.errno == errno.ENODEV


async def test_gate_refuses_cuda_buffers_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(gds, "gds_available", lambda: (False, "no driver"))
    gate = gds.GdsGate()
    with caplog.at_level(logging.WARNING, logger=gds.__name__):
        for _ in range(3):
            with pytest.raises(EngineUnavailable, match="GPUDirect Storage is unavailable: no driver"):
                await gate.route()
    assert gate.mode == "off"
    assert sum("GPUDirect Storage is unavailable" in r.getMessage() for r in caplog.records) == 1


async def test_gate_stages_when_configured_and_cuda_copies_work(monkeypatch):
    monkeypatch.setattr(gds, "gds_available", lambda: (False, "kvikio is not importable"))
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())
    gate = gds.GdsGate(staging=True, staging_bytes=1 << 20)
    try:
        assert await gate.route() == "staging"
        assert gate.staging is not None and gate.staging.nbytes == 1 << 20
    finally:
        gate.close()


async def test_gate_allocates_its_staging_buffer_only_when_used(monkeypatch, data_file):
    from umbp_nvme.engine.posix import PosixEngine

    monkeypatch.setattr(gds, "gds_available", lambda: (False, "kvikio is not importable"))
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())
    made = []
    real = gds.StagingBuffer
    monkeypatch.setattr(gds, "StagingBuffer", lambda n, **kw: made.append(n) or real(n, **kw))
    gate = gds.GdsGate(staging=True, staging_bytes=1 << 20)
    host = PosixEngine(4)
    try:
        for _ in range(3):
            assert await gate.route() == "staging"
        assert made == []  # deciding the route pins nothing
        fd, payload, _ = data_file
        dst = np.zeros(PAGE, np.uint8)
        assert (await gds.staged_read(host, fd, [0], [addr(dst)], [PAGE], gate.staging)).tolist() == [PAGE]
        assert dst.tobytes() == payload[:PAGE]
        assert gate.staging is gate.staging and made == [1 << 20]  # allocated once, on first use
    finally:
        gate.close()
        host.close()
    assert gate._staging is None
    gate.close()  # idempotent, allocates nothing
    assert made == [1 << 20]


async def test_gate_in_gds_mode_has_no_staging_buffer(fake_cuda, tmp_path):
    gate = gds.GdsGate(queue_depth=8, probe_dir=str(tmp_path), staging=True)
    try:
        assert await gate.route() == "gds" and gate.staging is None
    finally:
        gate.close()


async def test_store_staging_route_never_allocates_the_gate_buffer(monkeypatch, store_dir):
    from conftest import payload as make_payload
    from conftest import small_config
    from umbp_nvme.store import PageStore

    async def unavailable(queue_depth, probe_dir=None):
        raise gds.gds_unavailable_error("no GPU in this test")

    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())
    st = await PageStore.open(store_dir, small_config())
    gate = st._gds_gate = gds.GdsGate(queue_depth=8, opener=unavailable, staging=True)
    try:
        src = make_payload("k", 5000)
        assert await st.put_many(["k"], [gds.CudaPointer(addr(src), src.nbytes)]) == [True]
        out = np.zeros_like(src)
        assert await st.get_many(["k"], [gds.CudaPointer(addr(out), out.nbytes)]) == [True]
        assert out.tobytes() == src.tobytes()
        assert gate.mode == "staging" and gate._staging is None  # the store uses its own bounce buffers
    finally:
        await st.close()


async def test_gate_staging_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(gds, "gds_available", lambda: (False, "no driver"))
    gate = gds.GdsGate(staging=True)
    with pytest.raises(EngineUnavailable, match="staging impossible too"):
        await gate.route()


# ---------------------------------------------------------------- engine over the fake kvikio


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, IoEngine)
    assert engine.capabilities.name == "kvikio" and engine.capabilities.device_memory


async def test_read_many_is_byte_exact_across_extents(engine, data_file):
    fd, payload, _ = data_file
    offs = [0, 3 * PAGE, 8 * PAGE, 15 * PAGE]
    lens = [PAGE, 2 * PAGE, 5 * PAGE, PAGE]
    dst = [np.zeros(n, np.uint8) for n in lens]
    res = await engine.read_many(fd, offs, [addr(d) for d in dst], lens)
    assert res.dtype == np.int64 and res.tolist() == lens
    for d, o, n in zip(dst, offs, lens):
        assert d.tobytes() == payload[o : o + n]


async def test_cufile_is_opened_once_per_fd_through_proc_self_fd(engine, kv, data_file):
    fd, _, _ = data_file
    buf = np.zeros(PAGE, np.uint8)
    for _ in range(3):
        await engine.read_many(fd, [0], [addr(buf)], [PAGE])
    assert len(kv.opened) == 1
    assert kv.opened[0].path == f"/proc/self/fd/{fd}" and kv.opened[0].flags == "r+"
    assert engine.cached_fds() == [fd]


async def test_read_only_fd_opens_read_only_and_refuses_writes(engine, kv, tmp_path):
    p = tmp_path / "ro"
    p.write_bytes(b"x" * PAGE)
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = np.zeros(PAGE, np.uint8)
        assert (await engine.read_many(fd, [0], [addr(buf)], [PAGE])).tolist() == [PAGE]
        assert kv.opened[-1].flags == "r"
        assert (await engine.write_many(fd, [0], [addr(buf)], [PAGE])).tolist() == [-errno.EBADF]
    finally:
        engine.forget_fd(fd)
        os.close(fd)


async def test_write_many_then_read_back(engine, data_file):
    fd, _, path = data_file
    src = np.random.default_rng(1).integers(0, 256, 2 * PAGE, dtype=np.uint8)
    res = await engine.write_many(fd, [PAGE, 6 * PAGE], [addr(src), addr(src) + PAGE], [PAGE, PAGE])
    assert res.tolist() == [PAGE, PAGE]
    await engine.sync(fd)
    on_disk = path.read_bytes()
    assert on_disk[PAGE : 2 * PAGE] == src[:PAGE].tobytes()
    assert on_disk[6 * PAGE : 7 * PAGE] == src[PAGE:].tobytes()


async def test_read_past_eof_is_short_and_beyond_eof_is_zero(engine, data_file):
    fd, payload, _ = data_file
    a, b = np.zeros(2 * PAGE, np.uint8), np.zeros(PAGE, np.uint8)
    res = await engine.read_many(fd, [15 * PAGE, 40 * PAGE], [addr(a), addr(b)], [2 * PAGE, PAGE])
    assert res.tolist() == [PAGE, 0]
    assert a[:PAGE].tobytes() == payload[15 * PAGE :]


async def test_one_failing_op_does_not_fail_the_batch(engine, kv, data_file):
    fd, payload, _ = data_file
    kv.fail_at[2 * PAGE] = RuntimeError("cuFile error: Input/output error")
    kv.fail_at[4 * PAGE] = OSError(errno.ENOSPC, "no space")
    bufs = [np.zeros(PAGE, np.uint8) for _ in range(3)]
    res = await engine.read_many(fd, [0, 2 * PAGE, 4 * PAGE], [addr(b) for b in bufs], [PAGE] * 3)
    assert res.tolist() == [PAGE, -errno.EIO, -errno.ENOSPC]
    assert bufs[0].tobytes() == payload[:PAGE]


async def test_bad_fd_fails_only_its_ops(engine, data_file):
    fd, payload, _ = data_file
    bad = next(n for n in range(900, 1000) if not _is_open(n))  # a descriptor number nobody holds
    a, b = np.zeros(PAGE, np.uint8), np.zeros(PAGE, np.uint8)
    res = await engine.read_many([fd, bad], [0, 0], [addr(a), addr(b)], [PAGE, PAGE])
    assert res.tolist() == [PAGE, -errno.EBADF]
    assert a.tobytes() == payload[:PAGE]


async def test_reused_fd_number_gets_a_fresh_cufile(engine, kv, data_file, tmp_path):
    fd, payload, _ = data_file
    buf = np.zeros(PAGE, np.uint8)
    await engine.read_many(fd, [0], [addr(buf)], [PAGE])
    other = tmp_path / "other"
    other.write_bytes(b"\xab" * PAGE)
    nfd = os.open(other, os.O_RDWR)
    os.dup2(nfd, fd)  # same number, another file: what a close + open can do
    os.close(nfd)
    await engine.read_many(fd, [0], [addr(buf)], [PAGE])
    assert buf.tobytes() == b"\xab" * PAGE
    assert len(kv.opened) == 2 and kv.opened[0].closed and not kv.opened[1].closed


async def test_forget_fd_closes_the_cufile(engine, kv, data_file):
    fd, _, _ = data_file
    buf = np.zeros(PAGE, np.uint8)
    await engine.read_many(fd, [0], [addr(buf)], [PAGE])
    engine.forget_fd(fd)
    assert kv.opened[0].closed and engine.cached_fds() == []


async def test_in_flight_ops_are_bounded_by_queue_depth(kv, data_file):
    fd, _, _ = data_file
    e = gds.KvikioEngine(4, kvikio=kv)
    try:
        bufs = np.zeros((16, PAGE), np.uint8)
        res = await e.read_many(fd, [i * PAGE for i in range(16)], [addr(bufs) + i * PAGE for i in range(16)],
                                [PAGE] * 16)
        assert res.tolist() == [PAGE] * 16
        assert kv.max_outstanding == 4  # several in flight, never more than queue_depth
    finally:
        e.close()


async def test_concurrent_batches_share_the_queue_depth(kv, data_file):
    fd, payload, _ = data_file
    e = gds.KvikioEngine(3, kvikio=kv, max_batches=4)
    try:
        bufs = [np.zeros((16, PAGE), np.uint8) for _ in range(4)]
        offs = [i * PAGE for i in range(16)]
        results = await asyncio.gather(*(e.read_many(fd, offs, [addr(b) + i * PAGE for i in range(16)], [PAGE] * 16)
                                         for b in bufs))
        assert all(r.tolist() == [PAGE] * 16 for r in results)
        assert all(b.tobytes() == payload for b in bufs)
        assert kv.max_outstanding <= 3
    finally:
        e.close()


async def test_short_transfer_is_retried_for_the_remainder(engine, kv, data_file):
    fd, payload, _ = data_file
    kv.short_once.add(2 * PAGE)
    buf = np.zeros(2 * PAGE, np.uint8)
    res = await engine.read_many(fd, [2 * PAGE], [addr(buf)], [2 * PAGE])
    assert res.tolist() == [2 * PAGE] and buf.tobytes() == payload[2 * PAGE : 4 * PAGE]


async def test_empty_batch_and_zero_length_ops_touch_nothing(engine, kv, data_file):
    fd, _, _ = data_file
    assert (await engine.read_many(fd, [], [], [])).tolist() == []
    assert (await engine.read_many(fd, [0], [0], [0])).tolist() == [0]
    assert kv.calls == []


async def test_close_fails_pending_awaits_and_later_calls(kv, data_file):
    fd, _, _ = data_file
    kv.gate = threading.Event()
    e = gds.KvikioEngine(4, kvikio=kv)
    buf = np.zeros(PAGE, np.uint8)
    task = asyncio.ensure_future(e.read_many(fd, [0], [addr(buf)], [PAGE]))
    assert await asyncio.to_thread(kv.started.wait, 5)
    e.close()
    e.close()  # idempotent
    with pytest.raises(EngineClosed):
        await asyncio.wait_for(task, 5)
    with pytest.raises(EngineClosed):
        await e.read_many(fd, [0], [addr(buf)], [PAGE])
    kv.gate.set()  # the op kvikio already had finishes; its CuFile is closed after it
    for _ in range(100):
        if kv.opened[0].closed:
            break
        await asyncio.sleep(0.02)
    assert kv.opened[0].closed


def test_register_buffers_without_kvikio_support_is_false(engine):
    assert engine.register_buffers([(0x1000, 4096)]) is False


def test_errno_mapping_from_kvikio_exceptions():
    assert gds._errno_of(OSError(errno.ENOSPC, "x")) == errno.ENOSPC
    assert gds._errno_of(RuntimeError(f"cuFile: {os.strerror(errno.EINVAL)}")) == errno.EINVAL
    assert gds._errno_of(RuntimeError("cuFile internal error 5011")) == errno.EIO


@pytest.mark.parametrize("style", ["24", "25"])
def test_kvikio_settings_across_versions(style):
    kv = make_fake_kvikio(style)
    gds.configure_kvikio(kv, 64)
    assert gds.kvikio_get(kv, "num_threads") == 16
    assert gds.kvikio_get(kv, "gds_threshold") == PAGE
    gds.configure_kvikio(kv, 64, compat_mode="on")
    assert kv.settings["compat_mode"] is True  # no CompatMode enum in the fake: a bool


def test_kvikio_env_settings_are_respected(monkeypatch):
    kv = make_fake_kvikio()
    monkeypatch.setenv("KVIKIO_NTHREADS", "2")
    monkeypatch.setenv("KVIKIO_GDS_THRESHOLD", "65536")
    gds.configure_kvikio(kv, 64)
    assert kv.settings["num_threads"] == 1 and kv.settings["gds_threshold"] == 1 << 20


# ---------------------------------------------------------------- open + probe with fakes


@pytest.fixture
def fake_cuda(monkeypatch, kv):
    monkeypatch.setattr(gds, "gds_available", lambda: (True, "fake"))
    monkeypatch.setattr(gds, "_import_kvikio", lambda: kv)
    ops = HostDeviceOps()
    monkeypatch.setattr(gds, "_device_ops", ops)
    return ops


async def test_open_gds_engine_probes_one_page(fake_cuda, kv, tmp_path):
    e = await gds.open_gds_engine(16, probe_dir=str(tmp_path))
    try:
        assert [c[0] for c in kv.calls] == ["pread"] and kv.calls[0][3] == gds.PROBE_BYTES
        assert kv.settings["num_threads"] == 16
        assert os.listdir(tmp_path) == []  # the probe file is gone
        assert e.cached_fds() == []  # and its CuFile dropped
    finally:
        e.close()


async def test_probe_on_a_store_file_reads_that_page(fake_cuda, kv, data_file):
    fd, _, _ = data_file
    e = await gds.open_gds_engine(8, probe_fd=fd)
    e.close()
    assert kv.calls[0][1] == f"/proc/self/fd/{fd}"


async def test_probe_mismatch_refuses_gds(fake_cuda, kv, tmp_path):
    kv.corrupt_at.add(0)
    with pytest.raises(EngineUnavailable, match="probe read failed.*differs from a host read"):
        await gds.open_gds_engine(8, probe_dir=str(tmp_path))


async def test_probe_error_refuses_gds(fake_cuda, kv, tmp_path):
    kv.fail_at[0] = RuntimeError("cuFile error: Input/output error")
    with pytest.raises(EngineUnavailable, match="probe read of 4096 bytes returned EIO"):
        await gds.open_gds_engine(8, probe_dir=str(tmp_path))


async def test_gate_opens_gds_once(fake_cuda, tmp_path):
    gate = gds.GdsGate(queue_depth=8, probe_dir=str(tmp_path))
    try:
        assert await gate.route() == "gds"
        first = gate.engine
        assert await gate.route() == "gds" and gate.engine is first
    finally:
        gate.close()


# ---------------------------------------------------------------- staging and CRC on CPU


def test_crc32c_fallback_matches_the_standard_check_value():
    data = np.frombuffer(b"123456789", dtype=np.uint8).copy()
    assert gds._py_crc32c(addr(data), 9) == 0xE3069283
    assert gds.host_crc32c(addr(data), 9) == 0xE3069283


async def test_staged_write_then_read_round_trip_with_crc(monkeypatch, data_file):
    from umbp_nvme.engine.posix import PosixEngine

    ops = HostDeviceOps()
    monkeypatch.setattr(gds, "_device_ops", ops)
    fd, payload, path = data_file
    host = PosixEngine(8)
    staging = gds.StagingBuffer(3 * PAGE)  # smaller than the batch: several groups
    try:
        src = np.random.default_rng(3).integers(0, 256, 4 * PAGE + 100, dtype=np.uint8)
        lens = [PAGE, 2 * PAGE, PAGE, 100]
        starts = [0, PAGE, 3 * PAGE, 4 * PAGE]
        offs = [0, 4 * PAGE, 8 * PAGE, 12 * PAGE]
        res, wcrc = await gds.staged_write(host, fd, offs, [addr(src) + s for s in starts], lens, staging,
                                           with_crc=True)
        assert res.tolist() == lens
        dst = np.zeros_like(src)
        res, rcrc = await gds.staged_read(host, fd, offs, [addr(dst) + s for s in starts], lens, staging,
                                          with_crc=True)
        assert res.tolist() == lens
        assert dst.tobytes() == src.tobytes()
        assert rcrc.tolist() == wcrc.tolist()
        assert wcrc[0] == gds._py_crc32c(addr(src), PAGE)
    finally:
        staging.close()
        host.close()


async def test_staged_op_larger_than_staging_is_enobufs(monkeypatch, data_file):
    from umbp_nvme.engine.posix import PosixEngine

    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())
    fd, payload, _ = data_file
    host = PosixEngine(4)
    staging = gds.StagingBuffer(PAGE)
    try:
        a, b = np.zeros(2 * PAGE, np.uint8), np.zeros(PAGE, np.uint8)
        res = await gds.staged_read(host, fd, [0, 0], [addr(a), addr(b)], [2 * PAGE, PAGE], staging)
        assert res.tolist() == [-errno.ENOBUFS, PAGE] and b.tobytes() == payload[:PAGE]
    finally:
        staging.close()
        host.close()


class DirectOnlyEngine:
    """A host engine with O_DIRECT's rule: a misaligned offset, length or address is -EINVAL."""

    def __init__(self):
        from umbp_nvme.engine.posix import PosixEngine

        self._posix = PosixEngine(4)
        self.lengths_seen: list[int] = []

    async def _direct(self, fn, fds, offsets, addrs, lengths):
        from umbp_nvme.engine.base import IoBatch

        b = IoBatch.of(fds, offsets, addrs, lengths)
        self.lengths_seen += b.lengths.tolist()
        bad = (b.offsets % PAGE != 0) | (b.lengths % PAGE != 0) | (b.addrs % PAGE != 0)
        res = np.full(len(b), -errno.EINVAL, np.int64)
        good = np.flatnonzero(~bad)
        if len(good):
            res[good] = await fn(b.fds[good], b.offsets[good], b.addrs[good], b.lengths[good])
        return res

    async def read_many(self, *args):
        return await self._direct(self._posix.read_many, *args)

    async def write_many(self, *args):
        return await self._direct(self._posix.write_many, *args)

    def close(self):
        self._posix.close()


@pytest.fixture
def direct_host(monkeypatch):
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())
    host = DirectOnlyEngine()
    staging = gds.StagingBuffer(4 * PAGE)
    yield host, staging
    staging.close()
    host.close()


async def test_staged_unaligned_objects_round_trip_on_o_direct_files(direct_host, data_file):
    host, staging = direct_host
    fd, payload, path = data_file
    lens = [100, PAGE + 1, 3 * PAGE - 5, PAGE]  # slots: 1, 2, 3 and 1 pages
    offs = [0, 2 * PAGE, 6 * PAGE, 10 * PAGE]
    src = [np.random.default_rng(20 + i).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(lens)]
    res, wcrc = await gds.staged_write(host, fd, offs, [addr(a) for a in src], lens, staging, with_crc=True)
    assert res.tolist() == lens  # clipped to the object, not the padded block count
    assert set(n % PAGE for n in host.lengths_seen) == {0}
    assert wcrc.tolist() == [gds._py_crc32c(addr(a), a.nbytes) for a in src]
    disk = path.read_bytes()
    for o, a in zip(offs, src):
        end = o + a.nbytes
        assert disk[o:end] == a.tobytes()
        assert disk[end : gds._round_up(end)] == bytes(gds._round_up(end) - end)  # zeroed padding
    for o in (PAGE, 5 * PAGE, 9 * PAGE, 11 * PAGE):  # the neighbours' pages are untouched
        assert disk[o : o + PAGE] == payload[o : o + PAGE]
    dst = [np.full(n + 64, 0xEE, np.uint8) for n in lens]  # a guard after each destination
    res, rcrc = await gds.staged_read(host, fd, offs, [addr(d) for d in dst], lens, staging, with_crc=True)
    assert res.tolist() == lens and rcrc.tolist() == wcrc.tolist()
    for d, a in zip(dst, src):
        assert d[: a.nbytes].tobytes() == a.tobytes()
        assert (d[a.nbytes :] == 0xEE).all()  # only `lengths` bytes reach the device


async def test_staged_write_padding_never_carries_stale_staging_bytes(direct_host, data_file):
    host, staging = direct_host
    fd, payload, path = data_file
    ctypes.memset(staging.address, 0xAA, staging.nbytes)  # what an earlier, larger op leaves behind
    src = np.arange(100, dtype=np.uint8)
    assert (await gds.staged_write(host, fd, [PAGE], [addr(src)], [100], staging)).tolist() == [100]
    disk = path.read_bytes()
    assert disk[PAGE : PAGE + 100] == src.tobytes()
    assert disk[PAGE + 100 : 2 * PAGE] == bytes(PAGE - 100)
    assert disk[2 * PAGE :] == payload[2 * PAGE :] and disk[:PAGE] == payload[:PAGE]


async def test_staged_read_of_an_unaligned_tail_at_eof_is_clipped(direct_host, tmp_path):
    host, staging = direct_host
    path = tmp_path / "tail"
    data = np.random.default_rng(9).integers(0, 256, PAGE + 300, dtype=np.uint8)
    path.write_bytes(data.tobytes())  # the file ends inside the object's last block
    fd = os.open(path, os.O_RDONLY)
    try:
        dst = np.full(PAGE + 300, 0xEE, np.uint8)
        res = await gds.staged_read(host, fd, [0, PAGE], [addr(dst), addr(dst) + PAGE], [PAGE, 300 + 50], staging)
        assert res.tolist() == [PAGE, 300]  # short at EOF, as the protocol says
        assert dst.tobytes() == data.tobytes()
    finally:
        os.close(fd)


async def test_staged_op_whose_padded_length_exceeds_staging_is_enobufs(direct_host, data_file):
    host, staging = direct_host
    fd, payload, _ = data_file
    big, small = np.zeros(4 * PAGE + 1, np.uint8), np.zeros(10, np.uint8)
    res = await gds.staged_read(host, fd, [0, 0], [addr(big), addr(small)], [4 * PAGE + 1, 10], staging)
    assert res.tolist() == [-errno.ENOBUFS, 10] and small.tobytes() == payload[:10]


async def test_device_crc32c_many_matches_host_crc(monkeypatch):
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())
    src = np.random.default_rng(5).integers(0, 256, 3 * PAGE, dtype=np.uint8)
    crcs = await gds.device_crc32c_many([addr(src), addr(src) + PAGE], [PAGE, 2 * PAGE])
    assert crcs.tolist() == [gds._py_crc32c(addr(src), PAGE), gds._py_crc32c(addr(src) + PAGE, 2 * PAGE)]


# ---------------------------------------------------------------- real GPU (skip without one)

_gpu_ok, _gpu_reason = gds.gds_available()
gpu = pytest.mark.skipif(not _gpu_ok, reason=f"needs a CUDA device with kvikio: {_gpu_reason}")


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    return torch


@gpu
async def test_gpu_read_into_device_memory_is_byte_exact(torch_cuda, tmp_path):
    torch = torch_cuda
    payload = np.random.default_rng(11).integers(0, 256, 64 * PAGE, dtype=np.uint8)
    path = tmp_path / "seg"
    path.write_bytes(payload.tobytes())
    fd = os.open(path, os.O_RDWR)
    e = await gds.open_gds_engine(16, probe_dir=str(tmp_path))
    try:
        dst = torch.empty(64 * PAGE, dtype=torch.uint8, device="cuda")
        base, _ = gds.cuda_buffer_address(dst)
        offs = [i * 8 * PAGE for i in range(8)]
        res = await e.read_many(fd, offs, [base + o for o in offs], [8 * PAGE] * 8)
        assert res.tolist() == [8 * PAGE] * 8
        assert np.array_equal(dst.cpu().numpy(), payload)
    finally:
        e.forget_fd(fd)
        e.close()
        os.close(fd)


@gpu
async def test_gpu_write_from_device_memory_round_trips(torch_cuda, tmp_path):
    torch = torch_cuda
    path = tmp_path / "seg"
    path.write_bytes(b"\0" * (32 * PAGE))
    fd = os.open(path, os.O_RDWR)
    e = await gds.open_gds_engine(16, probe_dir=str(tmp_path))
    try:
        src = torch.randint(0, 256, (32 * PAGE,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        base, n = gds.cuda_buffer_address(src)
        res = await e.write_many(fd, [0, 16 * PAGE], [base, base + 16 * PAGE], [16 * PAGE, 16 * PAGE])
        assert res.tolist() == [16 * PAGE] * 2
        await e.sync(fd)
        assert path.read_bytes() == src.cpu().numpy().tobytes()
        crcs = await gds.device_crc32c_many([base], [n])
        host = src.cpu().numpy()
        assert int(crcs[0]) == gds.host_crc32c(addr(host), n)
    finally:
        e.forget_fd(fd)
        e.close()
        os.close(fd)


@gpu
async def test_gpu_staged_read_matches_gds_read(torch_cuda, tmp_path):
    from umbp_nvme.engine import open_engine

    torch = torch_cuda
    payload = np.random.default_rng(12).integers(0, 256, 16 * PAGE, dtype=np.uint8)
    path = tmp_path / "seg"
    path.write_bytes(payload.tobytes())
    fd = os.open(path, os.O_RDWR)
    host = await open_engine("auto", 16)
    staging = gds.StagingBuffer(8 * PAGE)
    try:
        dst = torch.empty(16 * PAGE, dtype=torch.uint8, device="cuda")
        base, _ = gds.cuda_buffer_address(dst)
        res = await gds.staged_read(host, fd, [0, 8 * PAGE], [base, base + 8 * PAGE], [8 * PAGE] * 2, staging)
        assert res.tolist() == [8 * PAGE] * 2
        assert np.array_equal(dst.cpu().numpy(), payload)
    finally:
        staging.close()
        host.close()
        os.close(fd)
