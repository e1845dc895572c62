"""Store at full-node scale: RAM per object, open and reopen time, lookup latency at N objects (issue 36).

    umbp-nvme bench store --scale 10m [--dir DIR] [--keep] [--scale-object-bytes 4k] [--runs 3]

The store is filled with N objects as small as it allows (one 4 KiB slot each) through put_many
in batches of 8192 (relaxed durability, one flush at close), in DIR/scale-<N>-<bytes>/ (kept and
reused with --keep). Each measurement then runs in a fresh Python process, so its resident memory
is the store's alone:

  fill      the writer that filled the store: RSS growth per object while filling
  writer    a writer reopening the store (page cache warm, a process restart): seconds from the
            start of the open to the first answer of exists_prefix, to the end of the open
            (full reopen), RSS growth per object after it; then exists_prefix(128) p50 / p99 over
            --exists-calls calls, get_many(256) and put_many(256) latency at that size
  reader    a read-only opener (a follower rank): first answer; its first exists starts its key set's
            build (store/follower_keys.py), and RSS per object and exists_prefix(128) are measured
            once the set answers (seconds after open printed as "key set"), as it serves from then on

RSS per object is (RSS after - RSS before the open) / N, in total and split into anonymous
memory (the process's own) and file pages (the LMDB map and segment files: page cache shared
with every process that maps them, which the kernel reclaims). The targets judge the anonymous
part, as the issue's figures did (writer ~354 B, reader ~5 B); the file part is printed beside it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCH = 8192
OBJECTS_PER_PAGE = 2
MARKER = "bench_scale.json"
TARGETS = {"writer_bytes_per_object": 64.0, "reader_bytes_per_object": 16.0, "first_answer_s": 1.0,
           "reopen_s_per_million": 0.5, "exists_us": 20.0}  # fmt: skip


def rss() -> dict:
    """Resident bytes of this process: total, anonymous, file-backed (/proc/self/status)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, v = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(v.split()[0]) * 1024
    return {"total": out.get("VmRSS", 0), "anon": out.get("RssAnon", 0),
            "file": out.get("RssFile", 0) + out.get("RssShmem", 0)}  # fmt: skip


def _per_object(after: dict, before: dict, n: int) -> dict:
    return {k: (after[k] - before[k]) / max(1, n) for k in after}


