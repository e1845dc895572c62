"""GPUDirect Storage (engine/gds/): routing, settings, paths and errors on CPU; real GPU tests skip.

The CPU tests run the engine against tests/support/fake_kvikio.py, a double of kvikio 26.10 built from the
real wheel's API: its "device" pointers are host memory, the rest (settings in kvikio's core,
per-file compat decision, futures that run at submit, the small-I/O POSIX shortcut, POSIX raising
at EOF while cuFile returns short, RuntimeError texts, whole-allocation memory_register, per-backend
counters) behaves as the real package does. The engine tests run twice: over the fake's own Python
layer ("fake") and over the real kvikio Python layer unpacked from a kvikio-cu12/-cu13 wheel with
its compiled modules stubbed by the same core ("real"; skipped, with the reason, when no wheel is at
hand: tools/fetch_kvikio_wheel.sh gets one). The ``test_gpu_*`` tests need a CUDA device, the
NVIDIA driver and kvikio, and skip with the reason otherwise (tools/gpu_check.sh runs them).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import inspect
import logging
import os
import threading
import types

import numpy as np
import pytest

from support import fake_kvikio as fk
from support.waits import until
from umbp_nvme.engine import gds
from umbp_nvme.engine.base import EngineClosed, EngineUnavailable, IoEngine

PAGE = 4096
NO_WHEEL = ("no kvikio-cu12/-cu13 wheel at hand (run tools/fetch_kvikio_wheel.sh, or set KVIKIO_WHEEL_DIR): "
            "the real kvikio Python layer cannot be loaded")


# ---------------------------------------------------------------- kvikio: the fake, or the real layer


@pytest.fixture(scope="session")
def real_layer_dir(tmp_path_factory):
    wheel = fk.find_kvikio_wheel()
    if wheel is None:
        return None
    return fk.extract_python_layer(wheel, str(tmp_path_factory.mktemp("kvikio-real")))


@pytest.fixture(params=["fake", "real"])
def kvi(request, real_layer_dir):
    """kvikio installed behind `import kvikio`: the fake's layer, or the real one over the fake core."""
    if request.param == "real":
        if real_layer_dir is None:
            pytest.skip(NO_WHEEL)
        inst = fk.install_real(real_layer_dir)
    else:
        inst = fk.install()
    yield inst
    inst.uninstall()


@pytest.fixture
def core(kvi):
    return kvi.core


@pytest.fixture
def kv(kvi):
    return gds._import_kvikio()  # the engine's own import, which must bring kvikio.defaults etc.


@pytest.fixture
def engine(kv):
    gds.configure_kvikio(kv, 8)  # 8 threads, 4 KiB threshold: page ops go through the pool
    e = gds.KvikioEngine(8, kvikio=kv)
    yield e
    e.close()


class HostDeviceOps:
    """'Device' memory that is host memory, for the probe/staging/CRC paths on CPU."""

    def __init__(self, core: fk.Core | None = None):
        self.core = core or fk.Core()
        self.copies = 0

    def alloc(self, nbytes):
        return self.core.alloc(nbytes)

    def allocation_base(self, addr):
        got = self.core.allocation_of(addr)
        return got[0] if got else None

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
    import torch  # in the test extra: a missing torch fails, never skips
    assert gds.cuda_buffer_address(torch.zeros(8)) is None


# ---------------------------------------------------------------- availability and the error


def test_gds_is_unavailable_here_with_a_reason():
    gds.reset_availability_cache()
    ok, reason = gds.gds_available()
    if ok:
        pytest.skip("this machine has CUDA and kvikio")
    assert reason and isinstance(reason, str)


def test_gds_available_is_cached(monkeypatch):
    calls = []
    monkeypatch.setattr(gds, "_check_libcuda", lambda: calls.append(1) or "libcuda.so.1 cannot be loaded")
    gds.reset_availability_cache()
    try:
        assert gds.gds_available() == (False, "libcuda.so.1 cannot be loaded")
        assert gds.gds_available()[0] is False
        assert len(calls) == 1
    finally:
        gds.reset_availability_cache()


