"""The follower's set of key hashes (native/hashset.c): a Python set's answers for 8 bytes a slot,
and the very hash the writer's KeyIndex gives a key (native/keyhash.h)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from umbp_nvme._keyindex import HashSet, KeyIndex, hash_keys

TOP = 1 << 63


def hashes(seed, keys):
    return np.frombuffer(hash_keys(seed, keys), dtype="<u8")


def raw(*values):
    return np.array(values, dtype=np.uint64)


def held(s, h):
    """Whether raw hash h is in s, leaving s holding what it did."""
    if s.discard(raw(h)):
        assert s.add(raw(h)) == 1
        return True
    return False


@pytest.mark.parametrize("seed", [0, 11, 2**64 - 1])
def test_random_operations_answer_as_a_python_set_does(seed):
    rnd = random.Random(seed)
    universe = [f"key{i}" for i in range(6000)] + ["é", "\udcff", "日本語", "a\udc80b", "x" * 33]
    s, model = HashSet(seed), set()
    sizes = set()
    for _ in range(400):
        op = rnd.random()
        batch = rnd.sample(universe, rnd.randrange(0, 200))
        if op < 0.55:
            assert s.add(hashes(seed, batch)) == len(set(batch) - model)
            model |= set(batch)
        elif op < 0.8:
            assert s.discard(hashes(seed, batch)) == len(set(batch) & model)
            model -= set(batch)
        elif op < 0.9:
            expect = next((i for i, k in enumerate(batch) if k not in model), len(batch))
            assert s.prefix(batch) == expect
            assert s.prefix(tuple(batch)) == expect
        else:
            out = np.full(len(batch), 7, np.uint8)
            assert s.contains(batch, out) == sum(k in model for k in batch)
            assert out.tolist() == [int(k in model) for k in batch]
        assert len(s) == len(model)
        sizes.add(s.nbytes())
    out = np.zeros(len(universe), np.uint8)
    s.contains(universe, out)
    assert out.tolist() == [int(k in model) for k in universe]
    assert len(sizes) >= 3  # it grew more than once on the way


def test_it_grows_past_several_resizes_and_keeps_every_hash():
    rnd = random.Random(5)
    s, model = HashSet(1), set()
    sizes = []
    while len(model) < 120_000:
        n = rnd.choice([1, 3, 50, 4000])
        batch = {TOP | rnd.getrandbits(63) for _ in range(n)}
        assert s.add(raw(*batch)) == len(batch - model)
        model |= batch
        if not sizes or sizes[-1] != s.nbytes():
            sizes.append(s.nbytes())
        assert len(s) <= 0.8 * s.nbytes() / 8
    assert len(sizes) >= 6 and sizes[0] == 1024 * 8
    everything = raw(*model)
    assert s.add(everything) == 0 and len(s) == len(model)  # every one is held: nothing new
    assert s.discard(everything) == len(model) and len(s) == 0
    assert s.discard(everything) == 0


def test_reserve_makes_room_without_a_rehash():
    s = HashSet(3)
    s.reserve(50_000)
    room = s.nbytes()
    assert room >= 50_000 * 8 / 0.7
    s.add(raw(*(TOP | i for i in range(1, 50_001))))
    assert s.nbytes() == room and len(s) == 50_000
    s.reserve(10)  # already big enough
    assert s.nbytes() == room
    with pytest.raises(ValueError):
        s.reserve(-1)


def test_a_large_table_made_while_other_threads_use_the_set_holds_everything():
    """A rehash to a table of 2**20 slots or more builds it without the GIL (its pages fault in there):
    adds, discards and lookups from other threads meanwhile all land, whatever interleaving."""
    import threading

    s = HashSet(5)
    s.add(raw(*(TOP | i for i in range(1, 1001))))
    model = set(range(1, 1001))
    stop = threading.Event()
    lock = threading.Lock()

    def churn(base):
        i = 0
        while not stop.is_set() or i < 2000:
            v = base + i % 5000
            with lock:  # the model and the set change together; the set's own calls need no lock
                if s.add(raw(TOP | v)):
                    model.add(v)
                if i % 3 == 0 and s.discard(raw(TOP | (v - 7))):
                    model.discard(v - 7)
            i += 1

    threads = [threading.Thread(target=churn, args=(b,)) for b in (10_000, 20_000)]
    for t in threads:
        t.start()
    for n in (1 << 20, 3 << 20, 4 << 20):  # each grows the table across the threads' calls
        s.reserve(n)
    stop.set()
    for t in threads:
        t.join()
    assert s.nbytes() >= (4 << 20) * 8 / 0.7 and len(s) == len(model)
    vals = np.array(sorted(model), np.uint64) | np.uint64(TOP)
    assert s.discard(vals) == len(model) and len(s) == 0  # every hash the model holds was held, and no other


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_backward_shift_deletion_keeps_clusters_whole(seed):
    """Hashes with one home make long clusters: at slot 0 ((1<<63)|i) and at the last slot
    (2**64-1-i), whose cluster wraps around into slot 0's; deleting from either must leave every
    other hash findable."""
    rnd = random.Random(seed)
    universe = [TOP | i for i in range(1, 300)] + [2**64 - 1 - i for i in range(300)]
    universe += [TOP | rnd.getrandbits(63) for _ in range(300)]
    s, model = HashSet(0), set()
    for _ in range(60):
        batch = rnd.sample(universe, rnd.randrange(1, 120))
        if rnd.random() < 0.6:
            assert s.add(raw(*batch)) == len(set(batch) - model)
            model |= set(batch)
        else:
            assert s.discard(raw(*batch)) == len(set(batch) & model)
            model -= set(batch)
        assert len(s) == len(model)
        for h in rnd.sample(universe, 80):
            assert held(s, h) == (h in model)
    for h in universe:
        assert held(s, h) == (h in model)
    assert s.discard(raw(*universe)) == len(model) and len(s) == 0


@pytest.mark.parametrize(
    "bad",
    [
        b"\x00" * 7,
        b"\xff" * 9,
        raw(TOP | 1, 5),  # top bit clear
        raw(TOP | 2, 0),  # 0 marks an empty slot: never a hash
        np.zeros(0, np.uint64).tobytes() + (1).to_bytes(8, "little"),
        np.array([1.5], np.float64),
        np.array([1, 2], np.uint32),
        raw(TOP | 0x81).astype(">u8"),  # byte-swapped: read natively, another hash (top bit set)
    ],
)
def test_a_bad_buffer_is_refused_and_changes_nothing(bad):
    s = HashSet(9)
    s.add(raw(TOP | 100))
    with pytest.raises(ValueError):
        s.add(bad)
    with pytest.raises(ValueError):
        s.discard(bad)
    assert len(s) == 1 and held(s, TOP | 100) and not held(s, TOP | 2) and not held(s, TOP | 1)


def test_buffers_of_every_accepted_kind():
    s = HashSet(9)
    s.add(raw(TOP | 1).view(np.int64))  # int64: the same bits
    s.add((TOP | 2).to_bytes(8, "little") + (TOP | 3).to_bytes(8, "little"))
    s.add(bytearray((TOP | 4).to_bytes(8, "little")))
    s.add(memoryview(b"\x00" + (TOP | 5).to_bytes(8, "little"))[1:])  # unaligned
    assert len(s) == 5 and s.add(b"") == 0
    with pytest.raises((ValueError, BufferError)):
        s.add(raw(TOP | 6, TOP | 7, TOP | 8)[::2])  # not contiguous
    for bad in (None, [TOP | 6], "abcdefgh"):
        with pytest.raises(TypeError):
            s.add(bad)
    assert len(s) == 5


def test_keys_with_no_byte_form_are_misses():
    s = HashSet(4)
    s.add(hashes(4, ["a", "b"]))
    s.add(hashes(4, [b"c"]))  # as the bytes key b"c"
    odd = ["", None, 1, b"a", b"c", type("S", (str,), {})("a"), "\ud800", "\udcc3\udca9"]
    for k in odd:
        assert s.prefix([k, "a"]) == 0
    out = np.ones(len(odd), np.uint8)
    assert s.contains(odd, out) == 0 and out.tolist() == [0] * len(odd)
    assert s.prefix(["a", "b", "", "a"]) == 2
    # no byte form: 0; "\udcc3\udca9" would encode as "é" does, so it has none either
    assert hashes(4, ["", None, 1, b"", "\ud800", "\udcc3\udca9"]).tolist() == [0] * 6
    assert s.prefix(["c"]) == 1  # the str key is the bytes key's hash


@pytest.mark.parametrize("key, data", [("é", "é".encode()), ("\udcff", b"\xff"), ("日本", "日本".encode()),
                                       ("a\udc80b", b"a\x80b"), ("abc", b"abc"), ("y" * 40, b"y" * 40)])
def test_str_keys_hash_as_their_bytes_do(key, data):
    h = hashes(21, [key])
    assert h[0] & TOP and h.tolist() == hashes(21, [data]).tolist()
    s = HashSet(21)
    assert s.prefix([key]) == 0
    assert s.add(h) == 1
    assert s.prefix([key]) == 1 and s.prefix((key, key)) == 2
    out = np.zeros(1, np.uint8)
    assert s.contains([key], out) == 1 and out[0] == 1


def test_seeds_give_different_hashes():
    keys = [f"k{i}" for i in range(100)]
    a, b = hashes(1, keys), hashes(2, keys)
    assert len(set(a.tolist())) == 100 and not set(a.tolist()) & set(b.tolist())
    assert HashSet(2**64 - 1).seed == 2**64 - 1 and HashSet(seed=5).seed == 5
    s = HashSet(1)
    s.add(a)
    assert s.prefix(keys) == 100 and HashSet(2).prefix(keys) == 0


@pytest.mark.parametrize("seed", [0, 77, 2**64 - 3])
def test_a_key_index_with_the_same_seed_agrees(seed):
    rnd = random.Random(seed)
    keys = [f"key{i}" for i in range(3000)] + ["é", "\udcff", "日本語"]
    stored = rnd.sample(keys, 1500)
    t = KeyIndex(seed)
    t.add(stored, np.arange(len(stored), dtype=np.int64))
    s = HashSet(seed)
    s.add(hashes(seed, stored))
    out = np.zeros(len(keys), np.uint8)
    s.contains(keys, out)
    assert out.tolist() == [int(t.first(k) >= 0) for k in keys] == [int(k in set(stored)) for k in keys]
    run = keys[:50]
    assert s.prefix(run) == t.prefix(run)


@pytest.mark.parametrize("bits", [3, 8, 12])
def test_the_key_index_hashes_each_key_as_hash_keys_does(bits):
    """KeyIndex narrowed to its hashes' low bits has as candidates for a key exactly the rows of
    the keys sharing those bits of hash_keys' hash: the two compute one hash."""
    keys = [f"k{i}" for i in range(200)] + ["é", "\udcff"]
    t = KeyIndex(13)
    t.narrow_hash_for_tests(bits)
    t.add(keys, np.arange(len(keys), dtype=np.int64))
    low = [h & ((1 << bits) - 1) for h in hashes(13, keys).tolist()]
    rows = [set() for _ in keys]
    out = np.zeros(len(keys), np.int64)
    for nth in range(len(keys)):
        if t.lookup(keys, out, nth) == 0:
            break
        for i, r in enumerate(out.tolist()):
            if r >= 0:
                rows[i].add(r)
    assert rows == [{j for j, w in enumerate(low) if w == v} for v in low]
    assert 1 < len(set(low)) < len(keys)


