"""The doctor's measured probe: a few seconds of put_many / get_many through a scratch store.

``check_probe`` runs it at the store's object size, beside the store (same file system), and
compares it with raw I/O of the same engine, batch and sizes on a plain file there, in GB/s and
as a fraction of raw. The scratch directory is removed after; the store itself is never touched.
``report.report`` runs it last, as the ``probe`` item.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import tempfile
import time

import numpy as np

from ..config import StoreConfig
from .findings import existing, finding

DEFAULT_OBJECT_BYTES = 256 << 10
PROBE_SECONDS = 0.8  # per phase; four phases (store write/read, raw write/read)
PROBE_FILE_BYTES = 256 << 20  # the raw baseline cycles over a file of this size
PROBE_BATCH_BYTES = 16 << 20  # bytes per batch call, as a HiCache backup of a few pages
PROBE_MIN_FREE_BYTES = 1 << 30


def _object_bytes(store_dir: str, config: StoreConfig) -> int:
    try:
        from .maintenance import read_manifest

        ns = read_manifest(store_dir).get("namespace") or {}
        sizes = ns.get("kv_object_bytes")
        if sizes:
            return int(max(sizes))
    except Exception:  # noqa: BLE001 - no store yet: the default size
        pass
    return DEFAULT_OBJECT_BYTES


async def _timed(seconds: float, step) -> tuple[int, float]:
    moved, t0 = 0, time.perf_counter()
    while True:
        moved += await step()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return moved, dt


async def _probe(scratch: str, config: StoreConfig, obj: int, seconds: float) -> dict:
    from ..buffers import AlignedBuffer
    from ..engine import open_engine
    from ..engine.files import open_data_file
    from ..store import PageStore

    per_batch = max(1, PROBE_BATCH_BYTES // obj)
    nbytes = per_batch * obj
    buf = AlignedBuffer(nbytes)
    buf.array[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    base = buf.address
    out: dict = {"object_bytes": obj, "batch_objects": per_batch}

    # through the store (index, CRC, allocator, engine)
    cfg = dataclasses.replace(config, ssd_capacity_bytes=PROBE_FILE_BYTES * 2, ssd_storage_dir=scratch,
                              ssd_segment_size_bytes=min(int(config.ssd_segment_size_bytes), 64 << 20))
    st = await PageStore.open(os.path.join(scratch, "store"), cfg)
    try:
        st.register_memory(base, nbytes)
        bufs = [(base + i * obj, obj) for i in range(per_batch)]
        written: list[list[str]] = []
        gen = iter(range(1 << 30))

        async def put():
            ks = [f"p{next(gen)}" for _ in range(per_batch)]
            ok = await st.put_many(ks, bufs)
            written.append(ks)
            return sum(ok) * obj

        await put()  # warm-up, untimed: the first batch creates a segment file and grows the index
        moved, dt = await _timed(seconds, put)
        out["store_write_gbps"] = moved / dt / 1e9
        live = [ks for ks in written if all(await st.exists_many(ks))] or written[-1:]
        it = iter(range(1 << 30))

        async def get():
            ks = live[next(it) % len(live)]
            return sum(await st.get_many(ks, bufs)) * obj

        moved, dt = await _timed(seconds, get)
        out["store_read_gbps"] = moved / dt / 1e9
        out["engine"] = st.stats()["engine"]
        out["o_direct"] = st.stats()["o_direct"]
    finally:
        await st.close()

    # raw O_DIRECT baseline: the same engine, batch and sizes on a plain file, nothing else
    eng = await open_engine(config.ssd_io_backend, int(config.ssd_queue_depth))
    f = open_data_file(os.path.join(scratch, "raw"), create=True, size=PROBE_FILE_BYTES, direct=True)
    try:
        eng.register_buffers([(base, nbytes)])
        slots = PROBE_FILE_BYTES // nbytes
        addrs = np.asarray([base + i * obj for i in range(per_batch)], np.uint64)
        lens = np.full(per_batch, obj, np.int64)
        # like for like: a strict store syncs its data once per put batch, so the baseline does too
        strict = str(config.ssd_durability_mode).strip().lower() in ("strict", "sync")
        out["raw_syncs_per_batch"] = strict
        state = {"batch": 0, "written": 0}

        def offs(limit: int):
            s = state["batch"] % max(1, limit)
            state["batch"] += 1
            return np.arange(per_batch, dtype=np.int64) * obj + s * nbytes

        async def w():
            r = await eng.write_many(f, offs(slots), addrs, lens)
            if strict:
                await eng.sync(f.fd)
            state["written"] = min(slots, state["written"] + 1)
            return int(r[r > 0].sum())

        async def r_():
            # only what was written: unwritten (fallocated) extents read as zeros without I/O
            r = await eng.read_many(f, offs(state["written"]), addrs, lens)
            return int(r[r > 0].sum())

        await w()  # warm-up, untimed, as for the store
        moved, dt = await _timed(seconds, w)
        out["raw_write_gbps"] = moved / dt / 1e9
        state["batch"] = 0
        moved, dt = await _timed(seconds, r_)
        out["raw_read_gbps"] = moved / dt / 1e9
        out["raw_o_direct"] = f.direct
    finally:
        f.close()
        eng.close()
        buf.close()
    for op in ("write", "read"):
        raw = out[f"raw_{op}_gbps"]
        out[f"{op}_fraction_of_raw"] = out[f"store_{op}_gbps"] / raw if raw > 0 else None
    return out


def check_probe(store_dir: str, config: StoreConfig, findings: list, seconds: float = PROBE_SECONDS) -> dict:
    where = existing(store_dir)
    if os.path.isdir(store_dir):
        where = os.path.dirname(os.path.abspath(store_dir)) or where  # beside the store, same file system
        if os.stat(where).st_dev != os.stat(store_dir).st_dev:
            where = store_dir
    sv = os.statvfs(where)
    if sv.f_bavail * sv.f_frsize < PROBE_MIN_FREE_BYTES:
        finding(findings, "probe", "warn", f"skipped: under {PROBE_MIN_FREE_BYTES >> 20} MiB free at {where}",
                 "free some space, or run the doctor with --no-probe")
        return {"skipped": "no space"}
    obj = _object_bytes(store_dir, config)
    try:
        scratch = tempfile.mkdtemp(prefix=".umbp-doctor-", dir=where)
    except OSError as e:
        finding(findings, "probe", "warn", f"skipped: cannot create a scratch directory in {where} ({e.strerror})",
                 f"make {where} writable, or run with --no-probe")
        return {"skipped": str(e)}
    try:
        out = asyncio.run(_probe(scratch, config, obj, seconds))
    except Exception as e:  # noqa: BLE001 - a failing probe is a finding
        finding(findings, "probe", "fail", f"the I/O probe failed: {e!r}", "run `umbp-nvme bench engine --quick` "
                 "for detail and check the drive (dmesg)")
        return {"error": repr(e)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    msg = (f"{obj >> 10} KiB objects, {out['batch_objects']} per call: store write {out['store_write_gbps']:.2f} GB/s "
           f"({_pct(out['write_fraction_of_raw'])} of raw), read {out['store_read_gbps']:.2f} GB/s "
           f"({_pct(out['read_fraction_of_raw'])} of raw); raw {'O_DIRECT' if out['raw_o_direct'] else 'buffered'} "
           f"write {out['raw_write_gbps']:.2f}, read {out['raw_read_gbps']:.2f} GB/s"
           + ("; both sync each write batch (strict durability)" if out["raw_syncs_per_batch"] else ""))
    low = [op for op in ("write", "read") if (out[f"{op}_fraction_of_raw"] or 1) < 0.5]
    if low:
        fix = ("check CPU contention (the CRC and the index share the cores), io_timeout_s stalls in the log, and "
               "that the engine is io_uring")
        if "write" in low and out["raw_syncs_per_batch"]:
            fix = ("strict durability also commits and syncs the index (LMDB) after every put batch, which the raw "
                   "baseline does not; if a lost tail of puts after a crash is acceptable for a cache, set "
                   "ssd_durability_mode=relaxed. Otherwise " + fix)
        finding(findings, "probe", "warn", msg + f"; the store reaches under half of raw for {' and '.join(low)}", fix)
    else:
        finding(findings, "probe", "ok", msg)
    return out


def _pct(x) -> str:
    return "?" if x is None else f"{x * 100:.0f} %"
