"""native put_records and place_records (native/uring_records.c): the same bytes as the numpy records, and bad
input refused whole."""

import numpy as np
import pytest

from umbp_nvme._uring import area_images, place_records, put_records
from umbp_nvme.store.index import FLAG_CRC, FLAG_KEYCRC, REC_DTYPE, key_crcs
from umbp_nvme.store.records import (
    KEY_INLINE, R_CONFIRMED, R_KEY_TRUNC, R_VALID, RECORD_DTYPE, batch_records, confirmed_copy, make_records,
    record_crcs,
)  # fmt: skip


def _batch(n, seed=3):
    rng = np.random.default_rng(seed)
    lens_k = rng.integers(1, 300, n)
    lens_k[:4] = [1, KEY_INLINE, KEY_INLINE + 1, 299][: min(4, n)]
    keys = [bytes(rng.integers(0, 256, int(k), dtype=np.uint8)) for k in lens_k]
    segs = rng.integers(0, 1 << 32, n, dtype=np.int64)
    offs = rng.integers(0, 1 << 40, n, dtype=np.int64)
    lens = rng.integers(1, 1 << 32, n, dtype=np.int64)
    depths = rng.integers(-1, 1 << 31, n, dtype=np.int64).astype(np.int32)
    crcs = rng.integers(0, 1 << 32, n, dtype=np.int64).astype(np.uint32)
    return keys, segs, offs, lens, depths, crcs


@pytest.mark.parametrize("n", [0, 1, 37, 256])
def test_native_records_match_the_numpy_records_byte_for_byte(n):
    keys, segs, offs, lens, depths, crcs = _batch(n)
    gen = (1 << 63) + 12345
    rec48, recs, conf = batch_records(keys, segs, offs, lens, depths, crcs, gen, REC_DTYPE, True)
    want = make_records(segs, offs, lens, gen, crcs, depths, key_crcs(keys), keys, R_VALID)
    assert recs.tobytes() == want.tobytes()
    assert conf.tobytes() == confirmed_copy(want).tobytes()
    w48 = np.zeros(n, REC_DTYPE)
    w48["segment"], w48["length"], w48["offset"], w48["depth"], w48["crc"] = segs, lens, offs, depths, crcs
    w48["generation"] = w48["group"] = gen
    w48["flags"] = FLAG_CRC | FLAG_KEYCRC
    w48["key_crc"] = key_crcs(keys)
    assert rec48.tobytes() == w48.tobytes()
    if n:
        assert (record_crcs(recs) == recs["rcrc"]).all() and (record_crcs(conf) == conf["rcrc"]).all()
        assert (conf["flags"] & R_CONFIRMED).all() and not (recs["flags"] & R_CONFIRMED).any()
        trunc = np.array([len(k) > KEY_INLINE for k in keys])
        assert ((recs["flags"] & R_KEY_TRUNC) != 0).tolist() == trunc.tolist()
    _, _, none = batch_records(keys, segs, offs, lens, depths, crcs, gen, REC_DTYPE, False)
    assert none is None


def _args(n=4):
    keys, segs, offs, lens, depths, crcs = _batch(n)
    out48, out256, conf = (np.full(n * 48, 0xAB, np.uint8), np.full(n * 256, 0xAB, np.uint8),
                           np.full(n * 256, 0xAB, np.uint8))  # fmt: skip
    return [keys, segs, offs, lens, depths, crcs, 7, out48, out256, conf]


@pytest.mark.parametrize(
    "slot, bad, err",
    [
        (0, ("a", "b", "c", "d"), TypeError),  # not a list
        (0, [b"a", "b", b"c", b"d"], TypeError),  # a str key
        (0, [b"a", b"", b"c", b"d"], ValueError),  # an empty key
        (0, [b"a", b"b", b"c"], ValueError),  # one key short
        (1, np.zeros(4, np.int32), TypeError),  # wrong dtype
        (1, np.array([0, 1, 2, 1 << 32]), ValueError),  # segment over u32
        (1, np.array([0, 1, 2, -1]), ValueError),
        (2, np.array([0, 0, 0, -4096]), ValueError),  # negative offset
        (3, np.array([1, 0, 1, 1]), ValueError),  # empty object
        (3, np.array([1, 1, 1, 1 << 32]), ValueError),  # length over u32
        (3, np.ones(5, np.int64), ValueError),  # one entry too many
        (4, np.zeros(4, np.int64), TypeError),  # depths not int32
        (5, np.zeros(4, np.int32), TypeError),  # crcs not uint32
        (5, np.zeros(4, np.float32), TypeError),
        (6, -1, OverflowError),  # generation not a u64
        (6, 1 << 64, OverflowError),
        (6, 1.5, TypeError),
        (7, np.zeros(4 * 48 - 1, np.uint8), ValueError),  # short output buffers
        (8, np.zeros(4 * 256 - 1, np.uint8), ValueError),
        (9, np.zeros(4 * 256 + 1, np.uint8), ValueError),
        (8, np.zeros(4 * 256, np.uint8)[::1].view(np.uint32), TypeError),  # not bytes
        (8, np.zeros(4 * 256 * 2, np.uint8)[::2], TypeError),  # not contiguous
        (8, bytes(4 * 256), TypeError),  # read-only
        (1, None, TypeError),
    ],
)
def test_bad_input_is_refused_before_any_output_byte(slot, bad, err):
    args = _args()
    outs = [a for i, a in enumerate(args[7:], 7) if i != slot]  # the output buffers left in place
    args[slot] = bad
    with pytest.raises(err):
        put_records(*args)
    assert outs and all((a == 0xAB).all() for a in outs)  # nothing written


