"""A follower's key set (follower_keys.py) kept on the index's change log (change_log.py).

The oracle is the objects database itself: after every step, for every key ever used, the set's
answer must equal whether LMDB holds a record of that key. Keys are put, deleted, put again, put
and deleted in one commit, cleared; the log is trimmed under a lagging follower, written past by
a writer that keeps no log, damaged; and the build's chunks are interleaved with commits.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import ROOT, key_set_ready, small_config
from umbp_nvme._uring import crc32c
from umbp_nvme.keybytes import encode_key
from umbp_nvme.store import PageStore
from umbp_nvme.store import change_log, follower_keys
from umbp_nvme.store.follower_keys import FollowerKeys
from umbp_nvme.store.index import FLAG_KEYCRC, INDEX_FILE, REC_DTYPE, Index, key_crcs

WAIT_S = 30.0  # a hang guard, never a speed bound


def rec_for(keys: list[bytes], version: int) -> list[bytes]:
    r = np.zeros(len(keys), REC_DTYPE)
    r["generation"], r["length"], r["flags"] = version, 100, FLAG_KEYCRC
    r["key_crc"] = key_crcs(keys)
    return [x.tobytes() for x in r]


class Watch:
    """follower.IndexWatch's read, on one handle."""

    def __init__(self, ix):
        self.ix = ix

    def read(self, fn, miss):
        return fn(self.ix)


class Hooked:
    """An Index whose read_log and page walk run ``hook`` first (a writer committing between a
    build's reads)."""

    def __init__(self, ix, hook):
        self._ix, self._hook, self.path = ix, hook, ix.path

    def read_log(self, fn):
        self._hook()
        return self._ix.read_log(fn)

    def walk_objects(self, seed: int, stop: bytearray):
        self._hook()
        return self._ix.walk_objects(seed, stop)


def truth(ix: Index, universe: list[bytes]) -> list[bool]:
    return [r is not None for r in ix.get_records(universe)]


def answers(fk: FollowerKeys, ix, universe: list[bytes]):
    got = fk.contains(ix, [k.decode() for k in universe])
    return None if got is None else got.tolist()


