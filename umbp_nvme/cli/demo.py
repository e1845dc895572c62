"""`umbp-nvme demo` (and `make demo`): a HiCache-shaped round trip on a temporary store.

Two batches of 128 pages, each page a K and a V object (as SGLang's UMBP-compatible keys name
them), are written with ``put_many`` from page-aligned host memory, read back with ``get_many``
into another buffer, and compared byte for byte; then a prefix-existence check, a dedup re-put
and a miss. Prints one table. A few MiB, a few seconds: the first thing a newcomer runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from ..buffers import AlignedBuffer
from ..config import StoreConfig
from ..sglang.keys import KeyScheme

PAGES_PER_BATCH = 128
BATCHES = 2
# One K or V page component: 64 tokens x 16 layers x 1 KV head x 128 dims x bf16 (a small
# model at page size 64); 2 x 128 pages x 2 objects = 128 MiB through the store.
OBJECT_BYTES = 256 << 10


def _page_hashes(n: int, start: int = 0) -> list[str]:
    return [hashlib.sha256(f"demo-page-{i}".encode()).hexdigest() for i in range(start, start + n)]


async def run_demo(directory: str, *, object_bytes: int = OBJECT_BYTES, out=sys.stdout) -> dict:
    from ..store import PageStore

    scheme = KeyScheme()  # TP 1, MHA: keys <hash>_0_k / <hash>_0_v
    cfg = StoreConfig(ssd_capacity_bytes=512 << 20, ssd_segment_size_bytes=64 << 20, ssd_storage_dir=directory)
    rows = []
    store = await PageStore.open(directory, cfg, namespace={"model": "umbp-demo", "layout": "page_first", "dtype": "bfloat16",
                                                             "kv_object_bytes": object_bytes})
    try:
        per_batch = PAGES_PER_BATCH * scheme.multiplier
        src = AlignedBuffer(per_batch * object_bytes)
        dst = AlignedBuffer(per_batch * object_bytes)
        rng = np.random.default_rng(0)
        all_ok = True
        for b in range(BATCHES):
            keys = scheme.v1_keys(_page_hashes(PAGES_PER_BATCH, b * PAGES_PER_BATCH))
            src.array[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
            views_in = [src.array[i * object_bytes : (i + 1) * object_bytes] for i in range(len(keys))]
            views_out = [dst.array[i * object_bytes : (i + 1) * object_bytes] for i in range(len(keys))]
            rows.append(await _timed(f"put batch {b + 1}", len(keys), object_bytes, store.put_many(keys, views_in)))
            dst.array[:] = 0
            rows.append(await _timed(f"get batch {b + 1}", len(keys), object_bytes, store.get_many(keys, views_out)))
            same = bool(np.array_equal(src.array, dst.array))
            rows[-1]["bytes_match"] = same
            all_ok &= same and rows[-1]["hits"] == len(keys) and rows[-2]["hits"] == len(keys)
        keys = scheme.v1_keys(_page_hashes(BATCHES * PAGES_PER_BATCH))
        t0 = time.perf_counter()
        prefix = await store.exists_prefix(keys)
        dt = time.perf_counter() - t0
        rows.append({"op": "exists_prefix", "objects": len(keys), "bytes": 0, "seconds": dt, "cpu_s": dt, "hits": prefix})
        first = keys[: scheme.multiplier * 4]
        rows.append(await _timed("re-put (dedup)", len(first), object_bytes,
                                 store.put_many(first, [src.array[i * object_bytes : (i + 1) * object_bytes] for i in range(len(first))])))
        miss = scheme.v1_keys(_page_hashes(2, 10_000))
        rows.append(await _timed("get unknown", len(miss), object_bytes, store.get_many(miss, [dst.array[i * object_bytes : (i + 1) * object_bytes] for i in range(len(miss))])))
        all_ok &= prefix == len(keys) and rows[-1]["hits"] == 0
        stats = store.stats()
    finally:
        await store.close()
        src.close()
        dst.close()
    _print(rows, stats, all_ok, out)
    return {"ok": all_ok, "rows": rows, "stats": stats}


async def _timed(op: str, n: int, object_bytes: int, coro) -> dict:
    c0, t0 = time.process_time(), time.perf_counter()
    res = await coro
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    ok = sum(res)
    moved = 0 if op.startswith("re-put") else ok * object_bytes  # a dedup re-put moves nothing
    return {"op": op, "objects": n, "bytes": moved, "seconds": dt, "cpu_s": cpu, "hits": ok}


def _print(rows: list[dict], stats: dict, ok: bool, out) -> None:
    w = out.write
    w(f"umbp_nvme demo: {BATCHES} x {PAGES_PER_BATCH} pages of K+V objects, engine {stats.get('engine')}, "
      f"O_DIRECT {stats.get('o_direct')}, durability {stats.get('durability')}\n\n")
    hdr = f"{'operation':<16} {'objects':>7} {'MiB':>7} {'ms':>8} {'GB/s':>7} {'CPU us/obj':>10} {'ok':>6}"
    w(hdr + "\n" + "-" * len(hdr) + "\n")
    for r in rows:
        gbps = r["bytes"] / r["seconds"] / 1e9 if r["bytes"] and r["seconds"] > 0 else 0.0
        cpu_us = r["cpu_s"] / max(r["objects"], 1) * 1e6
        flag = "" if r.get("bytes_match", True) else "  BYTES DIFFER"
        w(f"{r['op']:<16} {r['objects']:>7} {r['bytes'] / 2**20:>7.1f} {r['seconds'] * 1e3:>8.2f} {gbps:>7.3f} {cpu_us:>10.1f} {r['hits']:>6}{flag}\n")
    w(f"\nstore: {stats.get('objects')} objects, {stats.get('bytes_used', 0) / 2**20:.1f} MiB used; "
      f"hits {stats.get('hits')}, misses {stats.get('misses')}, dedup re-puts {stats.get('put_dedup')}\n")
    w("result: " + ("OK - every byte read back matches what was written\n" if ok else "FAILED - see the table above\n"))


def main(keep: str | None = None, out=sys.stdout) -> int:
    """The demo on a temporary store, or on ``keep`` (the store itself: new, empty or a kept demo)."""
    if keep is None:
        tmp = tempfile.mkdtemp(prefix="umbp-demo-")
        store_dir = os.path.join(tmp, "store")
    else:
        tmp, store_dir = None, os.path.abspath(os.path.expanduser(keep))
        why = _unusable(store_dir)
        if why:
            print(f"umbp-nvme demo: error: --keep {store_dir} {why}", file=sys.stderr)
            return 2
    try:
        result = asyncio.run(run_demo(store_dir, out=out))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if keep is not None:
        out.write(f"\nthe store is kept in {store_dir}; look at it with\n"
                  f"  umbp-nvme stats --store {store_dir}\n  umbp-nvme verify --store {store_dir}\n")
    return 0 if result["ok"] else 1


def _unusable(path: str) -> str | None:
    """Why ``path`` cannot take the demo's store: it is not a directory, or it holds other things."""
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return "is a file; give a new or empty directory"
    entries = os.listdir(path)
    if entries and "MANIFEST.json" not in entries:
        return ("is a directory that holds other files and no store; give a new or empty directory "
                "(the demo makes its store there)")
    return None
