"""PageStore behaviour, one rule per test: bytes and counts, not just return codes."""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import stat

import numpy as np
import pytest
import torch

from conftest import KiB, MiB, damage_object, payload, small_config
from support.faults import EngineHooks
from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.errors import NamespaceMismatchError, ReadOnlyStoreError, StoreLockedError, UnsafeStorePathError
from umbp_nvme.store import PageStore


async def open_store(path, **kw):
    ro = kw.pop("readonly", False)
    ns = kw.pop("namespace", None)
    factory = kw.pop("engine_factory", None)
    return await PageStore.open(path, small_config(**kw), readonly=ro, namespace=ns, engine_factory=factory)


async def test_put_get_roundtrip_every_buffer_kind(store_dir):
    st = await open_store(store_dir)
    n = 64 * KiB + 100  # not a multiple of the O_DIRECT block: goes through the bounce path
    src = {f"k{i}": payload(f"k{i}", n) for i in range(5)}
    assert await st.put_many(list(src), list(src.values())) == [True] * 5
    outs = [
        np.zeros(n, np.uint8),
        torch.zeros(n, dtype=torch.uint8),
        memoryview(bytearray(n)),
        mmap.mmap(-1, n),
        bytearray(n),
    ]
    assert await st.get_many(list(src), outs) == [True] * 5
    for out, want in zip(outs, src.values()):
        got = out.numpy() if isinstance(out, torch.Tensor) else np.frombuffer(out, np.uint8)
        assert bytes(got[:n]) == bytes(want)
    await st.close()


async def test_buffered_files_when_o_direct_is_off(store_dir):
    st = await open_store(store_dir, o_direct=False)
    keys = [f"b{i}" for i in range(4)]
    data = [payload(k, 3000 + i) for i, k in enumerate(keys)]
    assert await st.put_many(keys, data) == [True] * 4
    outs = [np.zeros(len(d), np.uint8) for d in data]
    assert await st.get_many(keys, outs) == [True] * 4
    assert [bytes(o) for o in outs] == [bytes(d) for d in data]
    assert st.stats()["o_direct"] is False
    await st.close()


async def test_aligned_memory_is_read_and_written_in_place(store_dir):
    st = await open_store(store_dir)
    with AlignedBuffer(4 * 64 * KiB) as src, AlignedBuffer(4 * 64 * KiB) as dst:
        src.array[:] = payload("aligned", src.nbytes)
        views = [src.array[i * 64 * KiB : (i + 1) * 64 * KiB] for i in range(4)]
        outs = [dst.array[i * 64 * KiB : (i + 1) * 64 * KiB] for i in range(4)]
        keys = [f"a{i}" for i in range(4)]
        assert await st.put_many(keys, views) == [True] * 4
        assert await st.get_many(keys, outs) == [True] * 4
        assert bytes(dst.array) == bytes(src.array)
    await st.close()


async def test_registered_address_pairs_and_unregistered_refused_untouched(store_dir, caplog):
    st = await open_store(store_dir)
    buf = AlignedBuffer(256 * KiB)
    buf.array[:] = payload("reg", buf.nbytes)
    st.register_memory(buf.address, buf.nbytes)
    keys = ["r0", "r1"]
    pairs = [(buf.address, 64 * KiB), (buf.address + 64 * KiB, 64 * KiB)]
    assert await st.put_many(keys, pairs) == [True, True]
    other = np.full(64 * KiB, 7, np.uint8)  # real memory, but never registered
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.store"):
        assert await st.get_many(["r0"], [(int(other.ctypes.data), other.nbytes)]) == [False]
        assert await st.put_many(["x"], [(int(other.ctypes.data), other.nbytes)]) == [False]
    assert (other == 7).all()
    assert sum("not inside a registered range" in r.getMessage() for r in caplog.records) == 2
    buf.array[: 128 * KiB] = 0
    assert await st.get_many(keys, [(buf.address + 128 * KiB, 64 * KiB), (buf.address, 64 * KiB)]) == [True, True]
    want = payload("reg", buf.nbytes)
    assert bytes(buf.array[128 * KiB : 192 * KiB]) == bytes(want[: 64 * KiB])
    assert bytes(buf.array[: 64 * KiB]) == bytes(want[64 * KiB : 128 * KiB])
    await st.close()
    buf.close()