def test_missing_kvikio_is_named_in_the_reason(monkeypatch):
    monkeypatch.setattr(gds, "_check_libcuda", lambda: None)
    monkeypatch.setattr(gds, "_check_torch_cuda", lambda: None)

    def no_kvikio():
        raise ImportError("No module named 'kvikio'")

    monkeypatch.setattr(gds, "_import_kvikio", no_kvikio)
    gds.reset_availability_cache()
    try:
        ok, reason = gds.gds_available()
        assert not ok and "kvikio" in reason and "install" in reason
    finally:
        gds.reset_availability_cache()


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
    made, closed = [], []
    real = gds.StagingBuffer

    def counted(n, **kw):
        buf = real(n, **kw)
        made.append(n)
        close = buf.close
        buf.close = lambda: closed.append(n) or close()
        return buf

    monkeypatch.setattr(gds, "StagingBuffer", counted)
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
    assert closed == [1 << 20]  # the gate released its buffer
    gate.close()  # idempotent, allocates nothing
    assert made == [1 << 20] and closed == [1 << 20]


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

    gates = []

    class StagingGate(gds.GdsGate):  # what gds_staging=True gives, without GPU I/O
        def __init__(self, **kw):
            super().__init__(**{**kw, "staging": True, "opener": unavailable})
            gates.append(self)

    made = []
    real = gds.StagingBuffer
    monkeypatch.setattr(gds, "StagingBuffer", lambda n, **kw: made.append(n) or real(n, **kw))
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps())
    monkeypatch.setattr(gds, "GdsGate", StagingGate)
    st = await PageStore.open(store_dir, small_config())
    try:
        src = make_payload("k", 5000)
        assert await st.put_many(["k"], [gds.CudaPointer(addr(src), src.nbytes)]) == [True]
        out = np.zeros_like(src)
        assert await st.get_many(["k"], [gds.CudaPointer(addr(out), out.nbytes)]) == [True]
        assert out.tobytes() == src.tobytes()
        (gate,) = gates
        assert gate.mode == "staging" and made == []  # the store uses its own bounce buffers
    finally:
        await st.close()


async def test_gate_staging_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(gds, "gds_available", lambda: (False, "no driver"))
    gate = gds.GdsGate(staging=True)
    with pytest.raises(EngineUnavailable, match="staging impossible too"):
        await gate.route()


# ---------------------------------------------------------------- the fake is the real API


def _public_api(mod, names=None):
    """name -> a comparable description (parameters, enum members, 'property') for the public
    callables of mod and their methods; with names, only those (absent ones map to None)."""
    import enum

    def describe(obj):
        if isinstance(obj, property):
            return "property"
        if inspect.isclass(obj) and issubclass(obj, enum.Enum):
            return ("enum", tuple((m.name, int(m.value)) for m in obj))
        if inspect.isclass(obj):
            return ("class", _params(obj.__init__) if "__init__" in vars(obj) else None)
        if callable(obj):
            return _params(obj)
        return None

    out = {}
    if names is None:
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") or describe(obj) is None:
                continue
            out[name] = describe(obj)
            if inspect.isclass(obj) and not issubclass(obj, __import__("enum").Enum):
                for mname, mobj in vars(obj).items():
                    if (not mname.startswith("_") or mname in ("__init__", "__enter__", "__exit__")) \
                            and describe(mobj) is not None:
                        out[f"{name}.{mname}"] = describe(mobj)
        return out
    for name in names:
        head, _, attr = name.partition(".")
        obj = getattr(mod, head, None)
        if attr:
            obj = vars(obj).get(attr) if inspect.isclass(obj) else None
        out[name] = None if obj is None else describe(obj)
    return out


def _params(fn):
    """(name, kind, default) per parameter: what a caller depends on (annotations left out)."""
    sig = inspect.signature(fn)
    return tuple((p.name, p.kind.name, repr(p.default) if p.default is not p.empty else "-")
                 for p in sig.parameters.values())


def _fake_public(name):
    return fk.build_public(fk.Core())[name]


