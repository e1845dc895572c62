#!/usr/bin/env python3
"""Store against the raw io_uring engine on the same extents, rounds alternated in one process.

    python tools/store_vs_raw.py --op put --device ram               # 256 x 64 KiB, SGLang keys
    python tools/store_vs_raw.py --op get --cold --rounds 12 --dir /mnt/nvme/x

``bench store`` runs every store batch, then every raw batch: on a shared machine a burst of noise
lands on one system, and its 64 KiB ratios swing +-0.1 between runs. Here each round of
``--batches`` store batches is followed by one of the raw engine on the same extents (puts: the raw
engine rewrites the extents the store's first fill used; the store's puts go to slots its deletes
freed, as bench store's rounds do), and the ratio is the median of per-round ratios. Puts also
report the index commit's share: the time LMDB's commits took inline, per object.

``--keys sglang`` (default) makes keys as the SGLang backend does (64 hex chars and a suffix, in
random order for LMDB); ``--keys short`` makes ``k{batch}/{i}`` (sequential keys: cheap commits).
``--cold`` zeroes (gets) or rewrites (puts) the batch's memory between batches, as bench store
does, so each batch starts with cold caches. Every get's bytes are compared with what was put.
``--steps`` (puts) also times the put path's steps in the counted store rounds and prints each
one's median per batch (they nest: the data write holds the wait for its I/O and the records'
landing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from umbp_nvme.bench.common import page_keys  # noqa: E402
from umbp_nvme.bench.store_tput import SegFds, store_extents  # noqa: E402
from umbp_nvme.buffers import AlignedBuffer  # noqa: E402
from umbp_nvme.config import StoreConfig  # noqa: E402
from umbp_nvme.engine import open_engine  # noqa: E402
from umbp_nvme.store import PageStore  # noqa: E402


# the put path's steps (PageStore coroutines) that --steps times, in the order a batch takes them
PUT_STEPS = ("put_many", "_reserve", "_write", "_await_io", "_records_landed", "_sync_written", "_publish")


def time_steps(st, names) -> dict:
    """Wrap the store's step coroutines (on the instance) so each call's seconds land in the
    returned dict while it says ``on``."""
    took: dict = {"on": False, "steps": defaultdict(list)}

    def wrap(name, fn):
        async def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                if took["on"]:
                    took["steps"][name].append(time.perf_counter() - t0)

        return timed

    for name in names:
        setattr(st, name, wrap(name, getattr(st, name)))  # AttributeError: the step was renamed
    return took


def batch_keys(kind: str, tag: str, n: int) -> list[str]:
    return page_keys(tag, n // 2) if kind == "sglang" else [f"{tag}/{i}" for i in range(n)]


async def run(a, path: str) -> dict:
    n, size, nb = a.objects, a.object_bytes, a.batches
    cap = -(-(4 * nb * n * size + (64 << 20)) // a.segment_bytes) * a.segment_bytes
    st = await PageStore.open(path, StoreConfig(
        ssd_storage_dir=path, ssd_capacity_bytes=cap, ssd_segment_size_bytes=a.segment_bytes,
        ssd_durability_mode="strict", ssd_io_backend="io_uring", ssd_queue_depth=256))  # fmt: skip
    raw = await open_engine("io_uring", queue_depth=256)
    buf = AlignedBuffer(n * size)
    segfds = SegFds(path)
    commits = [0.0, 0]
    index = st.state.index
    commit = index.commit

    def timed_commit(puts=(), deletes=(), **kw):
        t0 = time.perf_counter()
        commit(puts, deletes, **kw)
        if puts:
            commits[0] += time.perf_counter() - t0
            commits[1] += len(puts)

    try:
        buf.array[:] = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8)
        want = buf.array.copy()
        st.register_memory(buf.address, buf.nbytes)
        raw.register_buffers([(buf.address, buf.nbytes)])
        tuples = [(buf.address + i * size, size) for i in range(n)]
        addrs = np.array([t[0] for t in tuples], np.uint64)
        lens = np.full(n, size, np.int64)
        keys = [batch_keys(a.keys, f"k{b}", n) for b in range(nb)]
        for b in range(nb):
            if not all(await st.put_many(keys[b], tuples)):
                raise RuntimeError("the first fill failed")
        plan = [(segfds.fds(s), o) for s, o in (store_extents(st, keys[b]) for b in range(nb))]
        index.commit = timed_commit
        took = time_steps(st, PUT_STEPS) if a.steps else None
        walls = {"store": [], "raw": []}
        cpus = {"store": [], "raw": []}

        async def one(system: str, r: int) -> None:
            ks = [batch_keys(a.keys, f"p{r}/{b}", n) for b in range(nb)] if a.op == "put" else keys
            wall = cpu = 0.0
            for b in range(nb):
                if a.cold:
                    buf.array[:] = 0 if a.op == "get" else want
                t0, c0 = time.perf_counter(), time.process_time()
                if system == "store":
                    call = st.get_many if a.op == "get" else st.put_many
                    if took is not None:
                        took["on"] = r > 0
                    ok = all(await call(ks[b], tuples))
                    if took is not None:
                        took["on"] = False
                else:
                    fds, offs = plan[b]
                    if a.op == "get":
                        res = await raw.read_many(fds, offs, addrs, lens)
                    else:
                        res = await raw.write_many(fds, offs, addrs, lens)
                        for fd in np.unique(fds.fds).tolist():
                            await raw.sync(int(fd))
                    ok = bool((res == lens).all())
                wall += time.perf_counter() - t0
                cpu += time.process_time() - c0
                if not ok or (a.op == "get" and not np.array_equal(buf.array, want)):
                    raise RuntimeError(f"{system} {a.op} of batch {b} failed or read wrong bytes")
            if a.op == "put" and system == "store":
                for b in range(nb):
                    await st.delete_many(ks[b])
            walls[system].append(wall)
            cpus[system].append(cpu)

        for r in range(a.rounds + 1):  # round 0 warms both up, not counted
            for system in ("store", "raw"):
                await one(system, r)
            if r == 0:
                walls = {k: [] for k in walls}
                cpus = {k: [] for k in cpus}
                commits[:] = [0.0, 0]
        per = 1e6 / (nb * n)
        out = {
            "op": a.op, "keys": a.keys, "cold": a.cold, "object_bytes": size, "objects_per_batch": n,
            "store_over_raw": statistics.median(r / s for s, r in zip(walls["store"], walls["raw"])),
            "store_wall_us_per_object": statistics.median(walls["store"]) * per,
            "raw_wall_us_per_object": statistics.median(walls["raw"]) * per,
            "store_cpu_us_per_object": statistics.median(cpus["store"]) * per,
            "raw_cpu_us_per_object": statistics.median(cpus["raw"]) * per,
        }  # fmt: skip
        if a.op == "put":
            out["index_commit_us_per_object"] = commits[0] / max(commits[1], 1) * 1e6
        if took is not None:
            out["steps_us_per_batch"] = {k: statistics.median(took["steps"][k]) * 1e6 for k in PUT_STEPS
                                         if took["steps"][k]}  # fmt: skip
        return out
    finally:
        index.commit = commit
        segfds.close()
        raw.close()
        await st.close()
        buf.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=("get", "put"), default="get")
    ap.add_argument("--keys", choices=("sglang", "short"), default="sglang")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--batches", type=int, default=16, help="batches per round")
    ap.add_argument("--objects", type=int, default=256, help="objects per batch (even)")
    ap.add_argument("--object-bytes", type=int, default=64 << 10)
    ap.add_argument("--segment-bytes", type=int, default=256 << 20)
    ap.add_argument("--cold", action="store_true", help="zero / rewrite the batch's memory between batches")
    ap.add_argument("--steps", action="store_true", help="puts: time the put path's steps (median us per batch)")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--device", choices=("ram",), help="a RAM-backed loop device (root), set up and torn down")
    where.add_argument("--dir", help="a directory on the drive to measure (default: a temporary one)")
    a = ap.parse_args(argv)
    if a.objects < 2 or a.objects % 2 or a.rounds < 1 or a.batches < 1:
        ap.error("--objects must be even and >= 2; --rounds and --batches >= 1")
    if a.steps and a.op != "put":
        ap.error("--steps times the put path: use it with --op put")
    if a.device == "ram":
        from umbp_nvme.bench.ramdev import RamDevice, why_not

        why = why_not()
        if why:
            print(why, file=sys.stderr)
            return 2
        need = 5 * a.batches * a.objects * a.object_bytes + 4 * a.segment_bytes
        with RamDevice(need) as dev:
            out = asyncio.run(run(a, os.path.join(dev.mount, "store")))
    else:
        with tempfile.TemporaryDirectory(dir=a.dir) as d:
            out = asyncio.run(run(a, os.path.join(d, "store")))
    print(f"{out['op']} {out['object_bytes'] >> 10} KiB x {out['objects_per_batch']}, {out['keys']} keys"
          f"{', cold' if out['cold'] else ''}: store/raw {out['store_over_raw']:.3f} (median of per-round ratios); "
          f"wall us/object store {out['store_wall_us_per_object']:.2f} raw {out['raw_wall_us_per_object']:.2f}; "
          f"CPU us/object store {out['store_cpu_us_per_object']:.2f} raw {out['raw_cpu_us_per_object']:.2f}"
          + (f"; index commits {out['index_commit_us_per_object']:.2f} us/object" if "index_commit_us_per_object" in out
             else ""))  # fmt: skip
    if "steps_us_per_batch" in out:
        print("steps, median us per batch: " + ", ".join(
            f"{k.lstrip('_')} {v:.1f}" for k, v in out["steps_us_per_batch"].items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
