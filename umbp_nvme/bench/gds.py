#!/usr/bin/env python3
"""GDS reads into device memory vs io_uring reads into pinned host memory + copy to the device.

For each object size (default 1 MiB and 4 MiB) one file of --total-mib is written with random bytes,
then read whole, alternating the two systems, --runs times each, cold (the file's pages are dropped
from the page cache before every run):

* ``kvikio_gds``: ``KvikioEngine.read_many`` straight into one CUDA buffer (queue_depth in flight).
* ``uring_host_copy``: ``open_engine("io_uring")`` reads batches of queue_depth objects (O_DIRECT)
  into a pinned, page-aligned host buffer, double-buffered, each batch copied to the device with
  ``non_blocking`` copies on a side stream while the next batch is read.

Every run is checked byte for byte on the device against the file's contents. One JSON row per
(system, size) goes to stdout (the benchmark format, median of the runs):

  {"bench":"gds","system":"kvikio_gds"|"uring_host_copy","op":"read","object_bytes":int,
   "queue_depth":int,"gbps":float,"iops":float,"cpu_us_per_op":float,"runs":int,
   "path":"cufile"|"posix"|"mixed"|"unmeasured"|"io_uring+copy"}

``path`` of the kvikio row is what kvikio's own per-backend counters say served the bytes: "cufile"
only when cuFile moved all of them (kvikio can fall back to POSIX per file without a word).

Comment lines (``# ...``) carry the set-up (kvikio mode, host engine) and the ratio per size against
the target (GDS >= 0.9x host + copy). Exit status: 0 ok, 1 a byte mismatch or failed op, 2 target
missed or kvikio's bytes not served by cuFile (still reported), 3 no GPU / GDS here (prints the reason).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import statistics
import sys
import time

import numpy as np

from umbp_nvme.engine import gds

MiB = 1 << 20


def note(msg: str) -> None:
    print(f"# {msg}", flush=True)


def drop_cache(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages of this file, no root needed
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        pass


def make_file(path: str, total: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 1 << 63, total // 8, dtype=np.uint64).view(np.uint8)
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    return data


async def run_gds(engine, fd, dst_base, offsets, lengths, torch) -> tuple[float, float, np.ndarray]:
    torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    res = await engine.read_many(fd, offsets, dst_base + offsets, lengths)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0, res


async def run_host(host, fd, dst, offsets, lengths, staging, halves, torch, qd) -> tuple[float, float, np.ndarray]:
    stream = torch.cuda.Stream()
    events = [None, None]
    n = len(offsets)
    res = np.zeros(n, dtype=np.int64)
    size = int(lengths[0])
    torch.cuda.synchronize()
    c0, t0 = time.process_time(), time.perf_counter()
    for k, start in enumerate(range(0, n, qd)):
        half = k % 2
        if events[half] is not None:
            events[half].synchronize()  # the copy out of this half (two batches ago) is done
        stop = min(n, start + qd)
        host_addrs = staging.address + half * qd * size + np.arange(stop - start, dtype=np.int64) * size
        r = await host.read_many(fd, offsets[start:stop], host_addrs.astype(np.uint64), lengths[start:stop])
        res[start:stop] = r
        with torch.cuda.stream(stream):
            for j in range(stop - start):
                o = int(offsets[start + j])
                dst[o : o + size].copy_(halves[half][j * size : (j + 1) * size], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
            events[half] = ev
    stream.synchronize()
    return time.perf_counter() - t0, time.process_time() - c0, res


async def main_async(args) -> int:
    ok, reason = gds.gds_available()
    if not ok:
        note(f"SKIP: GPUDirect Storage benchmark needs a CUDA machine with kvikio: {reason}")
        return 3
    import torch

    from umbp_nvme.engine import open_data_file, open_engine

    os.makedirs(args.dir, exist_ok=True)
    qd = args.queue_depth
    engine = await gds.open_gds_engine(qd, probe_dir=args.dir)
    host = await open_engine(args.host_backend, qd)
    note(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__} (CUDA {torch.version.cuda})")
    note(f"kvikio: {json.dumps(engine.describe())}")
    note(f"host engine: {type(host).__name__} ({host.capabilities.name}), backend requested {args.host_backend!r}")
    status = 0
    rows = []
    try:
        for mib in args.sizes:
            size = int(mib * MiB)
            total = (args.total_mib * MiB // size) * size
            path = os.path.join(args.dir, f"bench_gds_{size}.dat")
            data = make_file(path, total, seed=size)
            ref = torch.from_numpy(data).cuda()
            del data
            df = open_data_file(path)
            note(f"{mib} MiB objects: file {path} {total >> 20} MiB, O_DIRECT={df.direct}")
            offsets = np.arange(0, total, size, dtype=np.int64)
            lengths = np.full(len(offsets), size, dtype=np.int64)
            dst = torch.empty(total, dtype=torch.uint8, device="cuda")
            dst_base = int(dst.data_ptr())
            staging = gds.StagingBuffer(2 * qd * size)
            hv = torch.frombuffer((ctypes.c_char * staging.nbytes).from_address(staging.address), dtype=torch.uint8)
            halves = [hv[: qd * size], hv[qd * size : 2 * qd * size]]
            note(f"staging {staging.nbytes >> 20} MiB pinned={staging.pinned} is_pinned={hv.is_pinned()}")
            samples = {"kvikio_gds": [], "uring_host_copy": []}
            served0 = engine.stats()["served"]["read"]
            try:
                for r in range(args.runs):
                    order = ["kvikio_gds", "uring_host_copy"] if r % 2 == 0 else ["uring_host_copy", "kvikio_gds"]
                    for system in order:
                        dst.zero_()
                        drop_cache(df.fd)
                        if system == "kvikio_gds":
                            wall, cpu, res = await run_gds(engine, df.fd, dst_base, offsets, lengths, torch)
                        else:
                            wall, cpu, res = await run_host(host, df, dst, offsets, lengths, staging, halves,
                                                            torch, qd)
                        bad = int(np.count_nonzero(res != size))
                        exact = bool(torch.equal(dst, ref))
                        if bad or not exact:
                            note(f"FAIL {system} {mib} MiB run {r}: {bad} failed ops "
                                 f"(first results {res[:4].tolist()}), byte_exact={exact}")
                            status = 1
                        samples[system].append((total / wall, len(offsets) / wall, cpu * 1e6 / len(offsets)))
            finally:
                engine.forget_fd(df.fd)
                df.close()
                staging.close()
                del dst, ref, hv, halves
                torch.cuda.empty_cache()
                if not args.keep:
                    os.unlink(path)
            # which path kvikio really used for this size's bytes (its per-backend counters)
            served1 = engine.stats()["served"]["read"]
            moved = {k: served1[k] - served0.get(k, 0) for k in served1}
            kv_path = gds.path_of(moved["cufile"], moved["posix"]) or "unmeasured"
            note(f"{mib} MiB: kvikio served {moved['cufile'] >> 20} MiB by cuFile, {moved['posix'] >> 20} MiB by "
                 f"POSIX, {moved['unattributed'] >> 20} MiB unattributed -> path {kv_path}")
            gbps = {}
            for system, s in samples.items():
                row = {"bench": "gds", "system": system, "op": "read", "object_bytes": size, "queue_depth": qd,
                       "gbps": round(statistics.median(x[0] for x in s) / 1e9, 3),
                       "iops": round(statistics.median(x[1] for x in s), 1),
                       "cpu_us_per_op": round(statistics.median(x[2] for x in s), 1), "runs": len(s),
                       "path": kv_path if system == "kvikio_gds" else "io_uring+copy"}
                gbps[system] = row["gbps"]
                rows.append(row)
                print(json.dumps(row), flush=True)
            ratio = gbps["kvikio_gds"] / gbps["uring_host_copy"] if gbps["uring_host_copy"] else float("nan")
            verdict = "meets" if ratio >= 0.9 else "MISSES"
            note(f"{mib} MiB: kvikio_gds / uring_host_copy = {ratio:.2f} ({verdict} the 0.9x target)")
            if ratio < 0.9 and status == 0:
                status = 2
            if kv_path != "cufile":
                note(f"{mib} MiB: NOT GPUDirect Storage: kvikio's bytes went {kv_path} (see kvikio line above)")
                if status == 0:
                    status = 2
    finally:
        engine.close()
        host.close()
    if args.out:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/var/tmp/umbp-gds-bench", help="directory on the NVMe file system under test")
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 4], help="object sizes in MiB")
    p.add_argument("--total-mib", type=int, default=1024, help="bytes read per run, per size")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--host-backend", default="io_uring", choices=["io_uring", "auto", "posix"])
    p.add_argument("--out", default="", help="also write the JSON rows here")
    p.add_argument("--keep", action="store_true", help="keep the data files")
    args = p.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
