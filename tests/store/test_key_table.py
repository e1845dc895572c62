"""The writer's key table (native/keyindex.c, store/keymap.py): a dict's answers without a Python
object per key, and a hash collision never answers another key's row or bytes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import KiB, payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store.keymap import KeyMap


@pytest.mark.parametrize("bits", [64, 2, 0])
def test_the_key_map_answers_as_a_dict_does_even_when_every_hash_collides(bits):
    m = KeyMap(seed=11)
    m.narrow_hash_for_tests(bits)  # 0 bits: every key has the same hash
    model: dict[str, int] = {}  # key -> row
    held: dict[int, str] = {}  # row -> its key, until the row is forgotten
    rnd = random.Random(bits)
    row = 0
    for _ in range(3000):
        k = f"key{rnd.randrange(400)}" + ("\udc80" if rnd.random() < 0.1 else "")
        op = rnd.random()
        if op < 0.5:
            m[k] = row
            model[k], held[row] = row, k
            row += 1
        elif op < 0.8:
            assert m.get(k) == model.get(k)
            if k in model:
                del m[k]
                del model[k]
            else:
                with pytest.raises(KeyError):
                    del m[k]
        elif held:
            r = rnd.choice(sorted(held))
            m.forget_row(r)
            k2 = held.pop(r)
            if model.get(k2) == r:
                del model[k2]
    assert len(m) == len(model)
    probe = [f"key{i}" for i in range(400)] + [f"key{i}\udc80" for i in range(400)] + ["never"]
    want = [model.get(k, -1) for k in probe]
    assert m.rows(probe).tolist() == want
    assert sorted(m) == sorted(model)
    for r, k in held.items():
        assert m.key_of(r) == k
    assert m.key_of(row + 5) is None


@pytest.mark.parametrize("bits", [64, 0])
def test_the_get_paths_one_pass_lookup_names_the_only_candidate_or_says_there_are_several(bits):
    m = KeyMap(seed=3)
    m.narrow_hash_for_tests(bits)
    m["a"] = 0
    m["b"] = 1
    got = m.candidates(["a", "b", "zz", 7], -1).tolist()
    # 0 bits: "a" and "b" (and "zz") share one hash: -2 for all of them; an int is never a key
    assert got == ([0, 1, -1, -1] if bits == 64 else [-2, -2, -2, -1])
    m.forget_row(1)
    assert m.candidates(["a", "b"], -1).tolist() == [0, 0 if bits == 0 else -1]  # one candidate left


def test_keys_that_are_not_storable_strs_are_misses_and_refused_on_insert():
    m = KeyMap()
    m["k"] = 0
    m["\udcc3"] = 1  # an escaped byte: a storable key
    assert m.rows(["k", b"k", 7, None, "", "\udcc3"]).tolist() == [0, -1, -1, -1, -1, 1]
    assert m.prefix(["k", "\udcc3", b"k", "k"]) == 2
    with pytest.raises(ValueError, match="byte form"):
        m.set_rows(["ok", "\udcc3\udca9"], np.array([2, 3]))  # would read back as "é": refused, all of it
    assert "ok" not in m and len(m) == 2
    with pytest.raises(ValueError):
        m.set_rows([""], np.array([2]))


async def test_colliding_keys_in_a_store_each_read_their_own_bytes(store_dir):
    st = await PageStore.open(store_dir, small_config())
    st.writer.keys.narrow_hash_for_tests(0)  # every key collides with every other
    keys = [f"c{i}" for i in range(20)]
    src = [payload(k, 8 * KiB) for k in keys]
    assert await st.put_many(keys, src) == [True] * 20
    outs = [bytearray(8 * KiB) for _ in keys]
    assert await st.get_many(keys, outs) == [True] * 20
    assert [bytes(o) for o in outs] == [bytes(s) for s in src]
    # exists answers from the hash alone (keymap.py): with every hash equal, an absent key is
    # reported (a false positive: its get misses); a real 63-bit hash makes that ~N / 2**63
    assert await st.exists_many(["c3", "c99", "c19"]) == [True, True, True]
    assert await st.delete_many(["c3", "c99"]) == [True, False]
    out = bytearray(8 * KiB)
    assert await st.get_many(["c3"], [out]) == [False]
    assert await st.get_many(["c99"], [out]) == [False]
    assert await st.get_many(["c4"], [out]) == [True] and bytes(out) == bytes(src[4])
    assert st.stats()["objects"] == 19
    await st.close()


async def test_the_table_holds_no_python_object_per_key(store_dir):
    st = await PageStore.open(store_dir, small_config())
    keys = [f"table-only-{i}" for i in range(500)]  # names no other test uses
    assert await st.put_many(keys, [payload(k, 4 * KiB) for k in keys]) == [True] * 500
    import gc

    big = [o for o in gc.get_objects() if type(o) in (dict, list) and len(o) >= 500 and o is not keys]
    mine = set(keys)
    assert not [o for o in big if mine <= {x for x in o if type(x) is str}], "a dict or list of every key"
    assert st.keys() == keys  # put order
    assert st.writer.keys.nbytes() < 500 * 40  # table and per-row hashes: no key bytes
    await st.close()


async def test_the_writers_open_reads_the_index_from_its_page_walk_as_a_scan_would(store_dir):
    import os

    from umbp_nvme.store.index import INDEX_FILE, Index
    from umbp_nvme.store.walked_keys import scan_capture

    st = await PageStore.open(store_dir, small_config())
    keys = [f"w{i:03d}" + ("\udcff" if i % 5 == 0 else "") for i in range(300)]
    src = [payload(f"p{i}", 4 * KiB) for i in range(300)]
    assert await st.put_many(keys, src) == [True] * 300
    await st.close()
    ipath = os.path.join(store_dir, INDEX_FILE)
    ix = Index(ipath, readonly=False, map_size=1 << 30, durable=False)
    walked_keys, walked = ix.scan_walked(scan_capture)
    scanned_keys, scanned = ix.scan()
    ix.close()
    assert type(walked_keys).__name__ == "HashedKeys"  # keys hashed in the walk, read from its map here
    assert [bytes(k).decode("utf-8", "surrogateescape") for k in walked_keys] == scanned_keys
    assert sorted(scanned_keys) == sorted(keys)
    assert walked.tobytes() == scanned.tobytes()
    st = await PageStore.open(store_dir, small_config())  # and a reopen finds every object by it
    outs = [bytearray(4 * KiB) for _ in keys]
    assert await st.get_many(keys, outs) == [True] * 300
    assert [bytes(o) for o in outs] == [bytes(x) for x in src]
    await st.close()


def test_a_map_loaded_with_a_few_keys_takes_more():
    from umbp_nvme.store.keymap import PackedKeys

    m = KeyMap()
    m.load(PackedKeys(np.array([1, 1], np.uint16), b"ab"))  # rows sized exactly: 2
    for i in range(2, 3000):  # each new row grows them (once hung here: a quarter of 2 is 0)
        m[f"k{i}"] = i
    assert len(m) == 3000 - 2 + 2 and m.get("a") == 0 and m.get("k2999") == 2999


def test_holds_and_mapped_refuse_an_out_buffer_of_the_wrong_size_or_read_only():
    from umbp_nvme._keyindex import KeyIndex
    t = KeyIndex(7)
    t.add([b"a", b"b"], np.array([0, 1], np.int64))
    rows = np.array([0, 1], np.int64)
    out = np.zeros(2, np.uint8)
    t.holds([b"a", b"x"], rows, out)
    assert out.tolist() == [1, 0]
    t.mapped(rows, out)
    assert out.tolist() == [1, 1]
    for bad in (np.zeros(3, np.uint8), np.zeros(1, np.uint8)):
        with pytest.raises(ValueError, match="out must be 2 bytes"):
            t.holds([b"a", b"b"], rows, bad)
        with pytest.raises(ValueError, match="out must be 2 bytes"):
            t.mapped(rows, bad)
    ro = np.zeros(2, np.uint8)
    ro.flags.writeable = False
    for call in (lambda: t.holds([b"a", b"b"], rows, ro), lambda: t.mapped(rows, ro), lambda: t.mapped(rows, b"xx")):
        with pytest.raises((BufferError, TypeError, ValueError)):
            call()
    t.mapped(rows, out)  # the rows' buffer was released on every failure: the table still answers
    assert out.tolist() == [1, 1]


@pytest.mark.parametrize("bits", [64, 3, 0])
def test_a_table_loaded_from_hashes_answers_as_one_loaded_from_keys(bits):
    """load_hashes (a writer's open from its hashed page walk) maps each row as load does from the
    key bytes: the same candidate rows for every key, stored or not, even when hashes collide."""
    from umbp_nvme._keyindex import KeyIndex, hash_keys

    keys = [f"h/{i}".encode() for i in range(2000)] + [b"x" * 300, "\u00e9t\u00e9".encode()]
    lens = np.array([len(k) for k in keys], np.uint16)
    a, b = KeyIndex(77), KeyIndex(5)
    a.narrow_hash_for_tests(bits)
    b.narrow_hash_for_tests(bits)
    a.load(lens, b"".join(keys))
    b.load_hashes(77, hash_keys(77, keys))  # the table takes the hashes' seed
    probes = [k.decode() for k in keys] + [f"h/{i}" for i in range(2000, 2100)] + ["ete", "nope"]
    for nth in (0, 1, -1):
        out_a, out_b = np.zeros(len(probes), np.int64), np.zeros(len(probes), np.int64)
        a.lookup(probes, out_a, nth)
        b.lookup(probes, out_b, nth)
        assert out_a.tolist() == out_b.tolist()
    assert len(b) == len(keys) and (bits or (out_b[: len(keys)] == -2).all())
    if bits == 64:
        assert out_b[: len(keys)].tolist() == list(range(len(keys))) and (out_b[len(keys) :] == -1).all()
    with pytest.raises(ValueError, match="empty table only"):
        b.load_hashes(77, hash_keys(77, keys))
    with pytest.raises(ValueError, match="top bit clear"):
        KeyIndex(1).load_hashes(77, np.array([1, 2], np.uint64).tobytes())
    with pytest.raises(ValueError, match="whole number"):
        KeyIndex(1).load_hashes(77, b"\x80" * 12)
