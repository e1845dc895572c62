"""Forced hash collisions through a real store (issue 36): the writer keeps only a hash per key,
so every hit is confirmed against the key on disk. With the hash narrowed to a few bits (the
test seam KeyMap.narrow_bits_for_tests, applied to every map opened meanwhile, reopens too),
get never serves another key's bytes, delete never removes another key, a put never overwrites
another key, and eviction deletes exactly the evicted keys' index entries."""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import KiB, MiB, payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store.index import FLAG_KEYCRC, INDEX_FILE, REC_DTYPE, Index, key_crcs
from umbp_nvme.store.keymap import KeyMap


@pytest.fixture
def narrow(request):
    KeyMap.narrow_bits_for_tests = getattr(request, "param", 2)  # 4 hash values for every key
    yield KeyMap.narrow_bits_for_tests
    KeyMap.narrow_bits_for_tests = None


def index_keys(store_dir: str) -> list[str]:
    ix = Index(os.path.join(store_dir, INDEX_FILE), readonly=True, map_size=1 << 30, durable=False)
    try:
        return sorted(ix.scan()[0])
    finally:
        ix.close()


async def read(st, keys, nbytes):
    outs = [np.full(nbytes, 0xAA, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    return res, outs


@pytest.mark.parametrize("narrow", [0, 2], indirect=True)
async def test_a_get_of_a_colliding_absent_key_misses(store_dir, narrow):
    st = await PageStore.open(store_dir, small_config())
    assert await st.put_many(["a"], [payload("a", 8 * KiB)]) == [True]
    res, outs = await read(st, ["b", "c", "d", "e", "a"], 8 * KiB)
    # a miss: the record of a's row names a, not them (the read runs beside the record's, so a
    # missed key's buffer may hold a's bytes, as get_many allows for any False)
    assert res == [False, False, False, False, True]
    assert bytes(outs[4]) == bytes(payload("a", 8 * KiB))
    assert st.generation_of("b") == -1 and st.generation_of("a") > 0
    assert st.stats()["objects"] == 1 and st.stats()["crc_errors"] == 0  # not taken for damage: nothing dropped
    await st.close()
    st = await PageStore.open(store_dir, small_config())  # reopened: a's record is read from its segment
    assert not st.writer.areas.loaded(int(st.writer.rows.seg[0]))
    res, outs = await read(st, ["b", "c", "d", "e", "a"], 8 * KiB)
    assert res == [False, False, False, False, True] and bytes(outs[4]) == bytes(payload("a", 8 * KiB))
    assert st.stats()["objects"] == 1
    await st.close()


async def test_a_put_of_a_colliding_key_keeps_the_other_keys_bytes(store_dir, narrow):
    st = await PageStore.open(store_dir, small_config())
    keys = [f"k{i}" for i in range(24)]  # 4 hash values: each shared by ~6 keys
    for k in keys:  # one by one: each put meets keys of its hash already stored
        assert await st.put_many([k], [payload(k, 4 * KiB)]) == [True]
    assert await st.put_many(keys[:5], [payload("other", 4 * KiB)] * 5) == [True] * 5  # re-puts keep the first bytes
    res, outs = await read(st, keys, 4 * KiB)
    assert res == [True] * 24
    assert [bytes(o) for o in outs] == [bytes(payload(k, 4 * KiB)) for k in keys]
    assert st.stats()["objects"] == 24 and len(st.keys()) == 24 and sorted(st.keys()) == sorted(keys)
    await st.close()


async def test_a_delete_of_a_colliding_key_removes_only_that_key(store_dir, narrow):
    st = await PageStore.open(store_dir, small_config())
    keys = [f"d{i}" for i in range(12)]
    assert await st.put_many(keys, [payload(k, 4 * KiB) for k in keys]) == [True] * 12
    assert await st.delete_many(["absent1", "absent2", "d3", "d7"]) == [False, False, True, True]
    res, outs = await read(st, keys, 4 * KiB)
    assert res == [k not in ("d3", "d7") for k in keys]
    assert all(bytes(o) == bytes(payload(k, 4 * KiB)) for o, k, ok in zip(outs, keys, res) if ok)
    await st.close()
    assert index_keys(store_dir) == sorted(k for k in keys if k not in ("d3", "d7"))
    st = await PageStore.open(store_dir, small_config())  # the reopen loads colliding hashes too
    res, outs = await read(st, keys + ["absent1"], 4 * KiB)
    assert res == [k not in ("d3", "d7") for k in keys] + [False]
    assert all(bytes(o) == bytes(payload(k, 4 * KiB)) for o, k, ok in zip(outs, keys, res) if ok)
    assert await st.delete_many(["d4"]) == [True]
    await st.close()
    assert "d4" not in index_keys(store_dir) and len(index_keys(store_dir)) == 9


async def test_eviction_deletes_the_evicted_keys_entries_and_no_other(store_dir, narrow):
    cfg = small_config(ssd_capacity_bytes=4 * MiB, ssd_segment_size_bytes=1 * MiB)
    st = await PageStore.open(store_dir, cfg)
    keys = [f"e{i}" for i in range(200)]  # ~12 MiB of 64 KiB objects through 4 MiB: most are evicted
    for lo in range(0, 100, 10):
        ks = keys[lo : lo + 10]
        assert await st.put_many(ks, [payload(k, 64 * KiB) for k in ks]) == [True] * 10
    await st.close()
    st = await PageStore.open(store_dir, cfg)  # evict rows loaded by a reopen: their keys come from the records
    for lo in range(100, 200, 10):
        ks = keys[lo : lo + 10]
        assert await st.put_many(ks, [payload(k, 64 * KiB) for k in ks]) == [True] * 10
    assert st.stats()["evictions"] >= 50  # this session: rows of the first (loaded at the reopen) went first
    held = sorted(st.keys())
    res, outs = await read(st, keys, 64 * KiB)
    assert sorted(k for k, ok in zip(keys, res) if ok) == held
    assert all(bytes(o) == bytes(payload(k, 64 * KiB)) for o, k, ok in zip(outs, keys, res) if ok)
    await st.close()
    assert index_keys(store_dir) == held  # every evicted key's entry gone, every kept one there


async def test_long_keys_beyond_a_records_inline_bytes_collide_safely(store_dir, narrow):
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=2 * MiB, ssd_segment_size_bytes=1 * MiB))
    keys = ["L" * 300 + str(i) for i in range(40)] + [f"s{i}" for i in range(40)]  # 300-byte keys: a record holds 208
    for lo in range(0, 80, 8):
        ks = keys[lo : lo + 8]
        assert await st.put_many(ks, [payload(k, 64 * KiB) for k in ks]) == [True] * 8
    held = set(st.keys())
    assert st.stats()["evictions"] > 0 and held <= set(keys)
    res, outs = await read(st, keys, 64 * KiB)
    assert {k for k, ok in zip(keys, res) if ok} == held
    assert all(bytes(o) == bytes(payload(k, 64 * KiB)) for o, k, ok in zip(outs, keys, res) if ok)
    await st.close()
    assert set(index_keys(store_dir)) == held


