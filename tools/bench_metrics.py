"""Per-call cost of the metrics on the serving path: SyncPageStore calls with and without a watch.

    PYTHONPATH=. python tools/bench_metrics.py [--dir DIR] [--rounds 5]

Alternates rounds with metrics off and on over the same store and keys, and prints the median
time per call of exists_prefix (128 keys: the cheapest call, where a fixed cost shows most),
get_many and put_many (256 objects of 64 KiB), and the difference.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np

from umbp_nvme import metrics
from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.config import StoreConfig
from umbp_nvme.store.sync import SyncPageStore

OBJ = 64 << 10
N = 256


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--exists-calls", type=int, default=3000)
    p.add_argument("--io-calls", type=int, default=20)
    a = p.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="bench-metrics-")
    cfg = StoreConfig(ssd_storage_dir=d, ssd_capacity_bytes=1 << 30, ssd_segment_size_bytes=64 << 20,
                      ssd_durability_mode="relaxed")
    from prometheus_client import CollectorRegistry

    m = metrics.Metrics(CollectorRegistry(), multiprocess=False)
    with SyncPageStore(d, cfg) as st, AlignedBuffer(N * OBJ) as buf:
        st.register_memory(buf.address, buf.nbytes)
        bufs = [(buf.address + i * OBJ, OBJ) for i in range(N)]
        keys = [f"k{i}" for i in range(N)]
        assert all(st.put_many(keys, bufs))
        res = {(op, on): [] for op in ("exists", "get", "put") for on in (False, True)}
        gen = iter(range(1 << 30))
        for _ in range(a.rounds):
            for on in (False, True):
                if on:
                    m.watch(st)
                t0 = time.perf_counter()
                for _ in range(a.exists_calls):
                    st.exists_prefix(keys[:128])
                res[("exists", on)].append((time.perf_counter() - t0) / a.exists_calls)
                t0 = time.perf_counter()
                for _ in range(a.io_calls):
                    st.get_many(keys, bufs)
                res[("get", on)].append((time.perf_counter() - t0) / a.io_calls)
                t0 = time.perf_counter()
                for _ in range(a.io_calls // 4):
                    st.put_many([f"p{next(gen)}" for _ in range(N)], bufs)
                res[("put", on)].append((time.perf_counter() - t0) / (a.io_calls // 4))
                if on:
                    m.unwatch(st)
    print(f"{'call':<22} {'off us':>10} {'on us':>10} {'diff us':>9} {'spread off':>11}")
    for op, what in (("exists", "exists_prefix(128)"), ("get", f"get_many({N}x64KiB)"), ("put", f"put_many({N}x64KiB)")):
        off, on = statistics.median(res[(op, False)]) * 1e6, statistics.median(res[(op, True)]) * 1e6
        spread = (max(res[(op, False)]) - min(res[(op, False)])) * 1e6
        print(f"{what:<22} {off:>10.1f} {on:>10.1f} {on - off:>9.1f} {spread:>11.1f}")


if __name__ == "__main__":
    main()
