"""Restart keeps the cache: reopening a store of 1 M objects finds every one of them.

The 2 s target is a benchmark's (``umbp-nvme bench store --ops reopen``, target ``reopen_s``): a
wall-clock bound here failed on a loaded 2-core CI machine (2.07 s, 2.12 s) with nothing wrong."""

from __future__ import annotations

import os
import time

import numpy as np

from conftest import small_config
from umbp_nvme.store.index import INDEX_FILE, REC_DTYPE, Index
from umbp_nvme.store.layout import record_slots
from umbp_nvme.store.segments import segment_name
from umbp_nvme.store import PageStore

N = 1_000_000
SEG = 256 << 20


def _fabricate(path: str) -> list[str]:
    """1 M committed 4 KiB records, written straight into the index (writing 4 GiB takes minutes)."""
    per = record_slots(SEG, 4096)  # the segment's tail holds the slots' records (issue 14)
    recs = np.zeros(N, REC_DTYPE)
    i = np.arange(N)
    recs["segment"], recs["offset"], recs["length"] = i // per, (i % per) * 4096, 4096
    recs["generation"] = recs["group"] = 1 + i // 256
    recs["depth"], recs["flags"] = -1, 1
    blob = recs.tobytes()
    keys = [f"{j:064x}_k" for j in range(N)]
    ix = Index(os.path.join(path, INDEX_FILE), readonly=False, map_size=1 << 32, durable=False)
    ix.commit([(k.encode(), blob[j * 48 : (j + 1) * 48]) for j, k in enumerate(keys)])
    ix.set_writer_state(b"clean")  # as a clean close leaves it: an unmarked index is rebuilt (issue 34)
    ix.close()
    for s in range(int(recs["segment"].max()) + 1):
        with open(os.path.join(path, segment_name(s)), "wb") as f:
            f.truncate(SEG)  # sparse: the allocator only needs the files to exist at full size
    return keys


async def test_reopen_of_1m_objects_finds_them_all(store_dir):
    cfg = small_config(ssd_capacity_bytes=17 * SEG, ssd_segment_size_bytes=SEG)  # 1 M 4 KiB slots
    st = await PageStore.open(store_dir, cfg)
    await st.close()
    keys = _fabricate(store_dir)
    for _ in range(2):  # a clean close, then the reopen trusts the index again
        t = time.perf_counter()
        st = await PageStore.open(store_dir, cfg)
        assert await st.wait_loaded()  # an index this large loads after open returns (store/loading.py)
        print(f"reopen of {N} objects: {time.perf_counter() - t:.3f} s")
        assert st.stats()["objects"] == N
        assert st.exists_prefix_nowait(keys[:128]) == 128
        assert st.exists_prefix_nowait(keys[-128:]) == 128
        assert st.exists_prefix_nowait([f"{N:064x}_k"]) == 0
        assert st.stats()["bytes_used"] == N * 4096
        await st.close()