def test_fake_signatures_equal_the_real_kvikio_python_api(real_layer_dir):
    """Every public name the fake defines exists in the real package with the same parameters."""
    if real_layer_dir is None:
        pytest.skip(NO_WHEEL)
    inst = fk.install_real(real_layer_dir)
    try:
        import importlib

        real = {m: importlib.import_module(m)
                for m in ("kvikio", "kvikio.cufile", "kvikio.defaults", "kvikio.cufile_driver")}
        compared = 0
        for modname, attrs in fk.build_public(inst.core).items():
            fake_mod = types.SimpleNamespace(**attrs)
            fake_api = _public_api(fake_mod)
            real_api = _public_api(real[modname], list(fake_api))
            for name, fake_sig in fake_api.items():
                if name in ("properties", "__version__"):
                    continue
                assert real_api[name] is not None, f"{modname}.{name}: the fake has it, the real kvikio does not"
                if isinstance(fake_sig, tuple) and fake_sig and fake_sig[0] == "class" and fake_sig[1] is None:
                    continue  # a class without its own __init__ (dataclass handled by its fields)
                assert fake_sig == real_api[name], f"{modname}.{name}: fake {fake_sig} != real {real_api[name]}"
                compared += 1
        # what the engine calls must be among them (so the comparison is not vacuous)
        for needed in ("CuFile.__init__", "CuFile.pread", "CuFile.pwrite", "CuFile.close", "CuFile.fileno",
                       "memory_register", "memory_deregister", "SummaryMonitor.get",
                       "CompatMode"):
            assert needed in _public_api(types.SimpleNamespace(**fk.build_public(inst.core)["kvikio"]))
        assert "IOFuture.get" in _public_api(types.SimpleNamespace(**fk.build_public(inst.core)["kvikio.cufile"]))
        assert compared >= 30
        # Summary's fields, in order (the engine reads by_backend from it)
        import dataclasses

        fake_summary = fk.build_public(inst.core)["kvikio"]["Summary"]
        assert [f.name for f in dataclasses.fields(fake_summary)] == \
            [f.name for f in dataclasses.fields(real["kvikio"].Summary)]
    finally:
        inst.uninstall()


def test_signature_comparison_catches_a_difference():
    """The comparison itself fails on a drifted signature (guards the test above)."""
    def pread(self, buf, size=None, file_offset=0, task_size=None): ...
    def drifted(self, buf, file_offset=0, size=None, task_size=None): ...
    assert _params(pread) != _params(drifted)
    assert _params(_fake_public("kvikio")["CuFile"].pread) == _params(pread)


def test_import_kvikio_alone_has_no_defaults_and_the_engine_imports_them(kvi):
    import importlib

    bare = importlib.import_module("kvikio")
    assert not hasattr(bare, "defaults") and not hasattr(bare, "cufile_driver")  # as the real __init__
    assert gds.kvikio_get(bare, "num_threads") is None  # what the old _import_kvikio left the engine with
    kv = gds._import_kvikio()
    assert kv is bare and kv.defaults.get("num_threads") == 1 and kv.cufile_driver.get("is_gds_available")


# ---------------------------------------------------------------- settings reach kvikio


@pytest.mark.parametrize("mode,enum_name,decision", [("off", "OFF", "cufile"), ("on", "ON", "posix"),
                                                     ("auto", "AUTO", "cufile")])
def test_each_setting_reaches_kvikio(kv, core, mode, enum_name, decision):
    assert gds.configure_kvikio(kv, 64, compat_mode=mode) == []
    assert core.settings["thread_pool_nthreads"] == 16 and core.pool_threads == 16
    assert core.settings["gds_threshold"] == PAGE
    assert core.settings["compat_mode"] == fk.CompatMode[enum_name]
    names = [n for n, _ in core.set_calls]
    assert {"thread_pool_nthreads", "gds_threshold", "compat_mode"} <= set(names)
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        d = e.describe()
        assert (d["num_threads"], d["gds_threshold"], d["compat_mode"], d["compat_decision"]) == \
            (16, PAGE, enum_name, decision)
        text = gds.describe_kvikio(kv)
        assert f"compat_mode={enum_name}" in text and "num_threads=16" in text and f"gds_threshold={PAGE}" in text
    finally:
        e.close()


def test_auto_without_usable_cufile_is_decided_posix(kv, core):
    core.cufile_available = False  # no libcufile or no readable /run/udev
    gds.configure_kvikio(kv, 8, compat_mode="auto")
    assert gds.kvikio_settings(kv)["compat_decision"] == "posix"
    assert gds.kvikio_gds_driver_available(kv) is False


def test_settings_kvikio_did_not_take_are_named(caplog):
    kv = types.SimpleNamespace(__version__="x")  # no defaults module: what `import kvikio` alone gives
    with caplog.at_level(logging.WARNING, logger=gds.__name__):
        failed = gds.configure_kvikio(kv, 64, compat_mode="off")
    assert failed == ["compat_mode", "num_threads", "gds_threshold"]
    assert any("did not take" in r.getMessage() for r in caplog.records)


