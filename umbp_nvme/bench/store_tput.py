"""bench store's put / get rounds: PageStore, the raw io_uring engine and NIXL POSIX on the same
extents and memory (the systems and the round are described in bench/store.py).

Every get's bytes are compared with what was put, for every system and batch (outside the timed
laps): ``wrong_bytes`` in each get row, which must be 0.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import time

import numpy as np

from .common import Sample, page_keys, make_row, paired_ratio
from .engine import Memory
from . import nixl_posix

from umbp_nvme.config import StoreConfig
from umbp_nvme.engine import open_data_file, open_engine
from umbp_nvme.engine.files import NO_FILES, Files
from umbp_nvme.store.segments import segment_name
from umbp_nvme.store import PageStore

BENCH = "store"
OBJECTS_PER_PAGE = 2


class Laps:
    """Wall and process CPU time summed over ``with laps:`` blocks; what runs between them (the
    byte checks) is not counted."""

    def __init__(self):
        self.wall_s = self.cpu_s = 0.0

    def __enter__(self):
        self._w0, self._c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall_s += time.perf_counter() - self._w0
        self.cpu_s += time.process_time() - self._c0

    def sample(self, nbytes: int, ops: int) -> Sample:
        return Sample(nbytes=nbytes, ops=ops, wall_s=self.wall_s, cpu_s=self.cpu_s)


def wrong_bytes(got: np.ndarray, want: np.ndarray) -> int:
    return int(np.count_nonzero(got != want))


def store_extents(store: PageStore, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(segment, offset) of each key, from the writer's in-memory view of the index.

    The raw engine must hit exactly the store's blocks (PageStore.locate).
    """
    ext = store.locate(keys)
    return np.fromiter((e.segment for e in ext), np.int64, len(keys)), np.fromiter((e.offset for e in ext), np.int64, len(keys))


class SegFds:
    """The raw engine's own descriptors on the store's segment files (O_DIRECT like the store's)."""

    def __init__(self, directory: str):
        self.directory = directory
        self.files: dict[int, object] = {}

    def fds(self, segs: np.ndarray) -> Files:
        """The batch's files with their O_DIRECT facts, as the store hands its own to the engine."""
        out = np.empty(len(segs), np.int32)
        facts = NO_FILES
        for s in np.unique(segs).tolist():
            f = self.files.get(s)
            if f is None:
                f = self.files[s] = open_data_file(os.path.join(self.directory, segment_name(s)))
            out[segs == s] = f.fd
            facts = facts.merge(f.facts)
        return Files(out, facts)

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()


def store_config(cfg, path: str, capacity: int) -> StoreConfig:
    """The benchmark's stores: io_uring at QD 256, --segment-bytes and --durability."""
    return StoreConfig(
        ssd_storage_dir=path,
        ssd_capacity_bytes=capacity,
        ssd_segment_size_bytes=cfg.segment_bytes,
        ssd_durability_mode=cfg.durability,
        ssd_io_backend="io_uring",
        ssd_queue_depth=256,
        verify_crc=not getattr(cfg, "no_verify", False),
    )