async def test_reput_is_a_noop_that_keeps_the_first_bytes(store_dir):
    st = await open_store(store_dir)
    first, second = payload("a", 8 * KiB), payload("b", 8 * KiB)
    assert await st.put_many(["k"], [first]) == [True]
    assert await st.put_many(["k", "k"], [second, second]) == [True, True]
    out = np.zeros(8 * KiB, np.uint8)
    assert await st.get_many(["k"], [out]) == [True]
    assert bytes(out) == bytes(first)
    assert st.stats()["objects"] == 1 and st.stats()["put_dedup"] == 2
    await st.close()


async def test_duplicate_key_in_one_batch_writes_once(store_dir):
    st = await open_store(store_dir)
    a, b = payload("a", 4 * KiB), payload("b", 4 * KiB)
    assert await st.put_many(["d", "d"], [a, b]) == [True, True]
    out = np.zeros(4 * KiB, np.uint8)
    assert await st.get_many(["d"], [out]) == [True] and bytes(out) == bytes(a)
    assert st.stats()["bytes_used"] == 4 * KiB
    await st.close()


async def test_get_buffer_smaller_fails_larger_gets_prefix(store_dir, caplog):
    st = await open_store(store_dir)
    data = payload("k", 10 * KiB)
    await st.put_many(["k"], [data])
    small = np.full(10 * KiB - 1, 9, np.uint8)
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.store"):
        assert await st.get_many(["k"], [small]) == [False]
    assert (small == 9).all()
    assert any("smaller than" in r.getMessage() for r in caplog.records)
    big = np.full(20 * KiB, 9, np.uint8)
    assert await st.get_many(["k"], [big]) == [True]
    assert bytes(big[: 10 * KiB]) == bytes(data) and (big[10 * KiB :] == 9).all()
    await st.close()


async def test_get_of_missing_keys_is_false_and_counted(store_dir):
    st = await open_store(store_dir)
    await st.put_many(["here"], [payload("here", 4096)])
    outs = [np.zeros(4096, np.uint8) for _ in range(3)]
    assert await st.get_many(["nope", "here", "gone"], outs) == [False, True, False]
    s = st.stats()
    assert (s["hits"], s["misses"]) == (1, 2)
    await st.close()


async def test_exists_many_and_exists_prefix(store_dir):
    st = await open_store(store_dir)
    keys = [f"p{i}" for i in range(10)]
    await st.put_many(keys[:6] + keys[7:], [payload(k, 4096) for k in keys[:6] + keys[7:]])
    assert await st.exists_many(keys) == [True] * 6 + [False] + [True] * 3
    assert await st.exists_prefix(keys) == 6
    assert st.exists_prefix_nowait(keys[7:]) == 3
    assert await st.exists_prefix([]) == 0
    await st.close()


async def test_delete_is_durable_and_frees_space(store_dir):
    st = await open_store(store_dir)
    keys = [f"d{i}" for i in range(8)]
    await st.put_many(keys, [payload(k, 64 * KiB) for k in keys])
    used = st.stats()["bytes_used"]
    assert await st.delete_many(keys[:4] + ["missing"]) == [True] * 4 + [False]
    assert st.stats()["bytes_used"] == used - 4 * 64 * KiB
    await st.close()
    st = await open_store(store_dir)
    assert await st.exists_many(keys) == [False] * 4 + [True] * 4
    assert st.stats()["bytes_used"] == 4 * 64 * KiB
    await st.close()


async def test_crc_mismatch_is_a_miss_and_drops_the_entry(store_dir):
    st = await open_store(store_dir)
    data = payload("c", 8 * KiB)
    await st.put_many(["c", "ok"], [data, payload("ok", 8 * KiB)])
    await st.flush()
    damage_object(store_dir, st, "c", 100, b"\x00\xff\x00\xff")
    out = np.zeros(8 * KiB, np.uint8)
    assert await st.get_many(["c", "ok"], [out, np.zeros(8 * KiB, np.uint8)]) == [False, True]
    assert st.stats()["crc_errors"] == 1
    assert await st.exists_many(["c"]) == [False]
    await st.close()
    st = await open_store(store_dir)
    assert await st.exists_many(["c", "ok"]) == [False, True]
    await st.close()