def test_legacy_24x_accessors_are_used():
    s = {"compat_mode": True, "num_threads": 1, "gds_threshold": 1 << 20}
    kv = types.SimpleNamespace(defaults=types.SimpleNamespace(
        compat_mode=lambda: s["compat_mode"], get_num_threads=lambda: s["num_threads"],
        gds_threshold=lambda: s["gds_threshold"], compat_mode_reset=lambda v: s.__setitem__("compat_mode", v),
        num_threads_reset=lambda v: s.__setitem__("num_threads", v),
        gds_threshold_reset=lambda v: s.__setitem__("gds_threshold", v)))
    assert gds.configure_kvikio(kv, 64, compat_mode="off") == []
    assert s == {"compat_mode": False, "num_threads": 16, "gds_threshold": PAGE}


def test_kvikio_env_settings_are_respected(monkeypatch, kv, core):
    monkeypatch.setenv("KVIKIO_NTHREADS", "2")
    monkeypatch.setenv("KVIKIO_GDS_THRESHOLD", "65536")
    gds.configure_kvikio(kv, 64)
    assert core.settings["thread_pool_nthreads"] == 1 and core.settings["gds_threshold"] == 16 << 10
    assert core.set_calls == []


# ---------------------------------------------------------------- engine over kvikio


def test_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, IoEngine)
    assert engine.capabilities.name == "kvikio" and engine.capabilities.device_memory


def test_fake_futures_start_at_submit_and_small_ops_finish_inside_the_call(kv, core, tmp_path):
    """As kvikio's: pread() hands the op to the pool at once; under gds_threshold it is done already."""
    (tmp_path / "f").write_bytes(b"\x5a" * (32 << 10))
    f = kv.CuFile(str(tmp_path / "f"), "r")
    try:
        small, big = np.zeros(PAGE, np.uint8), np.zeros(32 << 10, np.uint8)
        fut = f.pread(gds.DeviceSpan(addr(small), PAGE), PAGE, 0)
        assert fut.done() and (small == 0x5A).all()  # before get(): the synchronous POSIX shortcut
        core.gate = threading.Event()
        fut = f.pread(gds.DeviceSpan(addr(big), big.nbytes), big.nbytes, 0)
        assert core.started.wait(30) and not fut.done()  # running in the pool, nobody called get()
        core.gate.set()
        assert fut.get() == big.nbytes and (big == 0x5A).all()
    finally:
        f.close()


async def test_read_many_is_byte_exact_across_extents(engine, data_file):
    fd, payload, _ = data_file
    offs = [0, 3 * PAGE, 8 * PAGE, 15 * PAGE]
    lens = [PAGE, 2 * PAGE, 5 * PAGE, PAGE]
    dst = [np.zeros(n, np.uint8) for n in lens]
    res = await engine.read_many(fd, offs, [addr(d) for d in dst], lens)
    assert res.dtype == np.int64 and res.tolist() == lens
    for d, o, n in zip(dst, offs, lens):
        assert d.tobytes() == payload[o : o + n]


async def test_cufile_is_opened_once_per_fd_through_proc_self_fd(engine, core, data_file):
    fd, _, _ = data_file
    buf = np.zeros(PAGE, np.uint8)
    for _ in range(3):
        await engine.read_many(fd, [0], [addr(buf)], [PAGE])
    assert len(core.opened) == 1
    assert core.opened[0].path == f"/proc/self/fd/{fd}" and core.opened[0].flags == "r+"
    assert core.opened[0].fd_direct >= 0  # kvikio's second, O_DIRECT descriptor
    assert engine.cached_fds() == [fd]


async def test_read_only_fd_opens_read_only_and_refuses_writes_before_kvikio(engine, core, tmp_path):
    p = tmp_path / "ro"
    p.write_bytes(b"x" * PAGE)
    fd = os.open(p, os.O_RDONLY)
    try:
        buf = np.zeros(PAGE, np.uint8)
        assert (await engine.read_many(fd, [0], [addr(buf)], [PAGE])).tolist() == [PAGE]
        assert core.opened[-1].flags == "r"
        # kvikio would say "Operation not permitted" for this EBADF: the engine answers it first
        assert (await engine.write_many(fd, [0], [addr(buf)], [PAGE])).tolist() == [-errno.EBADF]
        assert [c[0] for c in core.calls] == ["pread"]
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


@pytest.mark.parametrize("mode", ["off", "on"])  # cuFile returns short at EOF, kvikio's POSIX path raises
async def test_read_past_eof_is_short_and_beyond_eof_is_zero(kv, core, data_file, mode):
    gds.configure_kvikio(kv, 8, compat_mode=mode)
    engine = gds.KvikioEngine(8, kvikio=kv)
    try:
        fd, payload, _ = data_file
        a, b = np.zeros(2 * PAGE, np.uint8), np.zeros(PAGE, np.uint8)
        res = await engine.read_many(fd, [15 * PAGE, 40 * PAGE], [addr(a), addr(b)], [2 * PAGE, PAGE])
        assert res.tolist() == [PAGE, 0]
        assert a[:PAGE].tobytes() == payload[15 * PAGE :]
        assert [c[4] for c in core.calls] == (["GDS"] if mode == "off" else ["POSIX"])
    finally:
        engine.close()


