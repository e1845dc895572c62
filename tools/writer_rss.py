#!/usr/bin/env python3
"""A writer's resident memory per object while it fills a store past its capacity (issue 36).

    python tools/writer_rss.py                                 # 400 K-object store, 1.2 M puts
    python tools/writer_rss.py --capacity-objects 2m --puts 6m --dir /mnt/nvme/x --durability strict

Fills a fresh store of ``--capacity-objects`` 4 KiB slots with ``--puts`` objects in batches of
256 (SGLang-shaped keys), so once it is full every batch evicts old pages, and reports the
process's anonymous and file RSS growth per stored object at the end, the put rate, evictions
and the record blocks the writer holds (``stats()["record_blocks_in_memory"]``). The serving
writer is measured, not a reopened one: ``bench store --scale`` measures the reopen.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from umbp_nvme.sizes import parse_size  # noqa: E402

OBJ = 4096
BATCH = 256


def rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


async def run(a) -> dict:
    from umbp_nvme.buffers import AlignedBuffer
    from umbp_nvme.config import StoreConfig
    from umbp_nvme.store import PageStore

    seg = a.segment_bytes
    cap = -(-a.capacity_objects * OBJ * 18 // 17 // seg) * seg  # the slots plus their record blocks
    cfg = StoreConfig(ssd_storage_dir=a.path, ssd_capacity_bytes=cap, ssd_segment_size_bytes=seg,
                      ssd_durability_mode=a.durability, ssd_io_backend="auto", ssd_queue_depth=256,
                      admission_policy="all", ssd_record_cache_bytes=a.record_cache_bytes)  # fmt: skip
    gc.collect()
    before = rss()
    st = await PageStore.open(a.path, cfg)
    try:
        with AlignedBuffer(BATCH * OBJ) as buf:
            buf.array[:] = 7
            st.register_memory(buf.address, buf.nbytes)
            tuples = [(buf.address + i * OBJ, OBJ) for i in range(BATCH)]
            t0 = time.perf_counter()
            for lo in range(0, a.puts, BATCH):
                ks = [f"{lo + i:064x}_0_k|v" for i in range(min(BATCH, a.puts - lo))]
                await st.put_many(ks, tuples[: len(ks)])
            el = time.perf_counter() - t0
            s = st.stats()
            gc.collect()
            after = rss()
    finally:
        await st.close()
    n = max(1, s["objects"])
    return {"objects": s["objects"], "puts": a.puts, "evictions": s["evictions"], "puts_per_s": a.puts / el,
            "anon_per_object": (after["RssAnon"] - before["RssAnon"]) / n,
            "file_per_object": (after["RssFile"] - before["RssFile"]) / n,
            "record_blocks_in_memory": s.get("record_blocks_in_memory"), "durability": a.durability}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity-objects", type=parse_size, default=400_000, help="4 KiB slots the store holds (400k, 2m)")
    p.add_argument("--puts", type=parse_size, default=1_200_000, help="objects put (more than the capacity: eviction)")
    p.add_argument("--durability", choices=("strict", "relaxed"), default="relaxed")
    p.add_argument("--record-cache-bytes", type=parse_size, default=64 << 20)
    p.add_argument("--segment-bytes", type=parse_size, default=256 << 20)
    p.add_argument("--dir", default=None, help="where the store goes (default: a temporary directory, removed)")
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    base = a.dir or tempfile.mkdtemp(prefix="umbp-writer-rss-")
    a.path = os.path.join(base, "store")
    shutil.rmtree(a.path, ignore_errors=True)
    try:
        r = asyncio.run(run(a))
    finally:
        shutil.rmtree(a.path, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"writer at capacity ({r['durability']}): {r['objects']} objects after {r['puts']} puts, {r['evictions']} "
          f"evicted, {r['puts_per_s']:.0f} puts/s; RSS {r['anon_per_object']:.1f} B/object anonymous, "
          f"{r['file_per_object']:.1f} file; record blocks in memory {r['record_blocks_in_memory']}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