def ready(fk: FollowerKeys, ix, universe: list[bytes]) -> list[bool]:
    """The set's answers once it is built (the thread builds it on the first lookup)."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        got = answers(fk, ix, universe)
        if got is not None:
            return got
        time.sleep(0.005)
    raise AssertionError("the follower's key set was never built")


def built(ix, keys: list[bytes], first: int) -> FollowerKeys:
    """A follower set on ``ix`` once the first ``first`` keys are stored, checked built and right."""
    ix.commit(puts=list(zip(keys[:first], rec_for(keys[:first], 1))))
    fk = FollowerKeys(Watch(ix))
    try:
        assert ready(fk, ix, keys) == truth(ix, keys)
    except BaseException:
        fk.stop()
        raise
    return fk


@pytest.fixture
def ix(tmp_path):
    w = Index(f"{tmp_path}/{INDEX_FILE}", readonly=False, map_size=1 << 28, durable=False)
    yield w
    w.close()


def test_random_commits_keep_the_set_equal_to_the_objects_database(ix):
    rng = random.Random(7)
    universe = [f"k{i:03d}".encode() for i in range(300)] + ["é-ü".encode(), b"x" * 200]
    fk = FollowerKeys(Watch(ix))
    try:
        ix.commit(puts=list(zip(universe[:50], rec_for(universe[:50], 1))))
        assert ready(fk, ix, universe) == truth(ix, universe)
        for step in range(120):
            dels = rng.sample(universe, rng.randint(0, 20))
            puts = rng.sample(universe, rng.randint(0, 40))  # a key may be in both: deletes go first
            if step % 37 == 36:
                ix.drop_all(next_generation=step + 10)
            else:
                ix.commit(puts=sorted(zip(puts, rec_for(puts, step + 2))), deletes=dels)
            if step % 3 == 0:  # several commits between lookups, too
                assert answers(fk, ix, universe) == truth(ix, universe), step
        assert answers(fk, ix, universe) == truth(ix, universe)
        assert any(truth(ix, universe)) and not all(truth(ix, universe))
    finally:
        fk.stop()


def test_a_walked_build_leaves_out_records_not_their_keys_and_a_damaged_tree_turns_the_set_off(ix):
    """The build's page walk checks each record's key CRC in place: a record that is not its key's
    is not in the set (LMDB's lookups refuse it too). A leaf of the objects tree scribbled under the
    follower's handle: the walk refuses it, the set turns off and lookups go to LMDB."""
    keys = [f"w{i:04d}".encode() for i in range(600)]
    recs = rec_for(keys, 1)
    bad = set(range(0, 600, 7))
    recs = [r[:44] + struct.pack("<I", 0xDEAD) if i in bad else r for i, r in enumerate(recs)]  # key_crc at 44
    assert REC_DTYPE.fields["key_crc"][1] == 44
    ix.commit(puts=list(zip(keys, recs)))
    fk = FollowerKeys(Watch(ix))
    try:
        got = ready(fk, ix, keys)
        assert got == truth(ix, keys) and got.count(False) == len(bad)
    finally:
        fk.stop()
    with open(ix.path, "rb") as f:
        data = f.read()
    at = data.index(b"w0300")  # a key's bytes in its leaf
    page = at - at % 4096
    with open(ix.path, "r+b") as f:
        f.seek(page + 8)
        f.write(b"\xff" * 8)  # its header scribbled: flags and bounds
    fk = FollowerKeys(Watch(ix))
    try:
        end = time.monotonic() + WAIT_S
        while fk.state(ix) != "off" and time.monotonic() < end:
            assert answers(fk, ix, keys[:3]) is None
            time.sleep(0.005)
        assert fk.state(ix) == "off" and answers(fk, ix, keys[:3]) is None
    finally:
        fk.stop()


def test_a_walk_its_stop_flag_ends_builds_no_set_and_is_not_damage(ix, caplog):
    """close() sets the walk's stop flag (the C walk reads it without the GIL): a walk ended that way
    answers "stopped", and the build leaves no set, neither ready nor off."""
    keys = [f"s{i:03d}".encode() for i in range(50)]
    ix.commit(puts=list(zip(keys, rec_for(keys, 1))))
    walks = []

    class Closing(Hooked):
        def walk_objects(self, seed, stop):
            stop[0] = 1  # as close() does while the walk runs
            got = self._ix.walk_objects(seed, stop)
            walks.append(got[1])
            return got

    hooked = Closing(ix, lambda: None)
    fk = FollowerKeys(Watch(hooked))
    try:
        assert answers(fk, hooked, keys) is None
        end = time.monotonic() + WAIT_S
        while not walks and time.monotonic() < end:
            time.sleep(0.005)
        assert walks[:1] == ["stopped"]
        assert fk.state(hooked) == "building" and answers(fk, hooked, keys) is None
    finally:
        fk.stop()
    assert not [t for t in threading.enumerate() if t.name == "umbp-follower-keys"]
    assert "follower key set" not in caplog.text and "damaged" not in caplog.text  # no failure, no turning off


def test_a_follower_further_behind_than_the_log_keeps_rebuilds_and_never_answers_from_the_old_set(ix, monkeypatch):
    monkeypatch.setattr(change_log, "RETAIN", 4)
    monkeypatch.setattr(follower_keys, "POLL_S", 3600.0)  # only lookups move the set forward
    keys = [f"r{i}".encode() for i in range(40)]
    fk = built(ix, keys, 10)
    try:
        for i in range(10):  # 10 commits: 6 more than the log keeps
            ix.commit(puts=list(zip(keys[10 + i : 11 + i], rec_for(keys[10 + i : 11 + i], 2))), deletes=[keys[i]])
        assert answers(fk, ix, keys) is None  # the log does not reach back: LMDB answers meanwhile
        monkeypatch.setattr(follower_keys, "POLL_S", 0.01)
        fk.stop()
        fk = FollowerKeys(Watch(ix))
        assert ready(fk, ix, keys) == truth(ix, keys)
    finally:
        fk.stop()


@pytest.mark.parametrize("why", ["big", "unhashable"])
def test_a_commit_the_log_cannot_hold_restarts_it_and_the_follower_rebuilds(ix, monkeypatch, why):
    monkeypatch.setattr(change_log, "BIG", 5 if why == "big" else 1 << 16)
    monkeypatch.setattr(follower_keys, "POLL_S", 3600.0)
    keys = [f"b{i}".encode() for i in range(30)]
    fk = built(ix, keys, 5)
    try:
        if why == "big":  # 27 keys: no entry
            ix.commit(puts=list(zip(keys[5:], rec_for(keys[5:], 2))), deletes=keys[:2])
        else:  # a key LMDB takes that hash_keys has no bytes for (not bytes): no entry either
            ix.commit(puts=[(bytearray(keys[7]), rec_for([keys[7]], 2)[0])], deletes=keys[:2])
        assert ix.read_log(lambda txn, o, m, c: txn.stat(c)["entries"]) == 0
        assert answers(fk, ix, keys) is None
        monkeypatch.setattr(follower_keys, "POLL_S", 0.01)
        fk.stop()
        fk = FollowerKeys(Watch(ix))
        assert ready(fk, ix, keys) == truth(ix, keys)
        ix.commit(deletes=keys[10:12])  # small again: logged and replayed
        assert answers(fk, ix, keys) == truth(ix, keys) and not truth(ix, keys)[10]
    finally:
        fk.stop()


def test_a_commit_by_a_writer_that_keeps_no_log_drops_the_set_and_the_next_writer_restarts_the_log(tmp_path):
    ix = Index(f"{tmp_path}/{INDEX_FILE}", readonly=False, map_size=1 << 28, durable=False)
    keys = [f"n{i}".encode() for i in range(20)]
    fk = built(ix, keys, 10)
    try:
        # what an older version's commit does: objects only (another process: one environment per process)
        put = f"txn.put({keys[15]!r}, {rec_for([keys[15]], 3)[0]!r}, db=objs)"
        raw_commit(ix.path, f"{put}; txn.delete({keys[0]!r}, db=objs)")
        assert ix.get_records([keys[15]])[0] is not None
        assert answers(fk, ix, keys) is None  # the head is not this snapshot: the log says nothing of it
        ix.close()
        ix = Index(ix.path, readonly=False, map_size=1 << 28, durable=False)  # its open restarts the log
        fk.stop()
        fk = FollowerKeys(Watch(ix))
        assert ready(fk, ix, keys) == truth(ix, keys)
        ix.commit(deletes=[keys[15]])
        assert answers(fk, ix, keys) == truth(ix, keys)
        assert truth(ix, keys)[1] and not truth(ix, keys)[0] and not truth(ix, keys)[15]
        ix.close()
    finally:
        fk.stop()


def with_crc(v: bytes) -> bytes:
    return struct.pack("<I", crc32c(v[4:])) + v[4:]


def raw_commit(path: str, body: str) -> None:
    """One write transaction of raw LMDB calls in another process (``txn``, ``objs``, ``changes``)."""
    code = (f"import lmdb\nenv = lmdb.open({path!r}, subdir=False, max_dbs=4, map_size=1 << 28)\n"
            "with env.begin(write=True) as txn:\n"
            "    objs = env.open_db(b'objects', txn=txn); changes = env.open_db(b'changes', txn=txn)\n"
            "    meta = env.open_db(b'meta', txn=txn)\n"
            f"    {body}\n")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


def _damage_last_entry(ix: Index, how) -> None:
    def last(txn, o, m, c):
        cur = txn.cursor(db=c)
        assert cur.last()
        return cur.key(), cur.value()

    k, v = ix.read_log(last)  # damaged in place: the head stays this writer's last transaction
    raw_commit(ix.path, f"txn.put({k!r}, {how(v)!r}, db=changes); "
               "txn.put(b'changes_head', txn.id().to_bytes(8, 'little'), db=meta)")  # fmt: skip


@pytest.mark.parametrize(
    "how",
    [
        lambda v: v[:-1],  # short
        lambda v: v[:-8] + bytes(8),  # a hash of 0 with a stale CRC
        lambda v: v[:20] + bytes([v[20] ^ 1]) + v[21:],  # a flipped bit in a hash
        lambda v: struct.pack("<I", 0) + v[4:],  # the CRC
        lambda v: v + bytes(8),  # one hash more than the counts say
        lambda v: with_crc(v[:-8] + bytes(8)),  # a hash of 0, its CRC right
        lambda v: with_crc(v[:12] + bytes([v[12] | 2]) + v[13:]),  # a flag no version sets
    ],
    ids=["short", "zero-hash", "flipped-bit", "crc", "long", "zero-hash-crc-right", "unknown-flag"],
)
def test_a_damaged_log_entry_turns_the_set_off_and_lookups_read_the_index(ix, how, monkeypatch):
    monkeypatch.setattr(follower_keys, "POLL_S", 3600.0)
    keys = [f"d{i}".encode() for i in range(12)]
    fk = built(ix, keys, 6)
    try:
        ix.commit(puts=list(zip(keys[6:], rec_for(keys[6:], 2))), deletes=keys[:2])
        _damage_last_entry(ix, how)
        assert answers(fk, ix, keys) is None
        time.sleep(0.05)
        assert answers(fk, ix, keys) is None  # off for this file: never rebuilt from a damaged log
    finally:
        fk.stop()


@pytest.mark.parametrize(
    "record, value",
    [
        ("changes_head", "b'1234567'"),  # 7 bytes
        ("changes_floor", "(2**64 - 1).to_bytes(8, 'little')"),  # past every snapshot
        ("changes_seed", "b''"),
    ],
)
def test_a_damaged_log_record_in_meta_turns_the_set_off(ix, record, value, monkeypatch):
    monkeypatch.setattr(follower_keys, "POLL_S", 3600.0)
    keys = [f"m{i}".encode() for i in range(12)]
    fk = built(ix, keys, 6)
    try:
        ix.commit(deletes=keys[:2])
        head = "; txn.put(b'changes_head', txn.id().to_bytes(8, 'little'), db=meta)"  # damage in place
        stamp = "" if record == "changes_head" else head
        raw_commit(ix.path, f"txn.put({record.encode()!r}, {value}, db=meta){stamp}")
        assert answers(fk, ix, keys) is None
        assert fk.state(ix) == "off"
        assert truth(ix, keys) == [False, False] + [True] * 4 + [False] * 6  # what LMDB answers meanwhile
    finally:
        fk.stop()


@pytest.mark.parametrize("chunk", [1, 3, 64, "walk"])
def test_a_build_whose_chunks_interleave_with_commits_ends_equal_to_the_objects(ix, chunk, monkeypatch):
    """Commits land between the build's reads: its chunks from LMDB, or around its page walk (the
    start point, the walk, then the replay of the log), and the set ends equal to LMDB."""
    monkeypatch.setattr(follower_keys, "PAGE_WALK", chunk == "walk")
    chunk = 64 if chunk == "walk" else chunk
    monkeypatch.setattr(follower_keys, "CHUNK", chunk)
    rng = random.Random(chunk)
    universe = [f"c{i:03d}".encode() for i in range(60)]
    ix.commit(puts=list(zip(universe[::2], rec_for(universe[::2], 1))))
    lock = threading.Lock()
    n = [0]

    def commit_between():
        with lock:
            n[0] += 1
            if n[0] > 40:
                return
            dels, puts = rng.sample(universe, 4), sorted(rng.sample(universe, 4))
            ix.commit(puts=list(zip(puts, rec_for(puts, n[0] + 1))), deletes=dels)

    hooked = Hooked(ix, commit_between)
    fk = FollowerKeys(Watch(hooked))
    try:
        got = ready(fk, hooked, universe)
        assert n[0] >= (10 if chunk < 8 else 3)  # commits really landed between the build's reads
        assert got == truth(ix, universe)
    finally:
        fk.stop()


# --- a follower store beside a writer process: what SGLang's other ranks run ---------------------

WRITER = f"""
import asyncio, json, random, sys
sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
from conftest import payload, small_config
from umbp_nvme.store import PageStore

async def main(path, mode):
    st = await PageStore.open(path, small_config())
    if mode == "churn":  # random commits until killed, one line after each
        rng = random.Random(int(sys.argv[3]))
        keys = [f"churn-{{i:03d}}" for i in range(200)]
        while True:
            await st.delete_many(rng.sample(keys, 8))
            ks = rng.sample(keys, 16)
            assert all(await st.put_many(ks, [payload(repr(k), 512) for k in ks]))
            print("c", flush=True)
    for line in sys.stdin:
        step = json.loads(line)
        if step.get("clear"):
            await st.clear()
        await st.delete_many(step.get("delete", []))
        puts = step.get("put", [])
        assert all(await st.put_many(puts, [payload(repr(k), 512) for k in puts]))
        print("ok", flush=True)
    await st.close()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def writer(path: str, mode: str = "steps", seed: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, path, mode, str(seed)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def step(p: subprocess.Popen, **kw) -> None:
    p.stdin.write(json.dumps(kw) + "\n")
    p.stdin.flush()
    if p.stdout.readline().strip() != "ok":
        p.kill()
        raise AssertionError(f"writer step {kw} failed: {p.stderr.read()[-3000:]}")


def stored(st, keys: list[str]) -> list[bool]:
    """What LMDB holds (the follower's index read directly): the oracle."""
    return [r is not None for r in st.state.index.get_records([encode_key(k) for k in keys])]


async def test_a_follower_answers_exists_from_its_set_exactly_as_the_index_says(store_dir):
    keys = [f"page-{i:03d}" for i in range(110)] + [f"ключ-ü-{i}" for i in range(5)]
    keys += [f"\udcff-raw-{i}" for i in range(5)]  # a lone surrogate: stored through surrogateescape
    w = writer(store_dir)
    try:
        step(w, put=keys[:40])
        st = await PageStore.open(store_dir, small_config(), readonly=True)
        try:
            assert st.stats()["key_set"] == "building"
            assert await st.exists_prefix(keys) == 40  # LMDB answers while the set is built
            await key_set_ready(st)
            rng = random.Random(3)
            for i in range(25):
                kw = {"put": rng.sample(keys, 10), "delete": rng.sample(keys[:60], 5)}
                step(w, **kw, clear=i == 12)
                want = stored(st, keys)
                assert await st.exists_many(keys) == want, i
                assert await st.exists_prefix(keys) == (want + [False]).index(False), i
                assert st.stats()["key_set"] == "ready"
            assert 0 < sum(want) < len(keys)
            assert any(want[110:]) and not all(want[110:])  # the odd keys both ways
            odd = [None, b"page-001", "", "x" * 4096, 7, "page-001\udcff\udcfe"]  # never storable: no answer but False
            assert await st.exists_many(odd) == [False] * len(odd)
            assert await st.exists_prefix(odd) == 0
        finally:
            await st.close()
    finally:
        w.stdin.close()
        assert w.wait(60) == 0, w.stderr.read()[-3000:]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_writer_killed_in_its_commits_leaves_the_follower_set_equal_to_the_index(store_dir, seed):
    """SIGKILL at a random commit, then a new writer: its open keeps the log (the killed writer's last
    transaction was its head), and the follower's set follows both writers with no rebuild."""
    keys = [f"churn-{i:03d}" for i in range(200)]
    first = writer(store_dir)
    step(first, put=keys[:50])
    first.stdin.close()
    assert first.wait(60) == 0
    st = await PageStore.open(store_dir, small_config(), readonly=True)
    try:
        await key_set_ready(st)
        rng = random.Random(seed)
        for rnd in range(2):
            w = writer(store_dir, "churn", seed * 10 + rnd)
            for _ in range(rng.randint(3, 30)):
                assert w.stdout.readline().strip() == "c", w.stderr.read()[-3000:]
            w.kill()
            w.wait()
            assert await st.exists_many(keys) == stored(st, keys)
            assert st.stats()["key_set"] == "ready"
        w = writer(store_dir)  # a clean open after the kills: the log goes on
        step(w, put=keys[190:])
        assert await st.exists_many(keys) == stored(st, keys)
        assert st.stats()["key_set"] == "ready"
        assert st.stats()["key_set_builds"] == 1  # three writers, one log: never rebuilt
        w.stdin.close()
        assert w.wait(60) == 0
    finally:
        await st.close()


async def test_a_follower_closed_in_the_middle_of_its_build_stops_it_and_leaves_no_thread(store_dir, monkeypatch):
    monkeypatch.setattr(follower_keys, "CHUNK", 1)  # one key a read: the build is long enough to close in
    monkeypatch.setattr(follower_keys, "PAGE_WALK", False)  # the chunks from LMDB (the walk's stop: below)
    keys = [f"page-{i:03d}" for i in range(300)]
    w = writer(store_dir)
    step(w, put=keys)
    w.stdin.close()
    assert w.wait(60) == 0
    st = await PageStore.open(store_dir, small_config(), readonly=True)
    gate = threading.Event()
    real = follower_keys.read_chunk
    chunks = [0]

    def counted(*a):
        chunks[0] += 1
        if chunks[0] == 20:
            gate.set()
        return real(*a)

    monkeypatch.setattr(follower_keys, "read_chunk", counted)
    assert await st.exists_prefix(keys) == 300  # LMDB answers; the build starts
    assert await asyncio.to_thread(gate.wait, WAIT_S)
    await st.close()
    assert chunks[0] < 300  # stopped part way
    assert not [t for t in threading.enumerate() if t.name == "umbp-follower-keys"]