async def test_posix_eof_raised_by_kvikio_is_a_short_count(engine, core, data_file):
    fd, _, _ = data_file
    core.fail_at[PAGE] = fk.fail("posix_io.hpp:173", "POSIX error on pread: EOF")  # the file shrank
    buf = np.zeros(2 * PAGE, np.uint8)
    assert (await engine.read_many(fd, [0, PAGE], [addr(buf), addr(buf) + PAGE], [PAGE, PAGE])).tolist() == [PAGE, 0]


async def test_one_failing_op_does_not_fail_the_batch(engine, core, data_file):
    fd, payload, _ = data_file
    core.fail_at[2 * PAGE] = fk.cufile_error("file_handle.cpp:301", "Input/output error")
    core.fail_at[4 * PAGE] = fk.system_error("posix_io.hpp:131", errno.ENOSPC)
    core.fail_at[6 * PAGE] = fk.cufile_error("file_handle.cpp:301", "internal error")
    bufs = [np.zeros(PAGE, np.uint8) for _ in range(4)]
    res = await engine.read_many(fd, [0, 2 * PAGE, 4 * PAGE, 6 * PAGE], [addr(b) for b in bufs], [PAGE] * 4)
    assert res.tolist() == [PAGE, -errno.EIO, -errno.ENOSPC, -errno.EIO]
    assert bufs[0].tobytes() == payload[:PAGE]


def test_errno_mapping_from_kvikio_messages():
    m = gds.errno_of
    assert m(fk.system_error("posix_io.hpp:131", errno.ENOSPC)) == errno.ENOSPC
    assert m(fk.system_error("file_utils.cpp:112", errno.ENOENT)) == errno.ENOENT
    assert m(fk.system_error("posix_io.hpp:131", errno.EBADF)) == errno.EBADF
    assert m(fk.cufile_error("x.cpp:1", os.strerror(errno.EINVAL))) == errno.EINVAL
    assert m(fk.cufile_error("x.cpp:1", "GPUDirect Storage not supported on current file")) == errno.EIO
    assert m(RuntimeError("cuFile internal error 5011")) == errno.EIO
    assert not any(isinstance(e, OSError) for e in (fk.system_error("a", errno.EIO), fk.fail("a", "b")))
    assert gds.is_kvikio_eof(fk.fail("posix_io.hpp:173", "POSIX error on pread: EOF"))


async def test_bad_fd_fails_only_its_ops(engine, data_file):
    fd, payload, _ = data_file
    bad = next(n for n in range(900, 1000) if not _is_open(n))  # a descriptor number nobody holds
    a, b = np.zeros(PAGE, np.uint8), np.zeros(PAGE, np.uint8)
    res = await engine.read_many([fd, bad], [0, 0], [addr(a), addr(b)], [PAGE, PAGE])
    assert res.tolist() == [PAGE, -errno.EBADF]
    assert a.tobytes() == payload[:PAGE]


async def test_reused_fd_number_gets_a_fresh_cufile(engine, core, data_file, tmp_path):
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
    assert len(core.opened) == 2 and core.opened[0].closed() and not core.opened[1].closed()


async def test_forget_fd_closes_the_cufile(engine, core, data_file):
    fd, _, _ = data_file
    buf = np.zeros(PAGE, np.uint8)
    await engine.read_many(fd, [0], [addr(buf)], [PAGE])
    engine.forget_fd(fd)
    assert core.opened[0].closed() and engine.cached_fds() == []


async def test_in_flight_ops_are_bounded_by_queue_depth(kv, core, data_file):
    fd, _, _ = data_file
    gds.configure_kvikio(kv, 4)
    e = gds.KvikioEngine(4, kvikio=kv)
    try:
        bufs = np.zeros((16, PAGE), np.uint8)
        res = await e.read_many(fd, [i * PAGE for i in range(16)], [addr(bufs) + i * PAGE for i in range(16)],
                                [PAGE] * 16)
        assert res.tolist() == [PAGE] * 16
        assert core.max_outstanding == 4  # several in flight, never more than queue_depth
    finally:
        e.close()