def test_argument_errors():
    s = HashSet(0)
    for bad in ({"a"}, "a", None, iter(["a"])):
        with pytest.raises(TypeError):
            s.prefix(bad)
        with pytest.raises(TypeError):
            s.contains(bad, np.zeros(1, np.uint8))
        with pytest.raises(TypeError):
            hash_keys(0, bad)
    for out in (np.zeros(2, np.uint8), np.zeros(0, np.uint8), np.zeros(1, np.uint16)):
        with pytest.raises(ValueError):
            s.contains(["a"], out)
    ro = np.zeros(1, np.uint8)
    ro.flags.writeable = False
    for out in (ro, b"\x00"):
        with pytest.raises((BufferError, TypeError, ValueError)):
            s.contains(["a"], out)
    assert s.contains(["a"], bytearray(1)) == 0 and s.contains([], bytearray()) == 0
    with pytest.raises(TypeError):
        HashSet()
    with pytest.raises(AttributeError):
        s.seed = 1


def test_clear_len_and_nbytes():
    s = HashSet(8)
    assert len(s) == 0 and s.nbytes() == 0 and s.prefix(["a"]) == 0 and s.discard(raw(TOP)) == 0
    s.add(hashes(8, ["a", "b", "a"]))
    assert len(s) == 2 and s.nbytes() == 1024 * 8
    s.clear()
    assert len(s) == 0 and s.prefix(["a"]) == 0
    s.add(hashes(8, ["b"]))
    assert len(s) == 1 and s.prefix(["b", "a"]) == 1
    s.__init__(9)  # again: empty, the new seed
    assert len(s) == 0 and s.seed == 9
