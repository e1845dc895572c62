"""What publishing DISK KV events costs the data path: `umbp-nvme bench fleet --overhead`.

Two backends in this process, each over its own store, one with ``kv_events_endpoint`` set and
one without, back pages up (``batch_set_v1`` of 128 pages with prefix keys, as the cache
controller does) and read them back (``batch_get_v1``), in alternating rounds (off on off on
...), so drift hits both alike. Each round writes new pages and clears afterwards (untimed).
Reported: GB/s medians per side and the ratio on/off taken round by round (issue 27: within
2 %). The publisher has no subscriber here: it still encodes and sends every batch (a PUB
socket drops them), so its thread's CPU is in the measurement; a router's SUB is elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np

from .common import Stopwatch, make_row, paired_ratio
from .fleet_node import HostPool, StorageConfig

PAGES_PER_CALL = 128  # SGLang's STORAGE_BATCH_SIZE
PAGE_TOKENS = 64


class Backend:
    def __init__(self, directory: str, events: bool, object_bytes: int, calls: int, durability: str):
        from ..sglang_backend import UMBPNvmeStore

        shutil.rmtree(directory, ignore_errors=True)
        page_bytes = 2 * object_bytes
        cap = max(64 << 20, 2 * calls * PAGES_PER_CALL * page_bytes)
        extra = {"backend_name": "umbp_nvme", "interface_v1": 1, "ssd_storage_dir": directory,
                 "ssd_capacity_bytes": cap, "ssd_segment_size_bytes": 16 << 20, "ssd_durability_mode": durability}  # fmt: skip
        if events:
            extra["kv_events_endpoint"] = f"ipc://{directory}.ev"
        self.name = "events_on" if events else "events_off"
        self.be = UMBPNvmeStore(StorageConfig(extra), {})
        self.pool = HostPool(PAGES_PER_CALL, PAGE_TOKENS, object_bytes)
        self.pool.kv_buffer[:] = np.random.default_rng(27).integers(0, 256, self.pool.kv_buffer.shape, np.uint8)
        self.be.register_mem_pool_host(self.pool)
        self.object_bytes, self.calls = object_bytes, calls
        self.idx = np.arange(PAGES_PER_CALL * PAGE_TOKENS, dtype=np.int64)
        self._round = 0

    def keys(self) -> list[str]:
        tag = f"{self.name}/{self._round}"
        return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(self.calls * PAGES_PER_CALL)]

    def round(self) -> tuple:
        """(put Sample, get Sample) of one round's pages; the store is cleared after (untimed)."""
        from ..sglang_backend import HiCacheStorageExtraInfo

        keys, P = self.keys(), PAGES_PER_CALL
        self._round += 1
        nbytes = len(keys) * 2 * self.object_bytes
        ok = 0
        with Stopwatch() as put:
            for i in range(0, len(keys), P):
                ok += sum(self.be.batch_set_v1(keys[i : i + P], self.idx, HiCacheStorageExtraInfo(prefix_keys=keys[:i])))
        if ok != len(keys):
            raise RuntimeError(f"{self.name}: {len(keys) - ok} of {len(keys)} pages not written")
        with Stopwatch() as get:
            for i in range(0, len(keys), P):
                ok -= sum(self.be.batch_get_v1(keys[i : i + P], self.idx, HiCacheStorageExtraInfo(prefix_keys=keys[:i])))
        if ok != 0:
            raise RuntimeError(f"{self.name}: {ok} pages not read back")
        if self.be._publisher is not None:
            self.be._publisher.flush(60)  # its queue drained before the next round, untimed
        self.be.clear()
        return put.sample(nbytes, len(keys) * 2), get.sample(nbytes, len(keys) * 2)

    def close(self) -> None:
        self.be.close()


def measure(directory: str, object_sizes: list[int], rounds: int, calls: int, durability: str) -> list[dict]:
    rows = []
    for obj in object_sizes:
        systems = [Backend(os.path.join(directory, f"{e}-{obj}"), e == "on", obj, calls, durability)
                   for e in ("off", "on")]  # fmt: skip
        samples = {s.name: {"put": [], "get": []} for s in systems}
        try:
            for s in systems:
                s.round()  # warm-up: segment files created, engines and pages touched
            for _ in range(rounds):
                for s in systems:
                    put, get = s.round()
                    samples[s.name]["put"].append(put)
                    samples[s.name]["get"].append(get)
        finally:
            for s in systems:
                s.close()
        for op in ("put", "get"):
            off = samples["events_off"][op]
            for name, by_op in samples.items():
                ratio = paired_ratio(by_op[op], off) if name == "events_on" else None
                rows.append(make_row("events_cost", name, op, obj, PAGES_PER_CALL, by_op[op], vs_events_off=ratio,
                                     pages_per_call=PAGES_PER_CALL, calls=calls))  # fmt: skip
    return rows


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["system"] == "events_on" and r.get("vs_events_off") is not None:
            v = r["vs_events_off"]
            out.append(f"{r['op']} {r['object_bytes'] >> 10} KiB objects: events on / off = {v:.3f} "
                       f"(target >= 0.98) {'MET' if v >= 0.98 else 'NOT MET'}")  # fmt: skip
    return out
