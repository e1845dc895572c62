"""The C page walk (native/lmdbwalk.c) against the numpy one it replaced (index_check.walk_pages).

The bytes of index.lmdb are untrusted: both walks must give the same verdict (safe or not) and,
when safe, the same capture of the objects database, on real files and on files damaged at
random (zeroed pages, flipped bytes, scribbled page headers and node pointers, garbage pages).
A crash here is a crash of every process that opens a damaged store.
"""

from __future__ import annotations

import mmap
import os
import random
import struct

import lmdb
import numpy as np
import pytest

from umbp_nvme.store import index_check
from umbp_nvme.store.index import REC_BYTES

pytest.importorskip("umbp_nvme._lmdbwalk")


def _make_index(path: str, n: int, *, big: int = 0, deleted: int = 0) -> None:
    """An LMDB file shaped as the store's: an ``objects`` database of 48-byte records, a ``meta`` one,
    and a free list (from deletes); ``big`` values larger than a page (overflow runs)."""
    env = lmdb.open(path, subdir=False, max_dbs=4, map_size=1 << 28, lock=False)
    objs, meta = env.open_db(b"objects"), env.open_db(b"meta")
    rng = random.Random(n)
    with env.begin(write=True) as txn:
        for i in range(n):
            txn.put(f"k/{rng.getrandbits(64):016x}/{i}".encode(), os.urandom(REC_BYTES), db=objs)
        for i in range(big):
            txn.put(f"big/{i}".encode(), os.urandom(5000 + i), db=objs)
        txn.put(b"next_generation", struct.pack("<Q", 7), db=meta)
    if deleted:
        with env.begin(write=True) as txn:
            cur = txn.cursor(db=objs)
            small = [k for k in cur.iternext(values=False) if k.startswith(b"k/")]
            for i, k in enumerate(small):
                if i % 3 == 0 and i // 3 < deleted:
                    txn.delete(k, db=objs)
    env.close()


_meta = index_check.newest_meta
P_LEAF = 0x02  # LMDB's leaf page flag


SEED = 0x5EED_0F_0A_11_C0DE