def keys_at(lo: int, n: int) -> list[str]:
    """Objects lo..lo+n of the scale store (K and V of consecutive pages), made on the fly so no
    process holds all N keys."""
    from .common import page_keys

    p0 = lo // OBJECTS_PER_PAGE
    ks = page_keys("scale", -(-(lo + n) // OBJECTS_PER_PAGE) - p0, p0)
    return ks[lo - p0 * OBJECTS_PER_PAGE :][:n]


def store_config(path: str, n: int, size: int, segment_bytes: int, durability: str = "relaxed"):
    from umbp_nvme.config import StoreConfig

    capacity = -(-int(n * size / 0.8 + 2 * segment_bytes) // segment_bytes) * segment_bytes
    return StoreConfig(ssd_storage_dir=path, ssd_capacity_bytes=capacity, ssd_segment_size_bytes=segment_bytes,
                       ssd_durability_mode=durability, ssd_io_backend="io_uring", ssd_queue_depth=256)  # fmt: skip


# -- the measured processes (python -m umbp_nvme.bench.scale PHASE JSON) --------------------------


async def _lat_us(fn, calls: int) -> tuple[float, float]:
    lat = np.empty(calls)
    pc = time.perf_counter
    for i in range(calls):
        t = pc()
        await fn()
        lat[i] = pc() - t
    return float(np.percentile(lat, 50) * 1e6), float(np.percentile(lat, 99) * 1e6)


async def phase_fill(a: dict) -> dict:
    from umbp_nvme.buffers import AlignedBuffer
    from umbp_nvme.store import PageStore

    n, size = a["n"], a["size"]
    cfg = store_config(a["path"], n, size, a["segment_bytes"])
    store = await PageStore.open(a["path"], cfg)
    with AlignedBuffer(BATCH * size) as buf:
        buf.array[:] = np.random.default_rng(3).integers(0, 256, buf.nbytes, dtype=np.uint8)
        before = rss()  # after the source pages (the caller's memory, SGLang's host pool), as the open phase
        t0 = time.perf_counter()
        store.register_memory(buf.address, buf.nbytes)
        tuples = [(buf.address + i * size, size) for i in range(BATCH)]
        for lo in range(0, n, BATCH):
            ks = keys_at(lo, min(BATCH, n - lo))
            res = await store.put_many(ks, tuples[: len(ks)])
            if not all(res):
                raise RuntimeError(f"filling: put_many failed for {res.count(False)} objects at {lo}")
        fill_s = time.perf_counter() - t0
        after = rss()
        count = store.stats()["objects"]
    await store.close()
    if count != n:
        raise RuntimeError(f"the scale store holds {count} objects after the fill, expected {n} (evicted?)")
    return {"fill_s": fill_s, "rss_per_object": _per_object(after, before, n)}


async def _first_answer(store, probe) -> float:
    """Seconds until exists_prefix first answers (misses allowed while the index loads)."""
    await store.exists_prefix(probe)
    return time.perf_counter()


async def _key_set(store, probe, limit_s: float = 600.0):
    """A follower's (state, when): its first exists starts the key set's build (follower_keys.py);
    its exists is measured once the set answers, as it serves from then on (RSS with the set)."""
    await store.exists_prefix(probe)
    end = time.perf_counter() + limit_s
    while store.stats().get("key_set") == "building" and time.perf_counter() < end:
        await asyncio.sleep(0.01)
    return store.stats().get("key_set"), time.perf_counter()


async def phase_open(a: dict) -> dict:
    """A writer (or, with a["readonly"], a reader) reopening the filled store."""
    from umbp_nvme.buffers import AlignedBuffer
    from umbp_nvme.store import PageStore

    n, size, ro = a["n"], a["size"], a["readonly"]
    cfg = store_config(a["path"], n, size, a["segment_bytes"], a.get("durability", "relaxed"))
    mid = (n // 2) // OBJECTS_PER_PAGE * OBJECTS_PER_PAGE
    probe = keys_at(mid, 128)
    import gc

    gc.collect()
    before = rss()
    t0 = time.perf_counter()
    store = await PageStore.open(a["path"], cfg, readonly=ro)
    opened = time.perf_counter()
    first = await _first_answer(store, probe)
    loaded = getattr(store, "wait_loaded", None)  # a store that serves before its index is loaded
    if loaded is not None:
        await loaded()
    full = time.perf_counter()
    key_set = await _key_set(store, probe) if ro else None
    gc.collect()
    after = rss()
    out = {"open_s": opened - t0, "first_answer_s": first - t0, "reopen_s": full - t0,
           "rss_per_object": _per_object(after, before, n)}  # fmt: skip
    if key_set is not None:
        out["key_set"], out["key_set_s"] = key_set[0], key_set[1] - t0
    try:
        got = await store.exists_prefix(probe)
        if got != 128:
            raise RuntimeError(f"exists_prefix of 128 present keys counted {got}")
        out["exists_us_p50"], out["exists_us_p99"] = await _lat_us(lambda: store.exists_prefix(probe), a["calls"])
        with AlignedBuffer(256 * size) as buf:
            store.register_memory(buf.address, buf.nbytes)
            tuples = [(buf.address + i * size, size) for i in range(256)]
            gets = [keys_at((mid + 256 * i) % max(1, n - 256), min(256, n)) for i in range(16)]  # stored keys only
            lat = []
            for ks in gets:
                t = time.perf_counter()
                res = await store.get_many(ks, tuples)
                lat.append(time.perf_counter() - t)
                if not all(res):
                    raise RuntimeError(f"get_many of present keys missed {res.count(False)} of 256")
            out["get256_us_p50"] = statistics.median(lat) * 1e6
            if not ro:
                lat = []
                for i in range(16):
                    ks = [f"scale-extra/{i}/{j}" for j in range(256)]
                    t = time.perf_counter()
                    res = await store.put_many(ks, tuples)
                    lat.append(time.perf_counter() - t)
                    if not all(res):
                        raise RuntimeError(f"put_many failed for {res.count(False)} of 256")
                    await store.delete_many(ks)
                out["put256_us_p50"] = statistics.median(lat) * 1e6
    finally:
        await store.close()
    return out


def _phase_main(argv) -> int:
    phase, a = argv[0], json.loads(argv[1])
    fn = {"fill": phase_fill, "open": phase_open}[phase]
    res = asyncio.run(fn(a))
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# -- the driver --------------------------------------------------------------------------------


def add_args(p) -> None:
    p.add_argument("--scale", default=None, help="fill this many objects (1m, 10m) and measure RAM per object, "
                   "reopen and lookups at that size (bench/scale.py, issue 36)")  # fmt: skip
    p.add_argument("--scale-object-bytes", default="4k", help="object size of the --scale store")


def check_args(p, a) -> None:
    if a.scale is None:
        return
    from .common import parse_bytes

    try:
        a.scale = parse_count(a.scale)
    except ValueError as e:
        p.error(str(e))
    a.scale_object_bytes = parse_bytes(a.scale_object_bytes)


def parse_count(text: str) -> int:
    t = text.strip().lower()
    mult = {"k": 1000, "m": 1000_000, "g": 1000_000_000}.get(t[-1:], 1)
    try:
        v = float(t[:-1] if t[-1:] in "kmg" else t) * mult
    except ValueError:
        raise ValueError(f"--scale {text!r} is not a count of objects (e.g. 1m, 10m, 500k)") from None
    if v < 1024 or v != int(v):
        raise ValueError(f"--scale {text!r}: give a whole number of objects, at least 1024")
    return int(v)


def _run(phase: str, a: dict) -> dict:
    env = dict(os.environ)
    p = subprocess.run([sys.executable, "-m", "umbp_nvme.bench.scale", phase, json.dumps(a)], env=env,
                       capture_output=True, text=True)  # fmt: skip
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"scale {phase} process failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def fits(n: int, size: int, directory: str, notes: list[str]) -> int:
    """N, or the largest N the disk holds with 5 GiB to spare (a kept store of N is reused as it is)."""
    if os.path.exists(os.path.join(directory, f"scale-{n}-{size}", MARKER)):
        return n
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize - (5 << 30)
    per = -(-size // 4096) * 4096 + 256 + 200  # slot, its record, the index
    if n * per <= free:
        return n
    m = max(1024, free // per // 1_000_000 * 1_000_000 or free // per)
    notes.append(f"the disk holds {free >> 30} GiB to spare: {m} objects instead of {n}")
    return int(m)


def ensure_filled(cfg, directory: str, n: int, notes: list[str]) -> tuple[str, dict | None]:
    from .common import kept_store

    size = cfg.scale_object_bytes
    path = os.path.join(directory, f"scale-{n}-{size}")
    marker = os.path.join(path, MARKER)
    want = {"objects": n, "object_bytes": size, "segment_bytes": cfg.segment_bytes, "keys": "sha256(scale/i)_0_k|v"}
    have = kept_store(path, MARKER, want)
    if have:
        notes.append(f"scale store: reused {path} (filled in {have.get('fill_s', 0):.0f} s)")
        return path, None
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    res = _run("fill", {"path": path, "n": n, "size": size, "segment_bytes": cfg.segment_bytes})
    with open(marker, "w") as f:
        json.dump(dict(want, fill_s=res["fill_s"]), f)
    return path, res


def _med(vals: list[dict], key: str):
    return statistics.median(v[key] for v in vals)


def main(cfg) -> int:
    from .common import WorkDir, fmt_bytes

    notes: list[str] = []
    work = WorkDir(cfg, os.path.join(tempfile.gettempdir(), "umbp-bench-scale"), "umbp-bench-scale-", "bench store --scale")
    started = time.perf_counter()
    try:
        n = fits(cfg.scale, cfg.scale_object_bytes, work.path, notes)
        path, fill = ensure_filled(cfg, work.path, n, notes)
        a = {"path": path, "n": n, "size": cfg.scale_object_bytes, "segment_bytes": cfg.segment_bytes,
             "calls": cfg.exists_calls}  # fmt: skip
        w, r = [], []
        for _ in range(cfg.runs):  # alternate writer and reader: drift hits both
            w.append(_run("open", dict(a, readonly=False)))
            r.append(_run("open", dict(a, readonly=True)))
    finally:
        work.cleanup()
    rows = []
    print(f"store at scale: {n} objects of {fmt_bytes(cfg.scale_object_bytes)}, {cfg.runs} runs, "
          f"{time.perf_counter() - started:.0f} s total (medians [min-max])")
    if fill:
        f = fill["rss_per_object"]
        print(f"  fill      {fill['fill_s']:.1f} s ({n / fill['fill_s']:.0f} objects/s); writer RSS while filling "
              f"{f['total']:.1f} B/object (anon {f['anon']:.1f}, file {f['file']:.1f})")
        rows.append({"bench": "store", "system": "umbp_store", "op": "scale_fill", "objects": n,
                     "seconds": fill["fill_s"], "rss_bytes_per_object": f["total"],
                     "rss_anon_bytes_per_object": f["anon"]})  # fmt: skip
    for who, vals in (("writer", w), ("reader", r)):
        rss_t = [v["rss_per_object"]["total"] for v in vals]
        line = (f"  {who:<9} first answer {_med(vals, 'first_answer_s'):.3f} s, open {_med(vals, 'open_s'):.3f} s, "
                f"full reopen {_med(vals, 'reopen_s'):.3f} s [{min(v['reopen_s'] for v in vals):.3f}-"
                f"{max(v['reopen_s'] for v in vals):.3f}] ({_med(vals, 'reopen_s') * 1e6 / n:.3f} s per 1 M); "
                f"RSS {statistics.median(rss_t):.1f} B/object (anon {statistics.median(v['rss_per_object']['anon'] for v in vals):.1f}, "
                f"file {statistics.median(v['rss_per_object']['file'] for v in vals):.1f}); exists(128) p50 "
                f"{_med(vals, 'exists_us_p50'):.1f} us p99 {_med(vals, 'exists_us_p99'):.1f} us; get(256) "
                f"{_med(vals, 'get256_us_p50'):.0f} us")  # fmt: skip
        if who == "writer":
            line += f"; put(256) {_med(vals, 'put256_us_p50'):.0f} us"
        else:
            line += (f"; key set {'/'.join(sorted({v['key_set'] for v in vals}))} "
                     f"{_med(vals, 'key_set_s'):.2f} s after open")
        print(line)
        row = {"bench": "store", "system": "umbp_store" if who == "writer" else "umbp_store_ro", "op": "scale_open",
               "objects": n, "runs": vals, "rss_bytes_per_object": statistics.median(rss_t),
               "rss_anon_bytes_per_object": statistics.median(v["rss_per_object"]["anon"] for v in vals),
               **{k: _med(vals, k) for k in vals[0] if k not in ("rss_per_object", "key_set")}}  # fmt: skip
        rows.append(row)
    for line in targets(rows, n):
        print(line)
    for note in notes:
        print("note:", note)
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {cfg.json}")
    return 0


def targets(rows: list[dict], n: int) -> list[str]:
    t = TARGETS
    out = []
    for r in rows:
        if r["op"] == "scale_fill":  # the writer while it fills, as the issue counts it too
            b, lim = r["rss_anon_bytes_per_object"], t["writer_bytes_per_object"]
            out.append(f"filling writer RSS (anonymous) = {b:.1f} B/object at {n} objects (target <= {lim:g}) "
                       f"{'MET' if b <= lim else 'NOT MET'}")  # fmt: skip
        if r["op"] != "scale_open":
            continue
        who = "writer" if r["system"] == "umbp_store" else "reader"
        lim = t[f"{who}_bytes_per_object"]
        b = r["rss_anon_bytes_per_object"]
        out.append(f"{who} RSS (anonymous) = {b:.1f} B/object at {n} objects, {r['rss_bytes_per_object']:.1f} with "
                   f"file pages (target <= {lim:g}) {'MET' if b <= lim else 'NOT MET'}")
        fa = r["first_answer_s"]
        out.append(f"{who} first answer = {fa:.3f} s (target <= {t['first_answer_s']:g}) "
                   f"{'MET' if fa <= t['first_answer_s'] else 'NOT MET'}")  # fmt: skip
        if who == "writer":
            per_m = r["reopen_s"] * 1e6 / n
            out.append(f"reopen = {per_m:.3f} s per 1 M objects (target <= {t['reopen_s_per_million']:g}) "
                       f"{'MET' if per_m <= t['reopen_s_per_million'] else 'NOT MET'}")  # fmt: skip
        e = r["exists_us_p50"]
        out.append(f"{who} exists(128) p50 = {e:.1f} us (target <= {t['exists_us']:g}) "
                   f"{'MET' if e <= t['exists_us'] else 'NOT MET'}")  # fmt: skip
    return [f"bench target (issue 36): {x}" for x in out]


if __name__ == "__main__":
    sys.exit(_phase_main(sys.argv[1:]))
