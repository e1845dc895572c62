"""The put lifecycle: check keys and buffers -> reserve slots -> write (stage, CRC, submit) ->
[fdatasync] -> publish (one index commit) | abort (slots and bounce given back).

An entry is visible only after its bytes are on the file. Every key is checked before any slot
is reserved: nothing can fail once the write is submitted, so a bad key fails alone and never
frees slots the device still owns. A mixin of PageStore.

Reads: state.files, state.memory, state.arbiter, state.crc32c*, state.index, state.gds_gate,
writer.keys, writer.write_engine, writer.write_sem. Changes: writer.alloc (slots, through space.py),
writer.rows (recency of re-puts), state.bounce (borrowed, given back), state.counters.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging

import numpy as np

from ..engine.base import errno_name
from ..keybytes import encode_key, key_error
from .layout import SLOT_ALIGN_BYTES
from .loading import PUT_WAIT_S
from .checks import Refusals, plain_keys
from .memory import int_arg
from . import admit_gate, put_crc, staging
from .staging import settle, wait_out

_ASYNCIO_TIMEOUT = hasattr(asyncio, "timeout")

log = logging.getLogger("umbp_nvme.store")

INT32_MIN, INT32_END = -(1 << 31), 1 << 31
OBJECT_BYTES_END = 1 << 32  # an object's length is a u32 in the index record
INLINE_CRC_BYTES = 16 << 20  # a host batch up to this size is checksummed on the loop thread
INLINE_CRC_CHUNK = 4 << 20  # bytes per CRC call there (~0.3 ms) before other tasks get a turn


class WriteBatch:
    """One write submission: the objects (``todo``: key index per object) and their slots."""

    __slots__ = ("keys", "todo", "segs", "offs", "src", "nbytes", "depths", "route", "plan", "crc_job", "crc_out",
                 "crcs", "good", "pre", "puts", "conf", "gen", "recorded", "lost", "absent", "src_align")  # fmt: skip

    def __init__(self, keys, todo, segs, offs, addrs, lens, depths, route):
        self.keys, self.todo, self.segs, self.offs, self.depths, self.route = keys, todo, segs, offs, depths, route
        self.src = np.ascontiguousarray(addrs, np.uint64)
        self.nbytes = np.ascontiguousarray(lens, np.int64)
        self.plan = self.crc_job = self.crc_out = self.crcs = self.pre = None
        self.puts = None  # the LMDB (key, record) pairs of every object, made while the data lands
        self.conf = None  # RECORD_DTYPE per object as it reads once synced (strict; zero where not recorded)
        self.good = np.zeros(len(todo), bool)
        self.recorded = np.zeros(len(todo), bool)  # its record went into the segment's area
        self.lost = np.zeros(len(todo), bool)  # its record block did not land
        self.gen = 0
        self.absent = None  # (key map, its adds) when every key was found absent then (put_publish.py)
        self.src_align = 0  # every source address and length is a multiple of it (0: not known)

    def key(self, j: int) -> str:
        return self.keys[int(self.todo[j])]


class PutPath:
    async def put_many(self, keys: list[str], buffers: list, *, depths: list[int] | None = None) -> list[bool]:
        """Store ``buffers[i]`` under ``keys[i]``; one bool per key, True once the object is published.

        ``keys``: str keys (any non-empty str up to the index's key limit; SGLang's component keys).
        ``buffers``: per key a contiguous host buffer (numpy array, torch CPU tensor, memoryview, mmap;
        1 byte .. ``max_object_bytes``: one segment less 4 KiB) or an ``(address, nbytes)`` pair inside
        a range given to ``register_memory``; CUDA buffers go through GPUDirect Storage where the
        machine has it. A larger object is refused before anything is reserved or evicted.
        ``depths``: optional int32 per key, the page's position in its prefix (``prefix_aware``
        eviction evicts the deepest first).

        True: the bytes are on the file and the key is visible (strict durability: fdatasynced too). A
        key already stored answers True, keeps its first bytes and becomes recently used; a key given
        twice in one call is written once. False: that key alone failed - a bad key, a refused buffer
        (each logged once per call with the reason), an I/O error, ENOSPC or a timeout (logged, counted
        in ``stats()``), or the store is closed. I/O problems never raise.

        Raises ReadOnlyStoreError on a store opened read-only and ValueError when ``buffers`` or
        ``depths`` do not have one entry per key.
        """
        results = self._begin_call("put_many", keys, buffers, depths, writes=True)
        if results is None:
            return [False] * len(keys)
        n = len(keys)
        if self._loading() and not await self._loaded_for_write(PUT_WAIT_S):  # loading.py
            self.state.counters["puts_refused_loading"] += n
            return results
        self._enter()
        try:
            await self._put(keys, buffers, self._depth_array(depths, n), results)
        except Exception:  # noqa: BLE001 - never an exception for an I/O problem
            log.exception("%s: put_many failed", self.path)
        finally:
            self._leave()
        self.state.counters["puts"] += sum(results)
        self.state.counters["put_failed"] += n - sum(results)
        return results

    @staticmethod
    def _depth_array(depths, n: int):
        """depths as int32[] (one C conversion), or a list with None where a depth is not an int32
        (that key alone is refused); None when the caller passed none."""
        if depths is None:
            return None
        try:
            a = np.asarray(depths)
            if a.shape == (n,) and a.dtype.kind in "iu" and (not n or (a.min() >= INT32_MIN and a.max() < INT32_END)):
                return a.astype(np.int32, copy=False)
        except (TypeError, ValueError, OverflowError):
            pass
        out = []
        for d in depths:
            v = int_arg(d)
            out.append(v if v is not None and INT32_MIN <= v < INT32_END else None)
        return out

    async def _put(self, keys, buffers, depths, results) -> None:
        n = len(keys)
        refused = Refusals("put_many")
        bad_depth = depths is not None and type(depths) is list
        fast = None if bad_depth else self._put_fast_prep(keys, buffers)
        if fast is not None:
            # every key new and distinct, every buffer a registered (address, nbytes) pair
            await self._write_objects(keys, np.arange(n, dtype=np.int64), fast[0], fast[1], depths, results, refused,
                                      absent=fast[2], src_align=fast[3])  # fmt: skip
            refused.log(n)
            return
        plain = plain_keys(keys)
        host, dev, again, dups = self._sort_puts(keys, buffers, depths, plain, bad_depth, results, refused)
        if again:
            # before this batch evicts anything: SGLang re-puts the prefixes it keeps hot
            self.state.counters["put_dedup"] += len(again)
            self.writer.rows.tick[again] = self._tick()
            admit_gate.used(self, [self.writer.rows.key[r] for r in again])
        if host[0]:
            todo, addrs, lens = host
            await self._write_objects(
                keys, np.asarray(todo, np.int64), np.asarray(addrs, np.uint64), np.asarray(lens, np.int64),
                depths, results, refused,
            )  # fmt: skip
        if dev[0]:
            await self._put_device(keys, dev, depths, results, refused)
        for i, j in dups:
            results[i] = results[j]
        refused.log(n)

    def _sort_puts(self, keys, buffers, depths, plain, bad_depth, results, refused):
        """Key by key: refused, already stored (``again``: their rows), a duplicate in this batch
        (``dups``: (i, first i)), or to write from host or device memory ((todo, addrs, lens) each)."""
        host, dev = ([], [], []), ([], [], [])
        first_of: dict[str, int] = {}
        dups: list[tuple[int, int]] = []
        max_key = self.state.index.max_key_bytes
        max_obj = min(self.writer.alloc.max_object_bytes, OBJECT_BYTES_END - 1)
        known = self.writer.keys.get
        again: list[int] = []
        for i, k in enumerate(keys):
            if not plain:
                why = key_error(k)
                if why is not None:
                    refused.add(k, why)
                    continue
            if bad_depth and depths[i] is None:
                refused.add(k, "depth is not an int in the int32 range")
                continue
            r = known(k)
            if r is not None:
                results[i] = True  # the first bytes stay; the re-put makes the key recently used
                again.append(r)
                continue
            if k in first_of:
                dups.append((i, first_of[k]))
                continue
            first_of[k] = i
            r = self.state.memory.resolve(buffers[i], writable=False)
            if isinstance(r, str):
                refused.add(k, r)
                continue
            addr, nb, on_device = r
            if nb <= 0 or nb > max_obj:  # before any slot is reserved: a put that cannot fit evicts nothing
                refused.add(k, f"object of {nb} bytes; this store takes 1..{max_obj} bytes (its segments of "
                               f"{self.segment_bytes} bytes keep their last 4 KiB for the slots' records): split it, "
                               "or put it in a store with larger ssd_segment_size_bytes")  # fmt: skip
                continue
            if len(k) * 4 > max_key and len(encode_key(k)) > max_key:
                refused.add(k, f"key longer than {max_key} bytes")
                continue
            todo, addrs, lens = dev if on_device else host
            todo.append(i)
            addrs.append(addr)
            lens.append(nb)
        return host, dev, again, dups

    async def _put_device(self, keys, dev, depths, results, refused) -> None:
        todo, addrs, lens = dev
        try:
            route = await self._gds_route()
        except OSError as e:  # EngineUnavailable: this machine cannot do GPU I/O
            for i in todo:
                refused.add(keys[i], str(e))
            return
        if route:
            await self._write_objects(
                keys, np.asarray(todo, np.int64), np.asarray(addrs, np.uint64),
                np.asarray(lens, np.int64), depths, results, refused, route=route,
            )  # fmt: skip

    def _put_fast_prep(self, keys, buffers):
        """(addrs, lens, (key map, its adds), the alignment of every source or 0) when the batch needs
        no per-key decision: every key a new, distinct ASCII str short enough (one native pass), every
        buffer an (address, nbytes) pair of a valid size inside a registered range (one more). None
        otherwise (the general path decides key by key)."""
        if not keys or type(keys) is not list:
            return None
        kd = self.writer.keys
        absent = (kd, kd.adds)
        if not kd.fresh(keys, self.state.index.max_key_bytes):  # ASCII: a char is a byte
            return None
        max_obj = min(self.writer.alloc.max_object_bytes, OBJECT_BYTES_END - 1)
        got = self.state.memory.resolve_sources(buffers, max_obj, SLOT_ALIGN_BYTES)
        if got is None:
            return None
        return got[0], got[1], absent, SLOT_ALIGN_BYTES if got[2] else 0

    async def _write_objects(self, keys, todo, addrs, lens, depths, results, refused, route: str | None = None,
                             absent=None, src_align: int = 0) -> None:
        """Reserve slots, write, [fdatasync], publish. ``route``: None (host memory), 'gds' or 'staging'.

        ``todo``: int64 key index per object; ``addrs`` uint64, ``lens`` int64, one per object.
        ``absent``: (key map, its adds) when every key was found absent then (_put_fast_prep).
        ``src_align``: every address and length is a multiple of it (0: not known).
        """
        todo, addrs, lens = admit_gate.screen(self, keys, todo, addrs, lens, results)  # admission (issue 26)
        if not len(todo):
            return
        segs, offs, failed_create = await self._reserve(lens)
        have = segs >= 0
        stuck = await self._retire_changed(segs[have], lens[have]) if have.any() else ()
        if stuck:
            lost = have & np.isin(segs, list(stuck))
            self.writer.alloc.free_many(segs[lost], offs[lost])
            for j in np.flatnonzero(lost).tolist():
                refused.add(keys[int(todo[j])], "an earlier record write to its segment is stuck")
            have &= ~lost
        if not have.all():
            why = "no space" + (" (segment file could not be created)" if failed_create else "")
            quiet = self.writer.space_limit_segments is not None  # space.py said why, once
            for j in np.flatnonzero(~have & (segs < 0)).tolist():
                refused.add(keys[int(todo[j])], why, quiet)
            ok_j = np.flatnonzero(have)
            if not len(ok_j):
                return
            segs, offs, todo, addrs, lens = segs[ok_j], offs[ok_j], todo[ok_j], addrs[ok_j], lens[ok_j]
        b = WriteBatch(keys, todo, segs, offs, addrs, lens, depths, route)
        b.absent, b.src_align = absent, src_align
        b.gen = self._tick()  # in the records written now: generations order puts on disk too
        try:
            await self._write(b, refused)
            if b.crc_job is not None:
                await wait_out(b.crc_job)
                b.crcs = b.crc_out
            if b.crcs is None:  # the device write failed
                b.crcs = np.zeros(len(todo), np.uint32)
            if b.route is not None and b.good.any():  # host batches wrote their records beside the data
                await self._write_records(b, refused)
            if self.strict and b.good.any():
                await self._sync_written(b)
        except BaseException:
            self._unrecord(b, np.flatnonzero(b.recorded))
            await self._abort(b)
            raise
        if b.plan is not None:
            b.plan.release(self.state.bounce)
        await self._publish(b, results, refused)

    async def _write(self, b: WriteBatch, refused) -> None:
        """Stage, checksum and write the batch; ``b.good`` says which objects are on the file."""
        files, segs, m = self.state.files, b.segs, len(b.todo)
        fds = files.batch(segs)
        if b.route is None and b.src_align and b.src_align % int(files.align.max()) == 0:
            b.plan = staging.unbounced(b.src, b.nbytes)  # every file takes these addresses and lengths as they are
        elif b.route is None:
            # O_DIRECT needs aligned memory and whole blocks: stage the rest through a bounce buffer
            b.plan = staging.plan(self.state.bounce, files.direct[segs], files.align[segs], b.src, b.nbytes)
        else:  # device memory: kvikio / staging do their own alignment
            b.plan = staging.StagePlan(b.src, b.nbytes, b.src, b.nbytes, None, None)
        plan = b.plan
        loop = asyncio.get_running_loop()
        if b.route is None:
            # CRC over the caller's memory (GIL released) while the disk reads the same memory: it
            # costs no wall time unless it outlasts the write. While reads are about, on a
            # low-priority worker (never ahead of a get's completion); else a large batch's on the
            # executor and a small one's on the loop once the write is submitted (below), as the
            # hand-off to a thread and back costs ~200 us of CPU. See put_crc.py.
            b.crc_out = np.empty(m, np.uint32)
            b.crc_job = put_crc.dispatch(self.state.arbiter, self.state.crc32c_many, b.src, b.nbytes, b.crc_out,
                                         INLINE_CRC_BYTES, self.config)
        if plan.bounced:
            # the thread owns the bounce buffer until it returns, even if our caller gives up
            await wait_out(loop.run_in_executor(None, plan.copy_in))
        async with self.writer.write_sem:
            task = None
            try:
                if b.route is None:
                    write = self.writer.write_engine.write_many(fds, b.offs, plan.io_addr, plan.io_len)
                else:
                    write = self._write_device(b.route, fds, b.offs, plan.io_addr, plan.io_len)
                task = asyncio.ensure_future(write)
                rec = None
                if b.route is None:
                    # the write task submits within the next loop passes (one when it goes as one
                    # run or unsliced; a sliced write: one pass to cut the slices, one for their
                    # tasks to submit); the CRC must not hold the loop before that, or the device
                    # idles for a CRC chunk (engine/arbiter.write_sliced).
                    arb = self.state.arbiter
                    whole = arb.stats["write_whole"] if arb is not None else 0
                    await asyncio.sleep(0)
                    if arb is not None and arb.enabled and arb.stats["write_whole"] == whole:
                        await asyncio.sleep(0)
                    if b.crc_job is None:
                        await self._crc_inline(b)
                    # once the CRCs are in, the records go out while the data is still landing:
                    # the fdatasync after both covers both, and a record whose data did not land
                    # is unconfirmed, so a rebuild checks it against the data
                    rec = await self._records_early(b, refused)
                res = await self._await_io(task, "write", segs)
                self._note_written(b, res, refused)
                if rec is not None:
                    await self._records_landed(b, rec, refused)
            except Exception as e:  # noqa: BLE001 - EngineClosed, validation: the batch fails
                log.error("%s: write batch failed: %s", self.path, e)
                b.good[:] = False
            finally:
                if task is not None and not task.done():
                    # an error or our caller's cancellation: the device may still read the
                    # caller's memory and write these slots; they stay ours until it is done
                    task.cancel()
                    await settle(task)

    async def _crc_inline(self, b: WriteBatch) -> None:
        """A small batch's CRCs on the loop thread: at most INLINE_CRC_CHUNK bytes (or one object) per
        C call, other tasks run between calls."""
        ends = np.cumsum(b.nbytes)
        m, lo = len(ends), 0
        while lo < m:
            start = int(ends[lo] - b.nbytes[lo])
            hi = max(lo + 1, int(np.searchsorted(ends, start + INLINE_CRC_CHUNK, "right")))
            self.state.crc32c_many(b.src[lo:hi], b.nbytes[lo:hi], b.crc_out[lo:hi])
            lo = hi
            if lo < m:
                await asyncio.sleep(0)

    def _note_written(self, b: WriteBatch, res, refused) -> None:
        if res is None:
            for j in range(len(b.todo)):
                refused.add(b.key(j), f"write outlived io_timeout_s={self.timeout_s:g} s")
            return
        if b.route is not None:
            res, dev_crcs = res
            b.crcs = np.asarray(dev_crcs, np.uint32)
        b.good = good = res == b.plan.io_len
        if not good.all():
            bad = np.flatnonzero(~good)
            for j in bad[:1].tolist():
                refused.add(b.key(j), f"write failed: {errno_name(int(res[j]))}")
            for j in bad[1:].tolist():
                refused.add(b.key(j), "write failed")

    async def _sync_written(self, b: WriteBatch) -> None:
        """fdatasync every segment the batch wrote; objects in a segment that failed are not durable."""
        segs = b.segs
        g = segs[b.good]
        touched = [int(g[0])] if len(g) and (g == g[0]).all() else np.unique(g).tolist()  # one segment: the common batch
        sync = self.writer.write_engine.sync
        fdl = self.state.files.fds
        if len(touched) == 1:
            try:
                if _ASYNCIO_TIMEOUT:  # 3.11+: no task per sync, as wait_for makes on 3.11
                    async with asyncio.timeout(self.timeout_s):
                        await sync(int(fdl[touched[0]]))
                else:  # Python 3.10 has no asyncio.timeout
                    await asyncio.wait_for(sync(int(fdl[touched[0]])), self.timeout_s)
                done = [None]
            except Exception as e:  # noqa: BLE001 - incl. timeout
                done = [e]
        else:
            done = await asyncio.gather(
                *(asyncio.wait_for(sync(int(fdl[s])), self.timeout_s) for s in touched), return_exceptions=True
            )
        for s, r in zip(touched, done):
            if isinstance(r, BaseException):  # incl. timeout: nothing in that segment is durable
                log.error("%s: fdatasync of segment %d failed: %r", self.path, s, r)
                if isinstance(r, OSError) and not isinstance(r, TimeoutError):  # a timeout is counted apart
                    self.state.counters["io_errors_sync"] += 1
                b.good &= segs != s

    async def _abort(self, b: WriteBatch) -> None:
        """Cancelled (or failed) before publishing: nothing of the batch is published, and no I/O
        or copy into the slots or the bounce runs any more (waited out in _write)."""
        try:
            if b.crc_job is not None:
                await settle(b.crc_job)  # it reads the caller's memory
        finally:
            self.writer.alloc.free_many(b.segs, b.offs)
            if b.plan is not None:
                b.plan.release(self.state.bounce)

    async def _write_device(self, route: str, fds, offs, addrs, lens):
        """(results, crcs) for a write from CUDA memory; the CRC is computed on a host copy."""
        from ..engine import gds

        if route == "gds":
            crcs = await gds.device_crc32c_many(addrs, lens)
            return await self.state.gds_gate.engine.write_many(fds, offs, addrs, lens), crcs
        # staging: device -> aligned host bounce -> O_DIRECT write of whole blocks
        blen, starts, bounce = staging.device_layout(self.state.bounce, lens)
        try:
            host = np.uint64(bounce.address) + starts.astype(np.uint64)
            crc32c = self.state.crc32c
            pairs = list(zip(addrs.tolist(), host.tolist(), lens.tolist()))

            def stage() -> list[int]:
                gds._device_ops.copy_d2h(pairs)
                for _, h, n in pairs:
                    ctypes.memset(h + n, 0, -n % SLOT_ALIGN_BYTES)
                return [crc32c((h, n)) for _, h, n in pairs]

            # the thread writes the bounce buffer until it returns
            crcs = await wait_out(asyncio.get_running_loop().run_in_executor(None, stage))
            res = await self.writer.write_engine.write_many(fds, offs, host, blen)
            return np.where(res == blen, lens, np.minimum(res, lens)), np.asarray(crcs, np.uint32)
        finally:
            self.state.bounce.put(bounce)