async def test_concurrent_batches_share_the_queue_depth(kv, core, data_file):
    fd, payload, _ = data_file
    gds.configure_kvikio(kv, 3)
    e = gds.KvikioEngine(3, kvikio=kv, max_batches=4)
    try:
        bufs = [np.zeros((16, PAGE), np.uint8) for _ in range(4)]
        offs = [i * PAGE for i in range(16)]
        results = await asyncio.gather(*(e.read_many(fd, offs, [addr(b) + i * PAGE for i in range(16)], [PAGE] * 16)
                                         for b in bufs))
        assert all(r.tolist() == [PAGE] * 16 for r in results)
        assert all(b.tobytes() == payload for b in bufs)
        assert core.max_outstanding <= 3
    finally:
        e.close()


async def test_short_transfer_is_retried_for_the_remainder(engine, core, data_file):
    fd, payload, _ = data_file
    core.short_once.add(2 * PAGE)
    buf = np.zeros(2 * PAGE, np.uint8)
    res = await engine.read_many(fd, [2 * PAGE], [addr(buf)], [2 * PAGE])
    assert res.tolist() == [2 * PAGE] and buf.tobytes() == payload[2 * PAGE : 4 * PAGE]


async def test_empty_batch_and_zero_length_ops_touch_nothing(engine, core, data_file):
    fd, _, _ = data_file
    assert (await engine.read_many(fd, [], [], [])).tolist() == []
    assert (await engine.read_many(fd, [0], [0], [0])).tolist() == [0]
    assert core.calls == []


async def test_close_fails_pending_awaits_and_later_calls(kv, core, data_file):
    fd, _, _ = data_file
    gds.configure_kvikio(kv, 4)
    core.gate = threading.Event()
    e = gds.KvikioEngine(4, kvikio=kv)
    buf = np.zeros(PAGE, np.uint8)
    task = asyncio.ensure_future(e.read_many(fd, [0], [addr(buf)], [PAGE]))
    assert await asyncio.to_thread(core.started.wait, 5)
    e.close()
    e.close()  # idempotent
    with pytest.raises(EngineClosed):
        await asyncio.wait_for(task, 30)
    with pytest.raises(EngineClosed):
        await e.read_many(fd, [0], [addr(buf)], [PAGE])
    core.gate.set()  # the op kvikio already had finishes; its CuFile is closed after it
    assert await until(lambda: core.opened[0].closed(), 30)  # a worker thread closes it: no speed bound


# ---------------------------------------------------------------- which path served the bytes


async def test_per_file_compat_fallback_is_reported_per_file(kv, core, tmp_path):
    """AUTO: one file's O_DIRECT open fails -> kvikio serves it by POSIX, the other by cuFile."""
    gds.configure_kvikio(kv, 8, compat_mode="auto")
    e = gds.KvikioEngine(8, kvikio=kv)
    fds = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).write_bytes(os.urandom(4 * PAGE))
            fds.append(os.open(tmp_path / name, os.O_RDWR))
        core.odirect_fails.add(f"/proc/self/fd/{fds[1]}")
        buf = np.zeros(4 * PAGE, np.uint8)
        for fd in fds:
            assert (await e.read_many(fd, [0], [addr(buf)], [4 * PAGE])).tolist() == [4 * PAGE]
        assert e.file_paths() == {fds[0]: "cufile", fds[1]: "posix"}
        st = e.stats()
        assert st["served"]["read"] == {"cufile": 4 * PAGE, "posix": 4 * PAGE, "unattributed": 0}
        assert e.path() == "mixed" and e.describe()["path"] == "mixed"
        assert gds.kvikio_settings(kv)["compat_decision"] == "cufile"  # the process-wide answer hides it
    finally:
        for fd in fds:
            e.forget_fd(fd)
            os.close(fd)
        e.close()


async def test_failed_cufile_registration_falls_back_in_auto_and_fails_in_off(kv, core, data_file):
    fd, _, _ = data_file
    core.register_fails.add(f"/proc/self/fd/{fd}")
    buf = np.zeros(PAGE, np.uint8)
    gds.configure_kvikio(kv, 8, compat_mode="auto")
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        assert (await e.read_many(fd, [0], [addr(buf)], [PAGE])).tolist() == [PAGE]
        assert e.file_paths() == {fd: "posix"} and e.path() == "posix"
    finally:
        e.close()
    gds.configure_kvikio(kv, 8, compat_mode="off")
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        assert (await e.read_many(fd, [0], [addr(buf)], [PAGE])).tolist() == [-errno.EIO]
    finally:
        e.close()