@pytest.mark.parametrize("narrow", [2], indirect=True)
async def test_after_a_reopen_the_records_are_read_beside_the_data_and_the_index_stands_in_for_a_failed_one(
    store_dir, narrow
):
    """A writer's records are not in memory after an open: a get reads the hits' record blocks as
    an engine batch of their own, started once the data's batch is in flight (the data's batch is
    never held up for them). Where a record block cannot be read, the index confirms the key
    instead: the same bytes, nothing taken for damage."""
    from support.faults import EngineHooks

    keys = [f"k{i}" for i in range(12)]  # 4 hash values: every key collides with others
    st = await PageStore.open(store_dir, small_config())
    assert await st.put_many(keys, [payload(k, 8 * KiB) for k in keys]) == [True] * 12
    await st.close()
    hooks = EngineHooks()
    batches: list[list[int]] = []
    fail_records = False

    async def hooked_read(real, fds, offs, addrs, lens):
        res = await real(fds, offs, addrs, lens)
        batches.append(np.asarray(lens).tolist())
        if fail_records:
            res = np.where(np.asarray(lens) == 4 * KiB, -5, res)  # the record blocks (data ops are 8 KiB)
        return res

    hooks.read = hooked_read
    st = await PageStore.open(store_dir, small_config(), engine_factory=hooks.engine_factory())
    res, outs = await read(st, keys + ["absent"], 8 * KiB)
    assert res == [True] * 12 + [False]
    assert all(bytes(o) == bytes(payload(k, 8 * KiB)) for k, o in zip(keys, outs))
    data_batches = [b for b in batches if 8 * KiB in b]
    assert len(data_batches) == 1 and 4 * KiB not in data_batches[0]
    assert [b for b in batches if b not in data_batches] == [[4 * KiB] * len(batches[-1])]  # the record blocks
    fail_records = True
    batches.clear()
    res, outs = await read(st, keys + ["absent"], 8 * KiB)
    assert any(4 * KiB in b for b in batches)  # the failed record reads were really asked for
    assert res == [True] * 12 + [False]
    assert all(bytes(o) == bytes(payload(k, 8 * KiB)) for k, o in zip(keys, outs))
    assert st.stats()["objects"] == 12 and st.stats()["crc_errors"] == 0
    await st.close()


def test_a_record_that_names_another_key_is_never_an_answer(tmp_path):
    # the index's key checksums, checked over a whole lookup at once: a record whose key_crc is
    # another key's (a key renamed on disk) is absent, and ends a prefix; a record from before key
    # checksums (no FLAG_KEYCRC) is taken as it is
    keys = [b"%064x_k" % i for i in range(6)]
    recs = np.zeros(6, REC_DTYPE)
    recs["generation"] = np.arange(6) + 1
    recs["flags"] = FLAG_KEYCRC
    recs["key_crc"] = key_crcs(keys)
    recs["key_crc"][3] = key_crcs([keys[4]])[0]
    recs["flags"][5], recs["key_crc"][5] = 0, 12345
    ix = Index(str(tmp_path / INDEX_FILE), readonly=False, map_size=1 << 30, durable=False)
    ix.commit([(k, recs[i].tobytes()) for i, k in enumerate(keys)])
    got = ix.get_records(keys + [b"absent"])
    assert got == [recs[i].tobytes() for i in range(3)] + [None, recs[4].tobytes(), recs[5].tobytes(), None]
    assert ix.exists_prefix(keys) == 3 and ix.exists_prefix(keys[4:]) == 2 and ix.exists_prefix(keys[:2]) == 2
    assert ix.exists_prefix([b"absent", *keys]) == 0
    ix.commit([(b"short", b"x" * 40)])  # a value that is no record among records: the check still sees key 3's
    assert ix.get_records([keys[3], b"short", keys[2]]) == [None, b"x" * 40, recs[2].tobytes()]
    assert ix.get_records([b"short"]) == [b"x" * 40]
    ix.close()
