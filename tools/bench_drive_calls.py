"""Per-call cost of a multi-drive store's lookups, puts and gets against another checkout's code.

    PYTHONPATH=. python tools/bench_drive_calls.py --baseline /path/to/other/checkout [--rounds 7]

Made for issue 34 (the drive session record: written at open and once before the first write,
never per call): each round runs one child per tree, alternating which goes first, over a fresh
two-root store in ``--dir``; a child opens it, puts ``--pages`` pages, then times
exists_many_nowait over 128 keys (``--exists-calls`` calls: the cheapest call, where a fixed cost
shows most), put_many of 64 fresh objects of 64 KiB and get_many of 64 (``--io-calls`` each), and
the open and close, in wall time and in the process's CPU time (steadier on a loaded machine). Prints the median per call of each tree over the rounds, their ratio (this
tree / baseline) and the median of the rounds' ratios (each round runs both trees back to back). The baseline checkout needs its native extension built (or copied).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

_CHILD = textwrap.dedent("""
    import asyncio, json, sys, time
    import numpy as np
    from umbp_nvme.config import StoreConfig
    from umbp_nvme.store import PageStore

    roots, pages, exists_calls, io_calls = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    OBJ, BATCH = 64 << 10, 64
    out = {}

    async def timed(name, calls, fn):
        w, c = time.perf_counter(), time.process_time()
        for i in range(calls):
            await fn(i)
        out[name + "_s"] = (time.perf_counter() - w) / calls
        out[name + "_cpu_s"] = (time.process_time() - c) / calls

    async def main():
        cfg = StoreConfig(ssd_storage_dir=roots, ssd_capacity_bytes=2 << 30, ssd_segment_size_bytes=64 << 20,
                          ssd_durability_mode="relaxed")
        box = []

        async def open_(i):
            box.append(await PageStore.open(roots, cfg))

        await timed("open", 1, open_)
        st = box[0]
        bufs = [np.full(OBJ, i % 251, np.uint8) for i in range(BATCH)]
        keys = [f"p{i:05d}_0_{c}" for i in range(pages) for c in "kv"]
        for i in range(0, len(keys), BATCH):
            assert all(await st.put_many(keys[i:i + BATCH], bufs[: len(keys[i:i + BATCH])]))
        probe = keys[:128]

        async def exists(i):
            st.exists_many_nowait(probe)

        async def put(i):
            assert all(await st.put_many([f"n{i:04d}{j:03d}_0_k" for j in range(BATCH)], bufs))

        async def get(i):
            assert all(await st.get_many(keys[:BATCH], bufs))

        await timed("exists", exists_calls, exists)
        await timed("put", io_calls, put)
        await timed("get", io_calls, get)

        async def close(i):
            await st.close()

        await timed("close", 1, close)
        print(json.dumps(out))

    asyncio.run(main())
""")


def _run(tree: str, base: str, a) -> dict:
    roots = [os.path.join(base, f"d{i}", "store") for i in range(2)]
    env = dict(os.environ, PYTHONPATH=tree)
    r = subprocess.run([sys.executable, "-c", _CHILD, ",".join(roots), str(a.pages), str(a.exists_calls),
                        str(a.io_calls)], cwd=tree, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    shutil.rmtree(base, ignore_errors=True)
    if r.returncode != 0:
        raise SystemExit(f"the child on {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--baseline", required=True, help="another checkout of umbp_nvme (its extension built)")
    p.add_argument("--dir", default=None, help="where the scratch stores go (default: a temporary directory)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--exists-calls", type=int, default=5000)
    p.add_argument("--io-calls", type=int, default=30)
    a = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": here, "baseline": os.path.abspath(a.baseline)}
    scratch = a.dir or tempfile.mkdtemp(prefix="bench-drive-calls-")
    res: dict = {name: [] for name in trees}
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            res[name].append(_run(trees[name], os.path.join(scratch, f"{name}-{r}"), a))
    print(f"{'per call':<12}{'this':>14}{'baseline':>14}{'ratio':>8}{'paired':>8}   (medians of {a.rounds} rounds; "
          "paired: the median of each round's ratio)")
    for k in ("exists_s", "exists_cpu_s", "put_s", "put_cpu_s", "get_s", "get_cpu_s", "open_s", "close_s"):
        mine, theirs = (statistics.median(x[k] for x in res[n]) for n in ("this", "baseline"))
        paired = statistics.median(x[k] / y[k] for x, y in zip(res["this"], res["baseline"]))
        print(f"{k[:-2]:<12}{mine * 1e6:>12.1f}us{theirs * 1e6:>12.1f}us{mine / theirs:>8.3f}{paired:>8.3f}")
    if not a.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
