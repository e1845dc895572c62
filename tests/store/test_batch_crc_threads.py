"""Small batches are checksummed (put) and verified (get: each completed part of up to 16 MiB, one
by one, in calls of up to 4 MiB) on the loop thread, large ones on a worker: either way every stored CRC is
its object's and a damaged object fails alone."""

from __future__ import annotations


import numpy as np

from conftest import KiB, MiB, damage_object, payload, small_config
from umbp_nvme.store import PageStore, get_path, get_verify, put_path

SMALL = [180 * KiB + 7 * i for i in range(40)]  # ~7 MiB: CRC inline in 4 MiB chunks, a get part (<= 16 MiB) inline in chunks
LARGE = [1 * MiB + 512] * 20  # 20 MiB: CRC on a worker thread; get parts bounced (odd lengths): copied and checked on a worker


def test_the_batches_cover_both_paths():
    assert put_path.INLINE_CRC_CHUNK < sum(SMALL) <= put_path.INLINE_CRC_BYTES < sum(LARGE)
    small_parts = np.diff(get_path.read_parts(np.asarray(SMALL, np.int64))[0])
    assert get_verify.INLINE_VERIFY_BYTES < sum(SMALL) <= get_verify.INLINE_PART_BYTES  # inline, in > 1 CRC call
    assert max(small_parts) * max(SMALL) <= get_verify.INLINE_PART_BYTES
    assert all(n % 4096 for n in LARGE)  # O_DIRECT cannot read them into the caller's memory: bounced


async def test_inline_and_worker_crcs_are_the_objects_and_catch_damage(store_dir):
    cfg = small_config(ssd_capacity_bytes=96 * MiB, ssd_segment_size_bytes=8 * MiB, ssd_durability_mode="strict")
    st = await PageStore.open(store_dir, cfg)
    batches = {"s": SMALL, "l": LARGE}
    data = {}
    for tag, sizes in batches.items():
        keys = [f"{tag}{i}" for i in range(len(sizes))]
        vals = [payload(k, n) for k, n in zip(keys, sizes)]
        data[tag] = (keys, vals)
        assert await st.put_many(keys, vals) == [True] * len(keys)
    await st.flush()
    for tag, (keys, vals) in data.items():  # every stored CRC matches: all verify
        outs = [np.zeros(len(v), np.uint8) for v in vals]
        assert await st.get_many(keys, outs) == [True] * len(keys)
        assert all(np.array_equal(o, v) for o, v in zip(outs, vals))
    damage_object(store_dir, st, "s3", 1000, b"\x5a\xa5\x5a\xa5")
    damage_object(store_dir, st, "l5", 1000, b"\x5a\xa5\x5a\xa5")
    for tag, (keys, vals) in data.items():
        outs = [np.zeros(len(v), np.uint8) for v in vals]
        res = await st.get_many(keys, outs)
        bad = 3 if tag == "s" else 5
        assert res == [i != bad for i in range(len(keys))]
        assert all(np.array_equal(o, v) for i, (o, v) in enumerate(zip(outs, vals)) if i != bad)
    assert st.stats()["crc_errors"] == 2
    await st.close()
