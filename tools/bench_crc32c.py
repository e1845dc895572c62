"""CRC32C micro-benchmark: bytes per second per core for each implementation the CPU supports.

    python tools/bench_crc32c.py [--sizes 4K,64K,1M,4M] [--runs 5] [--cold-mib N] [--json [PATH]]

Implementations (dispatch order, best last): table (slicing-by-8), sse42 (today's: the crc32 instruction,
three interleaved streams), pclmul (PCLMULQDQ folding 4 x 128 bits beside three crc32 streams), vpclmul256
(AVX2 + VPCLMULQDQ folding 4 x 256 bits beside three crc32 streams), vpclmul (AVX-512 VPCLMULQDQ folding
4 x 512 bits). Each runs in its own subprocess with UMBP_CRC32C_IMPL=<impl>, driving the extension's
``crc32c_many`` (one call, GIL released) so that even 4 KiB buffers are timed without Python call overhead.

Modes:
  hot   the same buffer of the given size checksummed over and over (in L1/L2/L3 for these sizes)
  cold  consecutive buffers of the given size across a pool of --cold-mib (default: twice the last-level
        cache, at least 256 MiB, at most 2 GiB), one pass per run: every byte comes from DRAM

Per core: the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID) is the denominator, so other load on a shared
machine inflates wall time but not the figure; ``wall_gbps`` is reported too. Each cell is the median of
--runs runs (each ~--run-s seconds of work after a calibration run); ``vs_sse42`` is the ratio of medians to
today's SSE4.2 3-way in the same mode and size. GB/s = 1e9 bytes per second.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

IMPLS = ("table", "sse42", "pclmul", "vpclmul256", "vpclmul")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(s: str) -> int:
    s = s.strip().upper().rstrip("IB")
    return int(s[:-1]) * UNITS[s[-1]] if s and s[-1] in UNITS else int(s)


def fmt_size(n: int) -> str:
    for u, v in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % v == 0:
            return f"{n // v} {u}"
    return f"{n} B"


def llc_bytes() -> int:
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    best = max(best, parse_size(f.read().strip()))
            except (OSError, ValueError, KeyError):
                pass
    except OSError:
        pass
    return best


# ---------------------------------------------------------------- worker (one implementation)


def _time_many(uring, addrs, lengths, out):
    w0, c0 = time.perf_counter(), time.thread_time()
    uring.crc32c_many(addrs, lengths, out)
    return time.perf_counter() - w0, time.thread_time() - c0


def worker(args) -> dict:
    import numpy as np

    from umbp_nvme import _uring

    impl = _uring.crc32c_impl()
    rows = []
    cold_bytes = args.cold_mib << 20
    pool = None
    if "cold" in args.modes:
        pool = np.empty(cold_bytes + 4096, dtype=np.uint8)
        pool.fill(0x5A)  # faulted in, not zero pages
    for size in args.sizes:
        for mode in args.modes:
            if mode == "hot":
                buf = np.full(size + 4096, 0x5A, dtype=np.uint8)
                base = (buf.ctypes.data + 4095) & ~4095
                n = max(1, (8 << 20) // size)
                addrs = np.full(n, base, dtype=np.uint64)
                lengths = np.full(n, size, dtype=np.int64)
                out = np.zeros(n, dtype=np.uint32)
                _time_many(_uring, addrs, lengths, out)  # warm
                _, cpu = _time_many(_uring, addrs, lengths, out)
                n = max(1, int(n * args.run_s / max(cpu, 1e-6)))
                addrs = np.full(n, base, dtype=np.uint64)
                lengths = np.full(n, size, dtype=np.int64)
                out = np.zeros(n, dtype=np.uint32)
            else:
                base = (pool.ctypes.data + 4095) & ~4095
                n = cold_bytes // size
                addrs = (base + np.arange(n, dtype=np.uint64) * np.uint64(size)).astype(np.uint64)
                lengths = np.full(n, size, dtype=np.int64)
                out = np.zeros(n, dtype=np.uint32)
                _time_many(_uring, addrs, lengths, out)  # one pass to settle
            walls, cpus = [], []
            for _ in range(args.runs):
                wall, cpu = _time_many(_uring, addrs, lengths, out)
                walls.append(wall)
                cpus.append(cpu)
            nbytes = n * size
            gbps = [nbytes / c / 1e9 for c in cpus if c > 0]
            rows.append(
                {
                    "bench": "crc32c",
                    "impl": impl,
                    "mode": mode,
                    "object_bytes": size,
                    "gbps": statistics.median(gbps),
                    "gbps_min": min(gbps),
                    "gbps_max": max(gbps),
                    "wall_gbps": statistics.median(nbytes / w / 1e9 for w in walls),
                    "bytes_per_run": nbytes,
                    "runs": args.runs,
                }
            )
    return {"impl": impl, "rows": rows}


# ---------------------------------------------------------------- driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4K,64K,1M,4M", help="buffer sizes (default 4K,64K,1M,4M)")
    ap.add_argument("--modes", default="hot,cold", help="hot (buffer in cache), cold (from DRAM), or both")
    ap.add_argument("--impls", default=",".join(IMPLS), help="implementations to run (unsupported ones are skipped)")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell, median reported (5)")
    ap.add_argument("--run-s", type=float, default=0.05, help="CPU seconds per hot run (0.05)")
    ap.add_argument("--cold-mib", type=int, default=0, help="cold pool size (default 2 x LLC, 256..2048 MiB)")
    ap.add_argument("--json", nargs="?", const="-", default=None, help="write rows as JSON to PATH (or stdout)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    if any(m not in ("hot", "cold") for m in args.modes):
        ap.error("--modes takes hot and/or cold")
    if not args.cold_mib:
        args.cold_mib = min(2048, max(256, 2 * llc_bytes() >> 20))

    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    from umbp_nvme import _uring

    supported = _uring.crc32c_impls()
    wanted = [i for i in args.impls.split(",") if i]
    rows, notes = [], []
    for impl in wanted:
        if impl not in supported:
            notes.append(f"{impl}: not supported on this CPU/build, skipped")
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--sizes", ",".join(map(str, args.sizes)),
               "--modes", ",".join(args.modes), "--runs", str(args.runs), "--run-s", str(args.run_s),
               "--cold-mib", str(args.cold_mib)]
        env = dict(os.environ, UMBP_CRC32C_IMPL=impl, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            return 1
        res = json.loads(r.stdout.strip().splitlines()[-1])
        if res["impl"] != impl:
            notes.append(f"{impl}: the extension chose {res['impl']}, skipped")
            continue
        rows.extend(res["rows"])
    base = {(r["mode"], r["object_bytes"]): r["gbps"] for r in rows if r["impl"] == "sse42"}
    for r in rows:
        b = base.get((r["mode"], r["object_bytes"]))
        r["vs_sse42"] = round(r["gbps"] / b, 2) if b else None

    print(f"CRC32C GB/s per core (thread CPU time), median of {args.runs}; cold pool {args.cold_mib} MiB;"
          f" dispatched: {_uring.crc32c_impl()}")
    print(f"{'mode':<5} {'size':>8} " + " ".join(f"{i:>16}" for i in wanted if i in supported))
    for mode in args.modes:
        for size in args.sizes:
            cells = []
            for impl in wanted:
                if impl not in supported:
                    continue
                key = (impl, mode, size)
                r = next((r for r in rows if (r["impl"], r["mode"], r["object_bytes"]) == key), None)
                if r is None:
                    cells.append("-")
                elif r["vs_sse42"]:
                    cells.append(f"{r['gbps']:7.1f} ({r['vs_sse42']:4.2f}x)")
                else:
                    cells.append(f"{r['gbps']:7.1f}")
            print(f"{mode:<5} {fmt_size(size):>8} " + " ".join(f"{c:>16}" for c in cells))
    for n in notes:
        print("note:", n)
    if args.json:
        text = json.dumps(rows, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