def _both(buf: bytes):
    """(verdict, capture) of the numpy walk and of the C walk; the C walk's hashed capture (a
    writer's open: keys hashed, not copied) must agree with both, checked here every time."""
    psize, last_pg, roots = _meta(buf)
    last_pg = min(last_pg, len(buf) // psize - 1)
    mm = bytes(buf[: (last_pg + 1) * psize])
    cap_np, cap_c, cap_h = {}, {}, {"seed": SEED}
    why_np = index_check.walk_pages(np.frombuffer(mm, np.uint8), psize, last_pg, roots, cap_np)
    why_c = index_check.walk_pages_native(mm, psize, last_pg, roots, cap_c)
    why_h = index_check.walk_pages_native(mm, psize, last_pg, roots, cap_h)
    assert why_h == why_c
    assert ("objects" in cap_h) == ("objects" in cap_c)
    if "objects" in cap_c:
        _same_hashed(cap_c["objects"], cap_h["objects"], mm)
    return (why_np, cap_np), (why_c, cap_c)


def _same_hashed(packed, hashed, mm: bytes) -> None:
    """A hashed capture holds, per node, what the copied capture's keys give: KeyIndex's hash under
    the seed, length, CRC32C, record flag, order breaks; the same records; node_keys gives the keys."""
    from umbp_nvme._keyindex import hash_keys, unordered
    from umbp_nvme._lmdbwalk import node_keys
    from umbp_nvme._uring import crc32c

    klen, blob, is_rec, recs = packed
    tag, buf, psize, last_pg, hashes, lens, crcs, bits, recs_h, pages = hashed
    assert tag == "hashed" and buf is mm
    starts = np.concatenate([[0], np.cumsum(klen)]).astype(np.int64)
    keys = [bytes(blob[starts[i] : starts[i + 1]]) for i in range(len(klen))]
    assert bytes(hashes) == hash_keys(SEED, keys)
    assert np.frombuffer(lens, np.uint16).tolist() == klen.tolist()
    assert np.frombuffer(crcs, np.uint32).tolist() == [crc32c(k) for k in keys]
    b = np.frombuffer(bits, np.uint8)
    assert np.array_equal(b & 1, is_rec.astype(np.uint8))
    assert np.flatnonzero(b & 2).tolist() == list(unordered(bytes(blob), klen))
    assert bytes(recs_h) == bytes(recs)
    assert node_keys(buf, psize, last_pg, pages, np.arange(len(keys), dtype=np.int64).tobytes()) == keys


def _same_capture(a: dict, b: dict) -> None:
    assert ("objects" in a) == ("objects" in b)
    if "objects" in a:
        (kl1, k1, r1, v1), (kl2, k2, r2, v2) = a["objects"], b["objects"]
        assert np.array_equal(kl1, kl2) and bytes(k1) == bytes(k2)
        assert np.array_equal(r1, r2) and bytes(v1) == bytes(v2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("walk")
    out = []
    for n, big, deleted in ((0, 0, 0), (1, 0, 0), (3000, 0, 0), (2500, 3, 400)):
        p = str(d / f"ix-{n}-{big}-{deleted}.lmdb")
        _make_index(p, n, big=big, deleted=deleted)
        with open(p, "rb") as f:
            out.append(f.read())
    return out


def test_sound_files_walk_clean_with_the_same_capture(files):
    for buf in files:
        (w1, c1), (w2, c2) = _both(buf)
        assert w1 is None and w2 is None
        _same_capture(c1, c2)
    (_, c), _ = _both(files[2])
    klen, keys, is_rec, recs = c["objects"]
    assert len(klen) == 3000 and is_rec.all() and len(recs) == 3000 * REC_BYTES and len(keys) == int(klen.sum())
    assert len(set(hash_keys_of(c))) == 3000  # the hashes of the hashed capture were compared: they are real
    (_, c), _ = _both(files[3])
    assert int((~c["objects"][2]).sum()) == 3  # the overflow values are not records


def _damage(buf: bytes, rng: random.Random) -> bytes:
    b = bytearray(buf)
    psize = _meta(buf)[0]
    pages = len(b) // psize
    kind = rng.randrange(6)
    pg = rng.randrange(2, pages) if pages > 2 else 0
    at = pg * psize
    if kind == 0:  # a zeroed page
        b[at : at + psize] = bytes(psize)
    elif kind == 1:  # bytes flipped anywhere past the meta pages
        for _ in range(rng.randrange(1, 8)):
            i = rng.randrange(2 * psize, len(b)) if len(b) > 2 * psize else 0
            b[i] ^= 1 << rng.randrange(8)
    elif kind == 2:  # a page header scribbled (stamp kept: the checks behind it must hold)
        for i in range(8, 16):
            b[at + i] = rng.randrange(256)
    elif kind == 3:  # node pointers scribbled
        for i in range(16, min(psize, 16 + 2 * rng.randrange(1, 40)), 2):
            b[at + i : at + i + 2] = struct.pack("<H", rng.randrange(65536))
    elif kind == 4:  # a node's header scribbled where its pointer says
        lower = struct.unpack_from("<H", b, at + 12)[0]
        if 18 <= lower < psize:
            ptr = struct.unpack_from("<H", b, at + 16)[0]
            if ptr + 8 <= psize:
                b[at + ptr : at + ptr + 8] = os.urandom(8)
    else:  # a garbage page that keeps its stamp
        b[at : at + psize] = os.urandom(psize)
        b[at : at + 8] = struct.pack("<Q", pg)
    return bytes(b)


@pytest.mark.parametrize("seed", range(4))
def test_damaged_files_get_the_same_verdict_and_never_crash(files, seed):
    rng = random.Random(seed)
    damaged = 0
    for trial in range(150):
        buf = _damage(files[1 + trial % 3], rng)
        (w1, c1), (w2, c2) = _both(buf)
        assert (w1 is None) == (w2 is None), (trial, w1, w2)
        if w1 is None:
            _same_capture(c1, c2)
        else:
            damaged += 1
    assert damaged > 30  # the damage reached the walk's checks, not only bytes it never reads


def test_garbage_and_short_buffers_are_refused_not_read(files):
    psize, last_pg, roots = _meta(files[2])
    with pytest.raises(ValueError, match="does not hold pages"):
        index_check.walk_pages_native(files[2][: psize * last_pg], psize, last_pg, roots)
    rng = np.random.default_rng(5)
    for _ in range(50):
        junk = rng.integers(0, 256, 16 * 4096, dtype=np.uint8).tobytes()
        roots = ((int(rng.integers(0, 20)), int(rng.integers(0, 70))), (int(rng.integers(0, 20)), int(rng.integers(0, 70))))
        w1 = index_check.walk_pages(np.frombuffer(junk, np.uint8), 4096, 15, roots, None)
        w2 = index_check.walk_pages_native(junk, 4096, 15, roots, None)
        assert (w1 is None) == (w2 is None)


def test_check_index_file_uses_the_native_walk_and_refuses_a_zeroed_leaf(tmp_path):
    p = str(tmp_path / "ix.lmdb")
    _make_index(p, 3000)
    cap = {}
    index_check.check_index_file(p, capture=cap)
    assert len(cap["objects"][0]) == 3000
    with open(p, "rb") as f:
        buf = f.read()
    psize, last_pg, _ = _meta(buf)
    leaves = [pg for pg in range(2, last_pg + 1)
              if struct.unpack_from("<H", buf, pg * psize + 10)[0] & P_LEAF]  # fmt: skip
    with open(p, "r+b") as f:
        for leaf in leaves:  # free pages among them too: the reachable ones decide
            f.seek(leaf * psize)
            f.write(bytes(psize))
    with pytest.raises(index_check.IndexFileDamage, match="stamped as page 0"):
        index_check.check_index_file(p)


def hash_keys_of(c: dict) -> list[int]:
    from umbp_nvme._keyindex import hash_keys

    klen, blob, _, _ = c["objects"]
    starts = np.concatenate([[0], np.cumsum(klen)]).astype(np.int64)
    return np.frombuffer(hash_keys(SEED, [blob[starts[i] : starts[i + 1]] for i in range(len(klen))]), np.uint64).tolist()


def test_an_order_break_is_flagged_in_the_hashed_capture(files):
    """Two adjacent keys of a leaf swapped (their node pointers): the hashed capture flags the break
    where the copied capture's keys say it is, and the store's scan drops both sides of it."""
    from umbp_nvme.store.walked_keys import scan_capture

    buf = bytearray(files[2])
    psize, last_pg, roots = _meta(bytes(buf))
    leaf = next(pg for pg in range(2, last_pg + 1) if struct.unpack_from("<H", buf, pg * psize + 10)[0] & P_LEAF
                and struct.unpack_from("<H", buf, pg * psize + 12)[0] >= 16 + 2 * 3)  # fmt: skip
    at = leaf * psize + 16
    a, b = struct.unpack_from("<HH", buf, at)
    struct.pack_into("<HH", buf, at, b, a)
    (w1, c1), (w2, c2) = _both(bytes(buf))
    assert w1 is None and w2 is None
    cap = {"seed": SEED}
    mm = bytes(buf[: (last_pg + 1) * psize])
    assert index_check.walk_pages_native(mm, psize, last_pg, roots, cap) is None
    bits = np.frombuffer(cap["objects"][7], np.uint8)
    assert len(np.flatnonzero(bits & 2)) >= 1
    keys, recs, damage = scan_capture(cap, "ix")
    assert damage.startswith("2 keys out of order")  # the records are random bytes: some fail their key CRC too
    renamed = int(damage.split("; ")[1].split()[0]) if ";" in damage else 0
    kept = keys.key_bytes(np.arange(len(keys)))
    assert len(kept) == len(recs) == 3000 - 2 - renamed and kept == sorted(set(kept))


def test_node_keys_checks_what_it_reads(files):
    """node_keys reads the map as it is now: ordinals that do not increase or run past the nodes, a
    page list naming pages outside the file, and a leaf changed since the walk are ValueErrors."""
    from umbp_nvme._lmdbwalk import node_keys

    buf = files[2]
    psize, last_pg, roots = _meta(buf)
    cap = {"seed": SEED}
    assert index_check.walk_pages_native(buf, psize, last_pg, roots, cap) is None
    pages = cap["objects"][-1]
    ords = lambda *o: np.asarray(o, np.int64).tobytes()  # noqa: E731
    assert len(node_keys(buf, psize, last_pg, pages, ords(0, 5, 2999))) == 3
    for bad in (ords(5, 5), ords(7, 3), ords(3000), ords(-1)):
        with pytest.raises(ValueError):
            node_keys(buf, psize, last_pg, pages, bad)
    with pytest.raises(ValueError, match="outside the file"):
        node_keys(buf, psize, last_pg, np.asarray([last_pg + 1], np.uint64).tobytes(), ords(0))
    first = int(np.frombuffer(pages, np.uint64)[0])
    zeroed = bytearray(buf)
    zeroed[first * psize : (first + 1) * psize] = bytes(psize)
    with pytest.raises(ValueError, match="changed since the walk"):
        node_keys(bytes(zeroed), psize, last_pg, pages, ords(0))
    with pytest.raises(ValueError, match="bad arguments"):
        node_keys(buf[: psize * last_pg], psize, last_pg, pages, ords(0))


def test_a_followers_walk_of_one_tree_checks_records_in_place_and_stops_when_asked(files, tmp_path):
    """The objects tree alone from its root (a follower's snapshot): the same hashes, lengths, CRCs
    and order breaks as the whole file's walk, no records copied, bit 4 on each record that is not
    its key's (flags and key CRC read in place); a stop flag already set ends it: "stopped"."""
    from umbp_nvme._lmdbwalk import walk
    from umbp_nvme.store.index import FLAG_KEYCRC, REC_DTYPE

    check = (REC_DTYPE.fields["flags"][1], REC_DTYPE.fields["key_crc"][1], FLAG_KEYCRC)
    seen = []  # foreign and own records per file: the random records give both
    for i, buf in enumerate(files[1:]):
        p = str(tmp_path / f"f{i}.lmdb")
        with open(p, "wb") as f:
            f.write(buf)
        env = lmdb.open(p, subdir=False, readonly=True, lock=False, max_dbs=4)
        with env.begin() as txn:
            raw = txn.get(b"objects")
        env.close()
        depth, root = struct.unpack_from("<H", raw, 6)[0], struct.unpack_from("<Q", raw, 40)[0]
        psize, last_pg, roots = _meta(buf)
        full = {"seed": SEED}
        assert index_check.walk_pages_native(buf, psize, last_pg, roots, full) is None
        _, _, _, _, hashes, lens, crcs, bits, recs, _ = full["objects"]
        got = walk(buf, psize, last_pg, (1 << 64) - 1, 0, root, depth, None, SEED, True, check)
        assert got[1:4] == (hashes, lens, crcs) and got[5] == b""
        b_full, b_tree = np.frombuffer(bits, np.uint8), np.frombuffer(got[4], np.uint8)
        assert np.array_equal(b_tree & 3, b_full)
        r = np.frombuffer(recs, REC_DTYPE)
        at = np.flatnonzero(b_full & 1)
        foreign = ((r["flags"] & FLAG_KEYCRC) != 0) & (np.frombuffer(crcs, np.uint32)[at] != r["key_crc"])
        assert np.array_equal((b_tree[at] & 4) != 0, foreign)
        seen += [int(foreign.sum()), int((~foreign).sum())]
        assert not (b_tree[np.flatnonzero(~b_full & 1)] & 4).any()
        assert walk(buf, psize, last_pg, (1 << 64) - 1, 0, root, depth, None, SEED, True, check,
                    bytearray(b"\x01")) == "stopped"  # fmt: skip
    assert sum(seen[0::2]) > 100 and sum(seen[1::2]) > 100
    with pytest.raises(ValueError, match="outside a record"):
        walk(files[2], psize, last_pg, (1 << 64) - 1, 0, root, depth, None, SEED, True, (46, 0, 2))
    with pytest.raises(TypeError, match="bytearray"):
        walk(files[2], psize, last_pg, (1 << 64) - 1, 0, root, depth, None, SEED, True, None, b"\x01")