async def test_restart_keeps_every_committed_object(store_dir):
    st = await open_store(store_dir, ssd_durability_mode="strict")
    sizes = [4096, 5000, 64 * KiB, 300 * KiB]
    keys = [f"s{i}-{n}" for i in range(6) for n in sizes]
    data = {k: payload(k, int(k.split("-")[1])) for k in keys}
    assert await st.put_many(keys, [data[k] for k in keys]) == [True] * len(keys)
    await st.close()
    st = await open_store(store_dir, ssd_durability_mode="strict")
    outs = [np.zeros(len(data[k]), np.uint8) for k in keys]
    assert await st.get_many(keys, outs) == [True] * len(keys)
    assert all(bytes(o) == bytes(data[k]) for o, k in zip(outs, keys))
    # the allocator was rebuilt: new puts never land on live slots
    more = [f"m{i}" for i in range(20)]
    assert await st.put_many(more, [payload(k, 5000) for k in more]) == [True] * 20
    outs = [np.zeros(len(data[k]), np.uint8) for k in keys]
    assert await st.get_many(keys, outs) == [True] * len(keys)
    assert all(bytes(o) == bytes(data[k]) for o, k in zip(outs, keys))
    await st.close()


async def test_object_larger_than_a_segment_refused_rest_of_batch_goes(store_dir, caplog):
    st = await open_store(store_dir)
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.store"):
        r = await st.put_many(["small", "huge", "small2"], [payload("s", 4096), np.zeros(2 * MiB, np.uint8), payload("t", 4096)])
    assert r == [True, False, True]
    assert sum("put_many" in rec.getMessage() for rec in caplog.records) == 1
    await st.close()


async def test_second_writer_is_refused_naming_the_pid(store_dir):
    st = await open_store(store_dir)
    with pytest.raises(StoreLockedError, match=rf"locked by pid {os.getpid()}.*read-only"):
        await open_store(store_dir)
    await st.close()
    st2 = await open_store(store_dir)  # the lock goes with close
    await st2.close()


async def test_namespace_mismatch_names_field_and_both_values(store_dir):
    ns = {"model": "llama-8b", "dtype": "bfloat16", "layout": "page_first", "object_bytes": {"kv": 65536}}
    st = await open_store(store_dir, namespace=ns)
    await st.close()
    with pytest.raises(NamespaceMismatchError, match=r"dtype='bfloat16'.*dtype='float16'"):
        await open_store(store_dir, namespace=dict(ns, dtype="float16"))
    with pytest.raises(NamespaceMismatchError, match=r"object_bytes"):
        await open_store(store_dir, namespace=dict(ns, object_bytes={"kv": 131072}))
    st = await open_store(store_dir, namespace=ns)
    await st.close()
    st = await open_store(store_dir)  # no declaration: no check
    await st.close()


async def test_readonly_refuses_mutations(store_dir):
    st = await open_store(store_dir)
    await st.put_many(["k"], [payload("k", 4096)])
    ro = await open_store(store_dir, readonly=True)
    with pytest.raises(ReadOnlyStoreError):
        await ro.put_many(["x"], [payload("x", 4096)])
    with pytest.raises(ReadOnlyStoreError):
        await ro.delete_many(["k"])
    out = np.zeros(4096, np.uint8)
    assert await ro.get_many(["k"], [out]) == [True] and bytes(out) == bytes(payload("k", 4096))
    await ro.close()
    await st.close()


async def test_directory_and_files_are_private(store_dir):
    st = await open_store(store_dir)
    await st.put_many(["k"], [payload("k", 4096)])
    await st.close()
    assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
    for name in os.listdir(store_dir):
        assert stat.S_IMODE(os.stat(os.path.join(store_dir, name)).st_mode) & 0o077 == 0, name


async def test_symlinked_or_foreign_directory_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeStorePathError, match="symlink"):
        await open_store(str(link))
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, 12345, 12345)
        with pytest.raises(UnsafeStorePathError, match="uid 12345"):
            await open_store(str(foreign))


