"""Adversarial inputs the chaos report does not fuzz (tools/chaos_report.py lists what it does):
key containers that are not lists, duplicate keys in one batch, extra_config values whose size
breaks a parser or a later allocation, and close() while other threads are inside batch calls.
Each finding has a test here that failed before its fix; the rest guard what already held.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from support.backends import make_backend
from support.host_pool import HostPool, page_key
from umbp_nvme.config import load_config


@pytest.fixture
def backend(tmp_path):
    pool = HostPool(page_num=64)
    be = make_backend(str(tmp_path / "s"), pool)
    yield be, pool
    be.close()
    pool.close()


def _stored(be, pool, keys, first: int = 0) -> None:
    for p, k in enumerate(keys):
        pool.fill(first + p, k)
    assert be.batch_set_v1(keys, pool.indices(first, len(keys))) == [True] * len(keys)


# ---------------------------------------------------------------- keys that are not a list


@pytest.mark.parametrize("op", ["batch_get_v1", "batch_set_v1"])
def test_v1_calls_take_keys_of_any_iterable_and_never_raise_for_others(backend, op):
    be, pool = backend
    keys = [page_key(i) for i in range(4)]
    _stored(be, pool, keys)
    fn = getattr(be, op)
    pool.clear_pages(8, 4, 0xEE)
    assert fn((k for k in keys), pool.indices(8, 4)) == [True] * 4  # a generator: its keys
    if op == "batch_get_v1":
        assert all(pool.holds(8 + p, k) for p, k in enumerate(keys))
    for bad in (5, object(), 2.5):
        assert fn(bad, pool.indices(8, 4)) == []  # not iterable: no pages, no exception
    assert be.batch_exists(k for k in keys) == 4
    assert be.batch_exists(5) == 0


# ---------------------------------------------------------------- duplicates in one batch


def test_duplicate_keys_in_one_batch_set_once_and_get_into_every_slot(backend):
    be, pool = backend
    a, b = page_key(1), page_key(2)
    pool.fill(0, a)
    pool.fill(1, b)  # a second page under the same key a: the first one's bytes are kept
    assert be.batch_set_v1([a, a], pool.indices(0, 2)) == [True, True]
    pool.clear_pages(10, 3, 0xEE)
    assert be.batch_get_v1([a, a, a], pool.indices(10, 3)) == [True] * 3
    assert all(pool.holds(10 + p, a) for p in range(3))
    assert be.store_stats()["store"]["objects"] == 2  # one page (K and V)


# ---------------------------------------------------------------- extra_config sizes


@pytest.mark.parametrize("key", ["ssd_capacity_bytes", "ssd_queue_depth", "ssd_segment_size_bytes"])
def test_an_integer_string_too_long_to_parse_is_an_error_naming_the_key(key):
    with pytest.raises(ValueError, match=key):
        load_config({key: "9" * 5000}, env={})


def test_a_queue_depth_the_ring_cannot_take_is_refused_by_the_config():
    with pytest.raises(ValueError, match="ssd_queue_depth"):
        load_config({"ssd_queue_depth": 1 << 20}, env={})
    assert load_config({"ssd_queue_depth": 32768}, env={}).ssd_queue_depth == 32768


def test_a_capacity_of_more_segments_than_the_index_can_name_is_refused_by_the_config(tmp_path):
    """2**80 bytes in 1 MiB segments: the open tried to allocate per-segment arrays (MemoryError)."""
    with pytest.raises(ValueError, match="ssd_capacity_bytes"):
        load_config({"ssd_capacity_bytes": 1 << 80, "ssd_segment_size_bytes": 1 << 20}, env={})
    cfg = load_config({"ssd_capacity_bytes": 1 << 44, "ssd_segment_size_bytes": 1 << 20}, env={})
    assert cfg.ssd_capacity_bytes == 1 << 44


# ---------------------------------------------------------------- close() during batch calls


def test_close_while_threads_are_inside_batch_calls_never_raises_or_serves_wrong_bytes(tmp_path):
    pool = HostPool(page_num=128)
    be = make_backend(str(tmp_path / "s"), pool, mode="relaxed")
    preload = [page_key(i) for i in range(64)]
    for i in range(0, 64, 8):
        _stored(be, pool, preload[i : i + 8], 64)
    found: list = []
    stop = threading.Event()

    def setter():
        i = 0
        while not stop.is_set():
            ks = [page_key(1000 + i + j) for j in range(8)]
            for p, k in enumerate(ks):
                pool.fill(p, k)
            r = be.batch_set_v1(ks, pool.indices(0, 8))
            if not (isinstance(r, list) and len(r) == 8 and all(type(x) is bool for x in r)):
                found.append(("set", r))
            i += 8

    def getter(first: int):
        while not stop.is_set():
            ks = preload[first : first + 8]
            pool.clear_pages(first, 8, 0xEE)  # pages 16.. and 32..: each thread its own
            r = be.batch_get_v1(ks, pool.indices(first, 8))
            if not (isinstance(r, list) and len(r) == 8 and all(type(x) is bool for x in r)):
                found.append(("get", r))
                continue
            found.extend(("wrong", k) for p, (k, ok) in enumerate(zip(ks, r)) if ok and not pool.holds(first + p, k))
            if not isinstance(be.batch_exists(ks), int):
                found.append(("exists",))

    def guarded(fn, *args):
        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - any exception is the finding
                found.append(("raised", repr(e)))
        return run

    threads = [threading.Thread(target=guarded(*f)) for f in ((setter,), (getter, 16), (getter, 32))]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    be.close()
    assert time.monotonic() - t0 < 20
    time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert found == []
    assert be.batch_get_v1(preload[:2], pool.indices(16, 2)) == [False, False]  # after close: misses
    assert pool.guards_intact()
    pool.close()
    assert os.path.isdir(str(tmp_path / "s"))


# ---------------------------------------------------------------- overlapping destinations of one get


async def test_a_get_into_overlapping_buffers_never_drops_a_stored_entry(tmp_path):
    """Two objects read into one buffer fail the CRC there; the store reads them again into its own
    memory before it believes the copy is damaged, so nothing stored is lost for the caller's mistake."""
    from conftest import payload, small_config
    from umbp_nvme.store import PageStore

    st = await PageStore.open(str(tmp_path / "store"), small_config())
    keys = ["a_0_k", "b_0_k"]
    want = [payload(k, 16 << 10) for k in keys]
    assert await st.put_many(keys, want) == [True, True]
    shared = np.zeros(16 << 10, np.uint8)
    first = await st.get_many(keys, [shared, shared])  # the caller's mistake: either answer is fine ...
    assert any(bytes(shared) == bytes(w) for w in want) or first == [False, False]
    outs = [np.zeros(16 << 10, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    crc_errors = st.stats()["crc_errors"]
    await st.close()
    assert res == [True, True]  # ... but nothing stored may be lost for it
    assert [bytes(o) for o in outs] == [bytes(w) for w in want]
    assert crc_errors == 0  # the stored copies were never damaged


async def test_a_really_damaged_copy_is_still_dropped_after_the_second_read(tmp_path):
    """The re-read must not vouch for a copy whose bytes on disk are wrong."""
    import glob

    from conftest import payload, small_config
    from umbp_nvme.store import PageStore

    st = await PageStore.open(str(tmp_path / "store"), small_config())
    keys = ["a_0_k", "b_0_k"]
    want = [payload(k, 16 << 10) for k in keys]
    assert await st.put_many(keys, want) == [True, True]
    hits = 0
    for seg in glob.glob(str(tmp_path / "store" / "**" / "seg*"), recursive=True):
        with open(seg, "r+b") as f:
            data = f.read()
            at = data.find(bytes(want[0][:64]))
            if at >= 0:
                f.seek(at + 100)
                f.write(bytes([data[at + 100] ^ 0xFF]))
                hits += 1
    assert hits == 1
    outs = [np.zeros(16 << 10, np.uint8) for _ in keys]
    assert await st.get_many(keys, outs) == [False, True]
    assert await st.exists_many(keys) == [False, True]  # dropped: a miss from now on, never a wrong byte
    assert st.stats()["crc_errors"] == 1
    await st.close()


# ---------------------------------------------------------------- warm-up arguments


@pytest.fixture
def small_source(tmp_path):
    import asyncio

    from conftest import payload, small_config
    from umbp_nvme.store import PageStore

    async def fill():
        st = await PageStore.open(str(tmp_path / "src"), small_config())
        keys = [f"p{i}_0_k" for i in range(8)]
        assert await st.put_many(keys, [payload(k, 16 << 10) for k in keys]) == [True] * 8
        await st.close()

    asyncio.run(fill())
    return str(tmp_path / "src")


@pytest.mark.parametrize("args, says", [
    (["--batch-size", "99999999999999999999999t"], "--batch-size"),  # was an OverflowError traceback
    (["--batch-size", "100t"], "--batch-size"),  # was a bare "[Errno 12] Cannot allocate memory"
    (["--namespace", '"x"'], "--namespace"),  # was a TypeError traceback from the store's open
    (["--namespace", "[1]"], "--namespace"),
])  # fmt: skip
def test_warmup_arguments_out_of_range_are_errors_naming_them(tmp_path, small_source, args, says):
    import subprocess
    import sys

    from conftest import ROOT

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "umbp_nvme.cli", "warmup", "--store", str(tmp_path / "dst"), small_source,
                        *args], capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr[-800:]
    assert "Traceback" not in p.stderr and says in p.stderr, p.stderr[-800:]
    assert not os.path.exists(tmp_path / "dst" / "MANIFEST.json")  # refused before a store was made


# ---------------------------------------------------------------- extra_config's shape and the backend's own switches


@pytest.mark.parametrize("extra", ["x", 5, [("interface_v1", 1)], {1: 2}, {None: 1}])
def test_an_extra_config_that_is_not_an_object_of_named_keys_is_a_value_error(tmp_path, extra):
    """Were: ValueError 'dictionary update sequence ...', TypeError, AttributeError."""
    from support.backends import storage_config
    from umbp_nvme.sglang.backend import UMBPNvmeStore

    cfg = storage_config({})
    cfg.extra_config = extra
    with pytest.raises(ValueError, match="extra_config"):
        UMBPNvmeStore(cfg, {})


@pytest.mark.parametrize("key", ["interface_v1", "prometheus", "doctor_at_start"])
@pytest.mark.parametrize("value", ["maybe", [1], "2", 2.5])
def test_the_backends_own_switches_take_booleans_only(tmp_path, key, value):
    """Were read with bool(): [1] turned interface_v1 on, "maybe" turned it off, silently."""
    from support.backends import backend_extra, storage_config
    from umbp_nvme.sglang.backend import UMBPNvmeStore

    with pytest.raises(ValueError, match=key):
        UMBPNvmeStore(storage_config(backend_extra(str(tmp_path / "s"), **{key: value})), {})


@pytest.mark.parametrize("value, on", [(1, True), ("true", True), (" On ", True), (0, False), ("false", False),
                                       (False, False)])
def test_the_backends_switches_keep_their_boolean_spellings(tmp_path, value, on):
    from support.backends import backend_extra, storage_config
    from umbp_nvme.sglang.backend import UMBPNvmeStore

    be = UMBPNvmeStore(storage_config(backend_extra(str(tmp_path / "s"), interface_v1=value)), {})
    assert be.interface_v1 is on


# ---------------------------------------------------------------- registered memory the process cannot use

_PROTECTED_CHILD = r"""
import asyncio, ctypes, mmap, sys
import numpy as np
sys.path[:0] = [TESTS]
from conftest import payload, small_config
from umbp_nvme.store import PageStore

libc = ctypes.CDLL(None, use_errno=True)

async def main(root, prot, n):
    st = await PageStore.open(root, small_config())
    assert await st.put_many(["k"], [payload("k", n)]) == [True]
    mm = mmap.mmap(-1, 1 << 20)
    base = int(np.frombuffer(mm, np.uint8).ctypes.data)
    if prot == "unmapped":
        base = 1 << 40
    else:
        assert libc.mprotect(ctypes.c_void_p(base), ctypes.c_size_t(1 << 20), {"none": 0, "ro": 1}[prot]) == 0
    print("registered", st.register_memory(base, 1 << 20), st.registered_memory(), flush=True)
    print("get", await st.get_many(["k"], [(base, n)]), flush=True)  # was SIGSEGV (copy into it)
    print("put", await st.put_many(["k2"], [(base, n)]), flush=True)  # was SIGSEGV (CRC over it)
    out = np.zeros(n, np.uint8)
    print("still", await st.get_many(["k"], [out]), bool((out == payload("k", n)).all()), flush=True)
    await st.close()

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


@pytest.mark.parametrize("prot", ["none", "ro", "unmapped"])
def test_memory_the_process_cannot_read_and_write_is_not_registered_not_a_crash_later(tmp_path, prot):
    import subprocess
    import sys

    from conftest import ROOT

    code = _PROTECTED_CHILD.replace("TESTS", repr(os.path.join(ROOT, "tests")))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s"), prot, str(10000)], capture_output=True,
                       text=True, env=env, timeout=120)  # fmt: skip
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-1500:])
    assert "registered False []" in p.stdout and "register_memory(" in p.stderr and "not registered" in p.stderr
    assert "get [False]" in p.stdout and "put [False]" in p.stdout and "still [True] True" in p.stdout


async def test_without_memory_for_the_second_read_a_mismatch_is_a_miss_and_a_drop(tmp_path, monkeypatch):
    """No memory for the re-read: the get still answers (never raises), the unconfirmed copy is
    dropped as before the re-read existed, and nothing wrong is served."""
    from conftest import payload, small_config
    from umbp_nvme.store import PageStore, get_path

    def no_memory(nbytes):
        raise OSError(12, "Cannot allocate memory")

    st = await PageStore.open(str(tmp_path / "store"), small_config())
    keys = ["a_0_k", "b_0_k"]
    assert await st.put_many(keys, [payload(k, 16 << 10) for k in keys]) == [True, True]
    monkeypatch.setattr(get_path, "AlignedBuffer", no_memory)
    shared = np.zeros(16 << 10, np.uint8)
    res = await st.get_many(keys, [shared, shared])
    monkeypatch.undo()
    dropped = res.count(False)
    assert dropped >= 1 and st.stats()["crc_errors"] == dropped
    assert (await st.exists_many(keys)).count(False) == dropped
    await st.close()