async def bench_throughput(cfg, directory: str, mem: Memory, notes: list[str]) -> list[dict]:
    n_obj = cfg.batch_pages * OBJECTS_PER_PAGE
    sample_cap = max(max(cfg.sample_bytes, n_obj * s) for s in cfg.sizes)
    seg = cfg.segment_bytes
    capacity = -(-int(sample_cap * 1.5 + 4 * seg) // seg) * seg
    path = os.path.join(directory, "tput")
    shutil.rmtree(path, ignore_errors=True)
    scfg = store_config(cfg, path, capacity)
    store = await PageStore.open(path, scfg)
    raw = await open_engine("io_uring", queue_depth=256)
    segfds = SegFds(store.path)
    rows: list[dict] = []
    nixl = None
    try:
        nixl = open_nixl(mem, notes)
        if raw.capabilities.name != "io_uring":
            notes.append("umbp_uring: io_uring unavailable, the raw engine fell back to posix")
        fixed = False
        ranges = [(b.address, b.nbytes) for b in mem.bufs.values()]
        for a, n in ranges:
            fixed = store.register_memory(a, n) or fixed
        if fixed:
            fixed = bool(raw.register_buffers(ranges))
        notes.append(f"store: {cfg.durability}, capacity {capacity >> 20} MiB, segments {seg >> 20} MiB, "
                     f"fixed buffers {'on' if fixed else 'off'} for both systems, "
                     f"verify_crc {'on' if store.verify_crc else 'off (--no-verify)'}")  # as the store opened
        strict = cfg.durability == "strict"
        rnd = [0]

        async def one_round(size: int, kind: str):
            buf = mem.bufs[kind]
            k_batches = max(1, -(-cfg.sample_bytes // (n_obj * size)))
            rnd[0] += 1
            keys = [page_keys(f"r{rnd[0]}/{size}/{kind}/{b}", cfg.batch_pages) for b in range(k_batches)]
            addrs = buf.address + np.arange(n_obj, dtype=np.uint64) * np.uint64(size)
            tuples = [(int(a), size) for a in addrs.tolist()]
            lens = np.full(n_obj, size, np.int64)
            total = k_batches * n_obj
            out, wrong = {}, {}
            # store put
            gc.collect()
            with Laps() as sw:
                for b in range(k_batches):
                    res = await store.put_many(keys[b], tuples)
                    if not all(res):
                        raise RuntimeError(f"put_many failed for {res.count(False)} of {n_obj} objects ({size} B)")
            out["put", "umbp_store"] = sw.sample(total * size, total)
            ext = [store_extents(store, keys[b]) for b in range(k_batches)]
            plan = [(segfds.fds(s), o) for s, o in ext]
            # raw put on the same extents
            with Laps() as sw:
                for fds, offs in plan:
                    r = await raw.write_many(fds, offs, addrs, lens)
                    if (r != lens).any():
                        raise RuntimeError(f"raw write returned {int(r[r != lens][0])}")
                    if strict:
                        await asyncio.gather(*(raw.sync(int(fd)) for fd in np.unique(fds.fds).tolist()))
            out["put", "umbp_uring"] = sw.sample(total * size, total)
            if nixl is not None:
                for fds, _ in plan:
                    nixl.register_files(fds.fds, seg)
                with Laps() as sw:
                    for fds, offs in plan:
                        nixl.write_many(fds.fds, offs, addrs, lens)
                        if strict:
                            for fd in np.unique(fds.fds).tolist():
                                os.fdatasync(int(fd))
                out["put", "nixl_posix"] = sw.sample(total * size, total)
            # gets (cold: O_DIRECT), every batch's bytes compared with what was put, untimed
            want = buf.array[: n_obj * size].copy()
            area = buf.array[: n_obj * size]

            async def timed_gets(system: str, read_batch) -> None:
                laps, bad = Laps(), 0
                for b in range(k_batches):
                    area[:] = 0
                    with laps:
                        await read_batch(b)
                    bad += wrong_bytes(area, want)
                area[:] = want  # the next put's source, whatever the last get left
                out["get", system] = laps.sample(total * size, total)
                wrong[system] = bad

            async def store_get(b: int) -> None:
                res = await store.get_many(keys[b], tuples)
                if not all(res):
                    raise RuntimeError(f"get_many missed {res.count(False)} of {n_obj} objects ({size} B)")

            async def raw_get(b: int) -> None:
                fds, offs = plan[b]
                r = await raw.read_many(fds, offs, addrs, lens)
                if (r != lens).any():
                    raise RuntimeError(f"raw read returned {int(r[r != lens][0])}")

            async def nixl_get(b: int) -> None:
                fds, offs = plan[b]
                nixl.read_many(fds.fds, offs, addrs, lens)

            await timed_gets("umbp_store", store_get)
            await timed_gets("umbp_uring", raw_get)
            if nixl is not None:
                await timed_gets("nixl_posix", nixl_get)
            for b in range(k_batches):
                await store.delete_many(keys[b])
            return out, wrong

        for kind, buf in mem.bufs.items():
            buf.array[:] = np.random.default_rng(7).integers(0, 256, buf.nbytes, dtype=np.uint8)
        for size in cfg.sizes:
            for kind in mem.bufs:
                samples: dict[tuple[str, str], list[Sample]] = {}
                bad: dict[str, int] = {}
                await one_round(size, kind)  # warm-up: every extent written once
                for _ in range(cfg.runs):
                    got, wrong = await one_round(size, kind)
                    for key, s in got.items():
                        samples.setdefault(key, []).append(s)
                    for system, n in wrong.items():
                        bad[system] = bad.get(system, 0) + n
                for op in ("put", "get"):
                    if op not in cfg.ops:
                        continue
                    base = samples[op, "umbp_uring"]
                    for system in ("umbp_store", "umbp_uring") + (("nixl_posix",) if nixl else ()):
                        ss = samples[op, system]
                        mine = system == "umbp_store"
                        vs = paired_ratio(ss, base) if mine else None
                        vs_nixl = paired_ratio(ss, samples[op, "nixl_posix"]) if mine and nixl else None
                        extra = {"wrong_bytes": bad[system]} if op == "get" else {}
                        rows.append(make_row(BENCH, system, op, size, n_obj, ss, buffers=kind, fixed=fixed,
                                             vs_umbp_uring=vs, vs_nixl_posix=vs_nixl, cold=(op == "get"),
                                             verify_crc=store.verify_crc, **extra))
        st = store.stats()
        if st.get("o_direct") is False:
            notes.append(f"O_DIRECT refused on {path}: reads were not cold (page cache)")
        if st.get("crc_errors"):
            notes.append(f"store reported {st['crc_errors']} CRC errors")
    finally:
        segfds.close()
        raw.close()
        await store.close()
        shutil.rmtree(path, ignore_errors=True)
    return rows


def open_nixl(mem: Memory, notes: list[str]):
    """The NIXL POSIX baseline with every memory kind registered, or None (and a note why)."""
    why = nixl_posix.load_error()
    if why is None:
        try:
            nixl = nixl_posix.NixlPosix()
            for b in mem.bufs.values():
                nixl.register_dram(b.address, b.nbytes)
            notes.append(f"nixl_posix: NIXL POSIX plugin, one transfer request per call, polled every "
                         f"{nixl_posix.POLL_S * 1e6:.0f} us (a spinning poll bills NIXL a whole core)")
            return nixl
        except Exception as e:  # a plugin that will not start is a missing baseline, not a failed run
            why = f"{type(e).__name__}: {e}"
    notes.append(f"nixl_posix: not run ({why}; `pip install nixl` adds it)")
    return None