async def test_compat_on_marks_every_file_posix_without_measuring(kv, core, data_file):
    gds.configure_kvikio(kv, 8, compat_mode="on")
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        fd, _, _ = data_file
        assert e.path() == "posix"  # before any byte moved: the decision is process-wide and certain
        buf = np.zeros(PAGE, np.uint8)
        await e.write_many(fd, [0], [addr(buf)], [PAGE])
        assert e.file_paths() == {fd: "posix"}
        assert e.stats()["served"]["write"]["posix"] == PAGE and e.stats()["served"]["write"]["cufile"] == 0
    finally:
        e.close()


async def test_unconfigured_kvikio_serves_page_ops_by_posix(kv, core, data_file):
    """kvikio's own 16 KiB gds_threshold: a 4 KiB op takes the POSIX shortcut even on a cuFile file."""
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        fd, _, _ = data_file
        buf = np.zeros(PAGE, np.uint8)
        await e.read_many(fd, [0], [addr(buf)], [PAGE])
        assert [c[4] for c in core.calls] == ["POSIX"] and e.path() == "posix"
        gds.configure_kvikio(kv, 8)
        await e.read_many(fd, [0], [addr(buf)], [PAGE])
        assert [c[4] for c in core.calls] == ["POSIX", "GDS"] and e.file_paths() == {fd: "mixed"}
    finally:
        e.close()


async def test_overlapping_batches_are_not_attributed(kv, core, data_file):
    gds.configure_kvikio(kv, 4)
    e = gds.KvikioEngine(4, kvikio=kv, max_batches=4)
    try:
        fd, _, _ = data_file
        core.gate = threading.Event()
        bufs = [np.zeros(PAGE, np.uint8) for _ in range(2)]
        t1 = asyncio.ensure_future(e.read_many(fd, [0], [addr(bufs[0])], [PAGE]))
        assert await asyncio.to_thread(core.started.wait, 5)
        t2 = asyncio.ensure_future(e.read_many(fd, [PAGE], [addr(bufs[1])], [PAGE]))
        # t2's op reached kvikio while t1's is held: they overlap, whatever the machine's load
        assert await until(lambda: len(core.calls) == 2, 30)
        core.gate.set()
        await asyncio.gather(t1, t2)
        served = e.stats()["served"]["read"]
        assert served["unattributed"] >= PAGE and served["cufile"] + served["unattributed"] == 2 * PAGE
    finally:
        e.close()


# ---------------------------------------------------------------- buffer registration


def test_register_buffers_registers_each_allocation_once(monkeypatch, kv, core):
    ops = HostDeviceOps(core)
    monkeypatch.setattr(gds, "_device_ops", ops)
    gds.configure_kvikio(kv, 8, compat_mode="off")
    seg, base = ops.alloc(8 * PAGE)
    other, obase = ops.alloc(PAGE)
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        # two slices of one segment, and another allocation: two registrations, not three
        assert e.register_buffers([(base, 4 * PAGE), (base + 4 * PAGE, 4 * PAGE), (obase, PAGE)]) is True
        assert sorted(core.registered) == sorted([base, obase]) and e.registered_allocations() == sorted([base, obase])
        assert core.register_calls == [base, obase]  # the second slice never reached cuFile
        assert e.register_buffers([(base + PAGE, PAGE)]) is True  # already held: nothing new
        assert sorted(core.registered) == sorted([base, obase]) and len(core.register_calls) == 2
    finally:
        e.close()
    assert core.registered == []  # close deregisters each once


def test_register_buffers_without_base_lookup_tolerates_already_registered(monkeypatch, kv, core):
    ops = HostDeviceOps(core)
    monkeypatch.setattr(gds, "_device_ops", types.SimpleNamespace(alloc=ops.alloc))  # no allocation_base
    gds.configure_kvikio(kv, 8, compat_mode="off")
    seg, base = ops.alloc(8 * PAGE)
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        assert e.register_buffers([(base, 4 * PAGE), (base + 4 * PAGE, 4 * PAGE)]) is True
        assert core.registered == [base]
    finally:
        e.close()


def test_register_buffers_in_compat_mode_is_false(monkeypatch, kv, core):
    monkeypatch.setattr(gds, "_device_ops", HostDeviceOps(core))
    gds.configure_kvikio(kv, 8, compat_mode="on")
    seg, base = core.alloc(PAGE)
    e = gds.KvikioEngine(8, kvikio=kv)
    try:
        assert e.register_buffers([(base, PAGE)]) is False and core.registered == []
    finally:
        e.close()


