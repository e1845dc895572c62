"""What publishing DISK KV events costs the data path: `umbp-nvme bench fleet --overhead`.

One backend over one store backs pages up (``batch_set_v1`` of 128 pages with prefix keys, as
the cache controller does) and reads them back (``batch_get_v1``), round after round, with its
event publisher started for one round and stopped for the next (``kv_events_endpoint`` is set;
the backend's ``set_kv_events``, untimed), in the order off on, on off, ...: the same
files, the same process, drift and order effects cancel. Each round writes new pages and clears
the store afterwards (untimed), or with ``evicting`` keeps it full so that every put evicts.
Reported: GB/s medians per side and the ratio on / off taken round by round (issue 27: within
2 %). Gets do nothing for events: their ratio shows the noise of the measurement. The publisher
has no subscriber here: it still encodes and sends every batch (a PUB socket drops them), so its
thread's CPU is in the measurement; a router's SUB is elsewhere.
"""

from __future__ import annotations

import hashlib
import shutil

import numpy as np

from .common import Stopwatch, make_row, paired_ratio
from .fleet_node import HostPool, StorageConfig

PAGES_PER_CALL = 128  # SGLang's STORAGE_BATCH_SIZE
PAGE_TOKENS = 64


class Backend:
    def __init__(self, directory: str, object_bytes: int, calls: int, durability: str, evicting: bool = False):
        from ..sglang.backend import UMBPNvmeStore

        shutil.rmtree(directory, ignore_errors=True)
        rnd = calls * PAGES_PER_CALL * 2 * object_bytes
        # evicting: the store holds about one round, is never cleared, and every round's puts evict the last's
        cap = max(16 << 20, rnd) if evicting else max(64 << 20, 2 * rnd)
        self.evicting = evicting
        extra = {"backend_name": "umbp_nvme", "interface_v1": 1, "ssd_storage_dir": directory,
                 "ssd_capacity_bytes": cap, "ssd_segment_size_bytes": 16 << 20, "ssd_durability_mode": durability,
                 "kv_events_endpoint": f"ipc://{directory}.ev", "kv_events_reannounce": False}  # fmt: skip
        self.be = UMBPNvmeStore(StorageConfig(extra), {})
        self.pool = HostPool(PAGES_PER_CALL, PAGE_TOKENS, object_bytes)
        self.pool.kv_buffer[:] = np.random.default_rng(27).integers(0, 256, self.pool.kv_buffer.shape, np.uint8)
        self.be.register_mem_pool_host(self.pool)
        self.object_bytes, self.calls = object_bytes, calls
        self.idx = np.arange(PAGES_PER_CALL * PAGE_TOKENS, dtype=np.int64)
        self._round = 0

    def events(self, on: bool) -> None:
        if self.be.set_kv_events(on) != on:
            raise RuntimeError("the KV event publisher did not start (see the log)")

    def round(self) -> tuple:
        """(put Sample, get Sample) of one round of new pages."""
        from ..sglang.backend import HiCacheStorageExtraInfo

        P = PAGES_PER_CALL
        keys = [hashlib.sha256(f"{self._round}/{i}".encode()).hexdigest() for i in range(self.calls * P)]
        self._round += 1
        nbytes = len(keys) * 2 * self.object_bytes
        ok = 0
        with Stopwatch() as put:
            for i in range(0, len(keys), P):
                ok += sum(self.be.batch_set_v1(keys[i : i + P], self.idx, HiCacheStorageExtraInfo(prefix_keys=keys[:i])))
        if ok != len(keys):
            raise RuntimeError(f"{len(keys) - ok} of {len(keys)} pages not written")
        with Stopwatch() as get:
            for i in range(0, len(keys), P):
                ok -= sum(self.be.batch_get_v1(keys[i : i + P], self.idx, HiCacheStorageExtraInfo(prefix_keys=keys[:i])))
        if ok != 0 and not self.evicting:  # evicting: a page read after later ones were written may be gone
            raise RuntimeError(f"{ok} pages not read back")
        if self.be.publisher is not None:
            self.be.publisher.flush(60)  # its queue drained before the next round, untimed
        if not self.evicting:
            self.be.clear()
        return put.sample(nbytes, len(keys) * 2), get.sample(nbytes, len(keys) * 2)

    def close(self) -> None:
        self.be.close()


def measure(directory: str, object_sizes: list[int], rounds: int, calls: int, durability: str,
            evicting: bool = False) -> list[dict]:  # fmt: skip
    rows = []
    for obj in object_sizes:
        b = Backend(f"{directory}/store-{obj}", obj, calls, durability, evicting)
        samples = {name: {"put": [], "get": []} for name in ("events_off", "events_on")}
        try:
            for on in (False, True):  # warm-up: segment files created, engines and pages touched
                b.events(on)
                b.round()
            for r in range(2 * rounds):
                on = (r % 4) in (1, 2)  # off on, on off, ...
                b.events(on)
                put, get = b.round()
                side = samples["events_on" if on else "events_off"]
                side["put"].append(put)
                side["get"].append(get)
        finally:
            b.close()
        for op in ("put", "get"):
            off = samples["events_off"][op]
            for name, by_op in samples.items():
                ratio = paired_ratio(by_op[op], off) if name == "events_on" else None
                rows.append(make_row("events_cost", name, op, obj, PAGES_PER_CALL, by_op[op], vs_events_off=ratio,
                                     pages_per_call=PAGES_PER_CALL, calls=calls, evicting=evicting))  # fmt: skip
    return rows


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["system"] == "events_on" and r.get("vs_events_off") is not None:
            v = r["vs_events_off"]
            out.append(f"{r['op']} {r['object_bytes'] >> 10} KiB objects: events on / off = {v:.3f} "
                       f"(target >= 0.98) {'MET' if v >= 0.98 else 'NOT MET'}")  # fmt: skip
    return out