async def test_clear_drops_everything_durably(store_dir):
    st = await open_store(store_dir)
    keys = [f"c{i}" for i in range(10)]
    await st.put_many(keys, [payload(k, 8 * KiB) for k in keys])
    await st.clear()
    assert st.stats()["objects"] == 0 and st.stats()["bytes_used"] == 0
    assert await st.put_many(["after"], [payload("after", 4096)]) == [True]
    await st.close()
    st = await open_store(store_dir)
    assert await st.exists_many(keys + ["after"]) == [False] * 10 + [True]
    await st.close()


async def test_stats_report_usage_and_counters(store_dir):
    st = await open_store(store_dir)
    await st.put_many(["a", "b"], [payload("a", 64 * KiB), payload("b", 5000)])
    s = st.stats()
    for field in ("capacity_bytes", "bytes_used", "objects", "hits", "misses", "evictions", "puts",
                  "bytes_read", "bytes_written", "size_classes", "high_watermark", "low_watermark",
                  "o_direct", "engine"):
        assert field in s, field
    assert s["objects"] == 2 and s["puts"] == 2 and s["bytes_written"] == 64 * KiB + 5000
    assert s["size_classes"] == {64 * KiB: 1, 8 * KiB: 1}
    await st.close()


async def test_close_is_idempotent_and_calls_after_close_fail_softly(store_dir):
    st = await open_store(store_dir)
    await st.close()
    await st.close()
    assert await st.put_many(["k"], [payload("k", 4096)]) == [False]
    assert await st.get_many(["k"], [np.zeros(4096, np.uint8)]) == [False]


async def test_verify_crc_off_still_reads(store_dir):
    st = await open_store(store_dir, verify_crc=False)
    await st.put_many(["k"], [payload("k", 12345)])
    out = np.zeros(12345, np.uint8)
    assert await st.get_many(["k"], [out]) == [True] and bytes(out) == bytes(payload("k", 12345))
    await st.close()


async def _never(real, *a):
    """I/O that never completes (until cancelled)."""
    await asyncio.Event().wait()


async def test_stuck_disk_becomes_false_within_io_timeout(store_dir):
    hooks = EngineHooks()
    st = await open_store(store_dir, io_timeout_s=0.3, engine_factory=hooks.engine_factory())
    await st.put_many(["k"], [payload("k", 4096)])
    hooks.read = hooks.write = hooks.sync = _never
    t = asyncio.get_running_loop().time()
    assert await st.get_many(["k"], [np.zeros(4096, np.uint8)]) == [False]
    assert await st.put_many(["x"], [payload("x", 4096)]) == [False]
    assert asyncio.get_running_loop().time() - t < 30  # a hang guard; the two timeouts counted are the proof
    assert st.stats()["timeouts"] == 2
    await st.close()


async def test_concurrent_puts_and_gets_return_exact_bytes(store_dir):
    st = await open_store(store_dir, ssd_capacity_bytes=64 * MiB)
    sizes = [4096, 9000, 64 * KiB]

    async def worker(w):
        keys = [f"w{w}-{i}" for i in range(12)]
        data = [payload(k, sizes[i % 3]) for i, k in enumerate(keys)]
        for lo in range(0, 12, 4):
            assert await st.put_many(keys[lo : lo + 4], data[lo : lo + 4]) == [True] * 4
            outs = [np.zeros(len(d), np.uint8) for d in data[: lo + 4]]
            assert await st.get_many(keys[: lo + 4], outs) == [True] * (lo + 4)
            assert all(bytes(o) == bytes(d) for o, d in zip(outs, data))

    await asyncio.gather(*(worker(w) for w in range(16)))
    assert st.stats()["objects"] == 16 * 12
    await st.close()


async def test_reads_are_not_starved_by_writes(store_dir):
    st = await open_store(store_dir, ssd_capacity_bytes=512 * MiB, ssd_segment_size_bytes=64 * MiB)
    await st.put_many(["hot"], [payload("hot", 64 * KiB)])
    big = np.zeros(4 * MiB, np.uint8)
    puts = [asyncio.ensure_future(st.put_many([f"b{j}-{i}" for i in range(8)], [big] * 8)) for j in range(10)]
    await asyncio.sleep(0)
    out = np.zeros(64 * KiB, np.uint8)
    assert await st.get_many(["hot"], [out]) == [True]
    pending = sum(not p.done() for p in puts)
    assert pending > 0, "the read waited for every queued write batch"
    assert all(r == [True] * 8 for r in await asyncio.gather(*puts))
    await st.close()