# ---------------------------------------------------------------- open + probe with fakes


@pytest.fixture
def fake_cuda(monkeypatch, kvi):
    monkeypatch.setattr(gds, "gds_available", lambda: (True, "fake"))
    ops = HostDeviceOps(kvi.core)
    monkeypatch.setattr(gds, "_device_ops", ops)
    return ops


async def test_open_gds_engine_probes_one_page_through_cufile(fake_cuda, core, tmp_path):
    e = await gds.open_gds_engine(16, probe_dir=str(tmp_path))
    try:
        assert [(c[0], c[3], c[4]) for c in core.calls] == [("pread", gds.PROBE_BYTES, "GDS")]
        assert core.settings["thread_pool_nthreads"] == 16 and core.settings["gds_threshold"] == gds.PROBE_BYTES
        assert e.path() == "gds" and e.describe()["served"]["read"]["cufile"] == gds.PROBE_BYTES
        assert os.listdir(tmp_path) == []  # the probe file is gone
        assert e.cached_fds() == []  # and its CuFile dropped
    finally:
        e.close()


async def test_probe_served_by_posix_is_not_called_gds(fake_cuda, core, tmp_path, caplog):
    core.cufile_available = False  # AUTO -> POSIX for every file (no /run/udev, say)
    with caplog.at_level(logging.WARNING, logger=gds.__name__):
        e = await gds.open_gds_engine(16, probe_dir=str(tmp_path))
    try:
        assert e.path() == "posix" and e.describe()["compat_decision"] == "posix"
        assert any("not cuFile" in r.getMessage() for r in caplog.records)
    finally:
        e.close()


async def test_probe_on_a_store_file_reads_that_page(fake_cuda, core, data_file):
    fd, _, _ = data_file
    e = await gds.open_gds_engine(8, probe_fd=fd)
    e.close()
    assert core.calls[0][1] == f"/proc/self/fd/{fd}"


async def test_probe_mismatch_refuses_gds(fake_cuda, core, tmp_path):
    core.corrupt_at.add(0)
    with pytest.raises(EngineUnavailable, match="probe read failed.*differs from a host read"):
        await gds.open_gds_engine(8, probe_dir=str(tmp_path))


async def test_probe_error_refuses_gds(fake_cuda, core, tmp_path):
    core.fail_at[0] = fk.cufile_error("file_handle.cpp:301", "Input/output error")
    with pytest.raises(EngineUnavailable, match="probe read of 4096 bytes returned EIO"):
        await gds.open_gds_engine(8, probe_dir=str(tmp_path))


async def test_gate_opens_gds_once(fake_cuda, tmp_path):
    gate = gds.GdsGate(queue_depth=8, probe_dir=str(tmp_path))
    try:
        assert gate.describe() == {"mode": None, "reason": None}
        assert await gate.route() == "gds"
        first = gate.engine
        assert await gate.route() == "gds" and gate.engine is first
        d = gate.describe()
        assert (d["mode"], d["path"], d["num_threads"], d["gds_threshold"]) == ("gds", "gds", 8, PAGE)
    finally:
        gate.close()


# ---------------------------------------------------------------- staging and CRC on CPU


def test_crc32c_fallback_matches_the_standard_check_value():
    data = np.frombuffer(b"123456789", dtype=np.uint8).copy()
    assert gds.py_crc32c(addr(data), 9) == 0xE3069283
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
        assert wcrc[0] == gds.py_crc32c(addr(src), PAGE)
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
    assert wcrc.tolist() == [gds.py_crc32c(addr(a), a.nbytes) for a in src]
    disk = path.read_bytes()
    for o, a in zip(offs, src):
        end = o + a.nbytes
        assert disk[o:end] == a.tobytes()
        assert disk[end : gds.round_up(end)] == bytes(gds.round_up(end) - end)  # zeroed padding
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
    assert crcs.tolist() == [gds.py_crc32c(addr(src), PAGE), gds.py_crc32c(addr(src) + PAGE, 2 * PAGE)]


# ---------------------------------------------------------------- real GPU (skip without one)

_gpu_ok, _gpu_reason = gds.gds_available()
gpu = pytest.mark.skipif(not _gpu_ok, reason=f"needs a CUDA device with kvikio: {_gpu_reason}")


@pytest.fixture
def torch_cuda():
    import torch  # in the test extra: a missing torch fails, never skips
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