def test_conf_is_optional_and_valid_input_fills_every_byte():
    args = _args()
    args[9] = None
    assert put_records(*args) == 4
    recs = args[8].view(RECORD_DTYPE)
    assert (recs["magic"] == 0x5552).all() and (recs["flags"] & R_VALID).all()
    assert (args[7] != 0xAB).any() and (recs["generation"] == 7).all()


def _area_and_recs(n_slots=100, m=20, seed=5):
    rng = np.random.default_rng(seed)
    keys, segs, offs, lens, depths, crcs = _batch(m, seed)
    _, recs, conf = batch_records(keys, segs, offs, lens, depths, crcs, 9, REC_DTYPE, True)
    slots = rng.choice(n_slots, m, replace=False).astype(np.int64)
    return np.zeros(n_slots, RECORD_DTYPE), slots, recs, conf


def test_place_records_copies_each_record_to_its_slot_and_names_the_blocks():
    area, slots, recs, conf = _area_and_recs()
    out = np.full(len(slots), -1, np.int64)
    k = place_records(area.view(np.uint8), slots, recs.view(np.uint8), False, out)
    assert out[:k].tolist() == sorted(set((slots // 16).tolist()))
    assert area[slots].tobytes() == recs.tobytes()
    rest = np.setdiff1d(np.arange(len(area)), slots)
    assert not area[rest].view(np.uint8).any()
    # confirmed copies go only where the slot holds the same generation, valid and unconfirmed
    area[slots[0]]["generation"] = 8  # reused since
    area[slots[1]] = np.zeros(1, RECORD_DTYPE)  # cleared since
    before = area.copy()
    wide = np.append(slots, [len(area), -1])  # outside the area: skipped in confirm mode
    confx = np.concatenate([conf, conf[:2]])
    out = np.full(len(wide), -1, np.int64)
    k = place_records(area.view(np.uint8), wide, confx.view(np.uint8), True, out)
    assert area[slots[2:]].tobytes() == conf[2:].tobytes()
    assert area[slots[:2]].tobytes() == before[slots[:2]].tobytes()
    assert out[:k].tolist() == sorted(set((slots[2:] // 16).tolist()))
    again = place_records(area.view(np.uint8), slots, conf.view(np.uint8), True, out)  # confirmed already
    assert again == 0


@pytest.mark.parametrize(
    "slot, bad, err",
    [
        (0, np.zeros(100 * 256 - 1, np.uint8), ValueError),  # not whole records
        (0, bytes(100 * 256), TypeError),  # read-only
        (0, np.zeros(100, np.uint32), TypeError),
        (1, np.array([0, 100]), ValueError),  # past the area's last slot
        (1, np.array([-1, 3]), ValueError),
        (1, np.array([0, 1], np.int32), TypeError),
        (1, np.array([0, 1, 2]), ValueError),  # a slot more than records
        (2, np.zeros(2 * 256 - 1, np.uint8), ValueError),
        (4, np.zeros(1, np.int64), ValueError),  # blocks_out too short
        (4, np.zeros(2, np.int32), TypeError),
    ],
)
def test_place_records_refuses_bad_input_before_any_copy(slot, bad, err):
    area = np.zeros(100 * 256, np.uint8)
    recs = np.full(2 * 256, 0xCD, np.uint8)
    args = [area, np.array([0, 17]), recs, False, np.zeros(2, np.int64)]
    args[slot] = bad
    with pytest.raises(err):
        place_records(*args)
    assert not area.any()


def test_area_images_are_the_area_blocks_zero_padded():
    rng = np.random.default_rng(8)
    area = rng.integers(0, 256, 37 * 256, dtype=np.uint8)  # 37 records: blocks 0, 1 whole, 2 partial, 3 past the end
    padded = np.zeros(10 * 4096, np.uint8)
    padded[: len(area)] = area
    blocks = [0, 2, 1, 3, 9]
    got = np.full(len(blocks) * 4096, 0xEE, np.uint8)
    assert area_images(area, np.array(blocks), got) == len(blocks)
    for i, blk in enumerate(blocks):
        assert got[i * 4096 : (i + 1) * 4096].tobytes() == padded[blk * 4096 : (blk + 1) * 4096].tobytes()
    assert got[4096 : 2 * 4096][5 * 256 :].max() == 0 and got[4096 : 2 * 4096][: 5 * 256].tobytes() == area[32 * 256 :].tobytes()
    none = np.full(2 * 4096, 0xEE, np.uint8)
    area_images(None, np.array([0, 1]), none)  # a segment without an area: zeros
    assert not none.any()


@pytest.mark.parametrize(
    "slot, bad, err",
    [
        (0, np.zeros(10, np.int16), TypeError),
        (1, np.array([0, -1]), ValueError),
        (1, np.array([0, 1 << 62]), ValueError),
        (1, np.array([0, 1], np.int32), TypeError),
        (2, np.zeros(2 * 4096 - 1, np.uint8), ValueError),  # short
        (2, np.zeros(3 * 4096, np.uint8), ValueError),  # long
        (2, bytes(2 * 4096), TypeError),  # read-only
    ],
)
def test_area_images_refuse_bad_input_before_any_byte(slot, bad, err):
    out = np.full(2 * 4096, 0xEE, np.uint8)
    args = [np.ones(40 * 256, np.uint8), np.array([0, 1]), out]
    args[slot] = bad
    with pytest.raises(err):
        area_images(*args)
    assert (out == 0xEE).all()
