"""The get lifecycle: look up -> pin -> read (staged where O_DIRECT needs it) -> verify (CRC) ->
unpin -> [readers: recheck the generation] -> account.

A writer pins the rows it reads so no eviction reuses their slots meanwhile. A reader in another
process cannot pin: it checks the CRC and that each key still has the generation it looked up
once the read is done. A mixin of PageStore.

Reads: state.files, state.read_engine, state.memory, state.crc32c*, state.verify_crc,
state.gds_gate, writer.rows. Changes: writer.rows (pins while reading, recency of hits),
state.bounce (borrowed, given back), state.counters; drops damaged entries (deletes.py).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from ..buffers import AlignedBuffer
from . import admit_gate, staging
from .checks import Refusals
from .index import FLAG_CRC
from .get_device import DeviceReads
from .get_verify import INLINE_PART_BYTES, ReadChecks
from .lookups import Hits, ReadBatch
from .staging import settle

log = logging.getLogger("umbp_nvme.store")

PART_BYTES_MIN = 1 << 20  # a read sub-batch moves at least this much (its submit and wake-up cost ~tens of us)
PARTS_MAX = 8
READ_PARTS_IN_FLIGHT = 3  # read sub-batches submitted at a time (see _read)
# A batch of at most SMALL_BATCH_BYTES is read in parts of at most about PART_BYTES (at most
# SMALL_PARTS_MAX), all of them in flight at once. Measured on the virtio disk (64 KiB objects,
# 16 MiB calls): three parts in flight at a time moved 0.8x the raw engine's bytes (the device
# starved between parts), all parts at once 0.94x; sixteen 1 MiB parts then moved more than one
# submission of the whole batch (merged into 4 MiB requests, which that disk served slower). A part costs ~40-50 us of CPU (its engine
# batch, a wait, a verify call): on a RAM-backed device (issue 36) 16 parts of 1 MiB cost 13.6 us
# per 64 KiB object, 4 of 4 MiB 11.5 us; on the virtio disk 4 MiB parts moved 0.87x the raw engine
# against 0.82x for 1 MiB ones in the same hour (docs/benchmarks.md). One 16 MiB part checked on
# the loop thread (INLINE_PART_BYTES) then cost 0.84x the CPU of four 4 MiB parts on the RAM device
# and moved more bytes (one process, batches alternated).
SMALL_BATCH_BYTES = 64 << 20
PART_BYTES = 16 << 20
SMALL_PARTS_MAX = 32


def part_bounds(m: int, nbytes: int) -> list[int]:
    """Split m reads into sub-batches verified as each completes: a few large ones, then smaller
    ones, so the CRC left to do after the last completion is a small fraction of the batch."""
    if m == 0:
        return [0]
    p = max(1, min(PARTS_MAX, m // 8, nbytes // PART_BYTES_MIN))
    if p == 1:
        return [0, m]
    # weights 2,2,...,2,1,1: the last two parts are half size
    w = np.array([2] * (p - 2) + [1, 1], np.float64)
    edges = np.rint(np.concatenate([[0], np.cumsum(w)]) / w.sum() * m).astype(int)
    return sorted(set(edges.tolist()))


def read_parts(lens: np.ndarray) -> tuple[list[int], int]:
    """(part bounds, parts in flight at a time) for reads of ``lens`` bytes: a small batch in
    parts of at most about PART_BYTES, all in flight; a larger one as part_bounds splits it, a few at a time."""
    m = len(lens)
    nbytes = int(lens.sum()) if m else 0
    if nbytes > SMALL_BATCH_BYTES:
        bounds = part_bounds(m, nbytes)
        return bounds, READ_PARTS_IN_FLIGHT
    p = max(1, min(SMALL_PARTS_MAX, m, -(-nbytes // PART_BYTES)))  # a part holds <= PART_BYTES (+ one op)
    if p == 1:
        return ([0, m] if m else [0]), 1
    # equal bytes per part (an op is never split): the op ending nearest each p-th of the bytes
    ends = np.cumsum(lens)
    cuts = np.searchsorted(ends, np.arange(1, p) * (nbytes / p), side="left") + 1
    bounds = sorted({0, m, *np.clip(cuts, 1, m - 1).tolist()})
    return bounds, len(bounds) - 1


class GetPath(DeviceReads, ReadChecks):
    async def get_many(self, keys: list[str], buffers: list) -> list[bool]:
        """Read the object of ``keys[i]`` into ``buffers[i]``; one bool per key, True on a verified hit.

        ``buffers``: per key a writable contiguous host buffer (numpy array, torch CPU tensor,
        memoryview, mmap) at least as large as the object, or an ``(address, nbytes)`` pair inside a
        registered range; CUDA buffers go through GPUDirect Storage where the machine has it. The object
        lands at the start of the buffer.

        True: the buffer holds exactly the bytes stored under the key (CRC32C-checked unless
        ``verify_crc`` is off). False: a miss - the key is absent, or that key alone failed: a bad key
        or a buffer that is refused or too small (logged once per call with the reason), an I/O error
        or timeout, a checksum mismatch (the damaged entry is dropped), or the store is closed. A
        buffer whose key is False may have been partly written. I/O problems never raise.

        Raises ValueError when ``buffers`` does not have one entry per key.
        """
        results = self._begin_call("get_many", keys, buffers)
        if results is None:
            return [False] * len(keys)
        if self._loading():  # loading.py: misses until the index is loaded
            self._loading_misses(len(keys))
            self.state.counters["gets"] += len(keys)
            self.state.counters["misses"] += len(keys)
            return results
        self._enter()
        try:
            await self._get(keys, buffers, results)
        except Exception:  # noqa: BLE001
            log.exception("%s: get_many failed", self.path)
        finally:
            self._leave()
        n, hits = len(keys), sum(results)
        self.state.counters["gets"] += n
        self.state.counters["hits"] += hits
        self.state.counters["misses"] += n - hits
        if hits:
            admit_gate.used(self, keys, None if hits == n else results)
        return results

    def _destinations(self, b: ReadBatch, keys, buffers, refused) -> None:
        """Resolve the caller's buffer per object; keep the usable ones, host memory first, CUDA last."""
        m, n = len(b), len(keys)
        files = self.state.files
        dst = self.state.memory.resolve_reads(buffers, b.idx, b.lens, b.segs, files.direct, files.align)
        if dst is not None:
            b.dst, b.aligned = dst, True
            return
        pair = self.state.memory.resolve_pairs(buffers if m == n else [buffers[i] for i in b.idx.tolist()])
        if pair is not None and not (pair[1] < b.lens).any():
            b.dst = pair[0]
            return
        dst = np.zeros(m, np.uint64)
        ok = np.ones(m, bool)
        devm = np.zeros(m, bool)
        for j, i in enumerate(b.idx.tolist()):
            r = self.state.memory.resolve(buffers[i], writable=True)
            if isinstance(r, str):
                refused.add(keys[i], r)
                ok[j] = False
                continue
            if r[1] < b.lens[j]:
                refused.add(keys[i], f"buffer of {r[1]} bytes is smaller than the {int(b.lens[j])}-byte object")
                ok[j] = False
                continue
            dst[j] = r[0]
            devm[j] = r[2]
        b.dst, b.devm = dst, devm
        if not ok.all() or devm.any():
            b.keep(np.concatenate([np.flatnonzero(ok & ~devm), np.flatnonzero(ok & devm)]))

    async def _get(self, keys, buffers, results) -> None:
        refused = Refusals("get_many")
        b = self._lookup(keys)
        if b is None:
            return
        self._destinations(b, keys, buffers, refused)
        m = len(b)
        if not m:
            refused.log(len(keys))
            return
        m_host = m if b.devm is None else m - int(b.devm.sum())
        route = None
        if m_host < m:
            try:
                route = await self._gds_route()
            except OSError as e:
                for j in range(m_host, m):
                    refused.add(keys[int(b.idx[j])], str(e))
        conf = during = None  # writers: a hash hit is confirmed by its row's record (keymap.py)
        box: list = []
        if self.writer is not None:
            if self._one_host_part(b, m_host, route):
                # the data's batch is submitted first: what confirming its hits takes is found while it is in flight
                during = lambda: box.append(self._hits_during(b, keys))  # noqa: E731
            else:
                conf = await self._confirm_begin(b, keys, self._records_in_memory(b))
        try:
            outcome = await self._read(b, m_host, route, during)
            if outcome is None:
                return  # timed out: counted and logged by _await_io
            good, verified = outcome
            if self.writer is None:
                verified &= self._unchanged(b, keys)
            else:  # another key's row (a hash collision): a miss, neither a hit nor damage
                if box and isinstance(box[0], asyncio.Future):
                    conf = box.pop()
                if conf is not None:
                    mine = await conf
                else:  # none when the comparison failed (logged): nothing is confirmed
                    mine = box[0] if box else np.zeros(m, bool)
                good &= mine
                verified &= mine
        finally:
            for t in (conf, *box):  # a timed-out or cancelled read: its record reads end too
                if isinstance(t, asyncio.Future) and not t.done():
                    t.cancel()
                    await settle(t)
        await self._account(b, keys, good, verified, results, refused)

    def _hits_during(self, b: ReadBatch, keys):
        """While the data is in flight: whether each row holds its key, or where a record must be
        read (after an open), a task reading those blocks as a batch of their own and answering that."""
        if self._records_in_memory(b):
            return Hits(self.writer.keys, b, keys).answer()
        return asyncio.ensure_future(self._confirmed(b, keys))

    @staticmethod
    def _one_host_part(b: ReadBatch, m_host: int, route) -> bool:
        """The whole batch goes to host memory in one engine batch (read_parts makes one part): it is
        submitted before anything its hits' confirmation needs is looked at (_hits_during); otherwise
        _confirm_begin starts that confirmation first."""
        return route is None and m_host == len(b) and int(b.lens.sum()) <= PART_BYTES

    async def _read(self, b: ReadBatch, m_host: int, route, during=None):
        """Pin, read, verify, unpin: (complete, verified) per object; None when the read timed out.
        ``during``: called once the engine batch is submitted, while it is in flight (one part)."""
        m = len(b)
        rows = b.rows
        if rows is not None:
            self.writer.rows.pin(rows)
        plan = None
        good = np.zeros(m, bool)
        verified = np.zeros(m, bool)
        try:
            files = self.state.files
            if b.aligned:
                plan = staging.unbounced(b.dst, b.lens)
            else:
                plan = staging.plan(self.state.bounce, files.direct[b.segs], files.align[b.segs], b.dst, b.lens, b.devm)
            jobs = [self._read_parts(b, plan, m_host, good, verified, during)] if m_host else []
            if route is not None:
                jobs.append(self._read_device_part(b, route, m_host, m, good, verified))
            timed_out = False
            if len(jobs) == 1:
                try:
                    await jobs[0]
                    outcome = ()
                except Exception as e:  # noqa: BLE001
                    outcome = (e,)
            else:
                outcome = await asyncio.gather(*jobs, return_exceptions=True)
            for r in outcome:
                if isinstance(r, asyncio.TimeoutError):
                    timed_out = True
                elif isinstance(r, BaseException):
                    log.error("%s: read batch failed: %r", self.path, r)
                    verified[:] = False
            if timed_out:
                return None
        finally:
            # Every engine await above has ended, timed out or cancelled or not (_await_io and
            # the engines wait for the kernel's completions; _read_parts waits for its parts and
            # workers): no read into these slots, the bounce or the caller's memory is in flight.
            if rows is not None:
                self.writer.rows.unpin(rows)
            if plan is not None:
                plan.release(self.state.bounce)
        return good, verified

    async def _read_parts(self, b: ReadBatch, plan, m_host: int, good, verified, during=None) -> None:
        """Read host ops [0, m_host) in parts (read_parts: how many, how many in flight) and verify
        the objects of each part as soon as its read completes, so the CRC overlaps the rest's I/O.
        Raises the first part's failure (a TimeoutError first) once no part is in flight."""
        bounds, window = read_parts(b.lens[:m_host])
        if len(bounds) == 2 or during is not None:  # during: _one_host_part said one part
            return await self._read_one_part(b, plan, m_host, good, verified, during)
        todo = list(zip(bounds, bounds[1:]))[::-1]
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        running: dict[asyncio.Future, tuple[int, int, asyncio.Future]] = {}  # wait -> (lo, hi, engine batch)
        failures: list[BaseException] = []
        try:
            while True:
                self._start_parts(b, plan, todo, running, window - len(running) if not failures else 0, deadline)
                if not running:
                    break
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                ready = []
                for t in done:
                    lo, hi, _ = running.pop(t)
                    if t.cancelled() or t.exception() is not None:
                        failures.append(asyncio.CancelledError() if t.cancelled() else t.exception())
                        continue
                    res, got = t.result() if type(t.result()) is tuple else (t.result(), None)
                    good[lo:hi] = res >= b.lens[lo:hi]  # the object must come back whole; more is padding
                    ready.append((np.arange(lo, hi), got))
                # refill the window before verifying: the device works while the CRCs run
                self._start_parts(b, plan, todo, running, window - len(running) if not failures else 0, deadline)
                # parts small enough to check on the loop thread one by one (in chunks, the loop
                # turns between them), the rest together on a worker: a hop costs ~100-200 us of CPU
                late = []
                for k, (sel, got) in enumerate(ready):
                    if got is None and (plan.bounced or int(b.lens[sel].sum()) > INLINE_PART_BYTES):
                        late.append(sel)
                        continue
                    if k and got is None:
                        await asyncio.sleep(0)
                    verified[sel] = await self._verify(b, plan, sel, good[sel], got)
                if late:
                    sel = late[0] if len(late) == 1 else np.concatenate(late)
                    verified[sel] = await self._verify(b, plan, sel, good[sel])
        except BaseException:
            # cancelled (or failed) while parts are in flight: they own the memory until they end.
            # The engine batches too: a wait cancelled before its first step never awaits its batch.
            tasks = [x for t, (_, _, io) in running.items() for x in (t, io)]
            for t in tasks:
                t.cancel()
            if tasks:
                await settle(asyncio.gather(*tasks, return_exceptions=True))
            raise
        if failures:
            raise next((e for e in failures if isinstance(e, asyncio.TimeoutError)), failures[0])

    async def _read_one_part(self, b: ReadBatch, plan, m: int, good, verified, during=None) -> None:
        """_read_parts for a batch read in one part (the common small batch): its engine batch
        awaited directly, no wait task or asyncio.wait per part (each costs loop turns)."""
        eng = self.state.read_engine
        args = self._read_args(b, plan, 0, m)
        started = io = None
        if args[1] is not None and hasattr(eng, "start_read_crc"):  # submitted now: no loop pass before the device starts
            started = eng.start_read_crc(*args[0], args[1])
        if started is None:
            io = self._engine_read(b, plan, 0, m, args)
        if during is not None:
            if io is not None:
                await asyncio.sleep(0)  # its task's first step submits the batch
            try:
                during()
            except Exception:  # noqa: BLE001 - the batch is in flight: it is awaited all the same
                log.exception("%s: confirming a get's hits failed", self.path)
        if started is not None:
            res = await self._await_started(eng, started, "read", b.segs[:m], self.timeout_s)
        else:
            res = await self._await_io(io, "read", b.segs[:m], self.timeout_s)  # returns once the batch has ended
        if res is None:
            raise asyncio.TimeoutError
        res, got = res if type(res) is tuple else (res, None)
        good[:m] = ok = res >= b.lens[:m]  # the object must come back whole; more is padding
        if got is not None and m == len(b) and got.min(initial=0) >= 0:  # every CRC computed as its read completed
            verified[:] = ok & ((got == b.crcs) | ((b.flags & FLAG_CRC) == 0))
        else:
            verified[:m] = await self._verify(b, plan, np.arange(m), ok, got)

    def _engine_read(self, b: ReadBatch, plan, lo: int, hi: int, args=None) -> asyncio.Future:
        """The engine batch reading ops [lo, hi) (``_read_args``), as a task."""
        (files, offs, addrs, lens), crc_lens = self._read_args(b, plan, lo, hi) if args is None else args
        eng = self.state.read_engine
        if crc_lens is None:
            return asyncio.ensure_future(eng.read_many(files, offs, addrs, lens))
        return asyncio.ensure_future(eng.read_many_crc(files, offs, addrs, lens, crc_lens))

    def _read_args(self, b: ReadBatch, plan, lo: int, hi: int):
        """((files, offsets, addresses, lengths), CRC lengths or None) of the engine batch reading
        ops [lo, hi). Where the engine can (io_uring) and nothing is bounced, it also returns each
        object's CRC, computed as its read completes: the checksums run while the rest of the batch
        is in flight instead of after its last completion (on a RAM-backed device that was
        ~0.5-0.8 ms of a 16 MiB batch's ~5 ms, issue 36)."""
        segs, offs, addrs, lens = b.segs[lo:hi], b.offs[lo:hi], plan.io_addr[lo:hi], plan.io_len[lo:hi]
        args = (self.state.files.batch(segs), offs, addrs, lens)
        # a part over INLINE_PART_BYTES is checked on a worker once read (the loop's core stays free)
        if (not hasattr(self.state.read_engine, "read_many_crc") or plan.bounced or not self.verify_crc
                or int(b.lens[lo:hi].sum()) > INLINE_PART_BYTES):  # fmt: skip
            return args, None
        return args, np.where((b.flags[lo:hi] & FLAG_CRC) != 0, b.lens[lo:hi], 0).astype(np.int64)

    def _start_parts(self, b: ReadBatch, plan, todo: list, running: dict, k: int, deadline: float) -> None:
        """Start up to k parts from ``todo``: their engine batches first, so the next loop step
        submits them back to back (a disk that serves what is queued together, as this one does,
        then takes all of them in one go), then one timed wait per part."""
        if k <= 0 or not todo:
            return
        if asyncio.get_running_loop().time() >= deadline:  # an earlier part stalled the window
            raise asyncio.TimeoutError
        started = [todo.pop() for _ in range(min(k, len(todo)))]
        io = [self._engine_read(b, plan, lo, hi) for lo, hi in started]
        for (lo, hi), task in zip(started, io):
            running[asyncio.ensure_future(self._wait_part(task, b.segs[lo:hi], deadline))] = (lo, hi, task)

    async def _wait_part(self, task: asyncio.Future, segs: np.ndarray, deadline: float):
        """A part's engine result; TimeoutError once it outlived the call's deadline (and ended)."""
        left = deadline - asyncio.get_running_loop().time()
        res = await self._await_io(task, "read", segs, max(left, 0.0))
        if res is None:
            raise asyncio.TimeoutError
        return res

    async def _account(self, b: ReadBatch, keys, good, verified, results, refused) -> None:
        """Results and counters; a writer drops entries whose bytes failed the CRC and stamps hits."""
        idx, lens, m, n = b.idx, b.lens, len(b), len(keys)
        every = bool(verified.all())
        if every:
            if m == n:
                results[:] = [True] * n
            else:
                for i in idx.tolist():
                    results[i] = True
            self.state.counters["bytes_read"] += int(lens.sum())
        else:
            for i in idx[verified].tolist():
                results[i] = True
            self.state.counters["bytes_read"] += int(lens[verified].sum())
        bad_crc = [] if every else np.flatnonzero(good & ~verified).tolist()
        writer = self.writer is not None
        if bad_crc and writer:
            bad_crc = await self._confirm_bad(b, bad_crc, keys, refused)
        if bad_crc:
            self.state.counters["crc_errors"] += len(bad_crc)
            for j in bad_crc[:1]:
                refused.add(keys[int(idx[j])], "checksum mismatch (entry dropped)" if writer else "checksum or generation mismatch")
        if writer:
            rows, t = b.rows, self.writer.rows
            if bad_crc:
                drop = [
                    int(rows[j]) for j in bad_crc
                    if t.live[rows[j]] and t.key[rows[j]] == keys[int(idx[j])]
                ]  # fmt: skip
                await self._drop_rows(sorted(set(drop)), evicted=False)
            hit_rows = rows if every else rows[verified]
            if len(hit_rows):
                t.tick[hit_rows] = self._tick()
        refused.log(len(keys))

    async def _confirm_bad(self, b: ReadBatch, bad: list[int], keys, refused) -> list[int]:
        """The ops of ``bad`` whose stored copy is really damaged: each is read again into memory of
        our own and checked. A copy that verifies there stays stored (answered False all the same):
        the caller's buffers overlapped or were written during the get, which must not cost a page."""
        sel = np.asarray(bad, np.int64)
        sub = ReadBatch(*(a[sel] for a in (b.idx, b.segs, b.offs, b.lens, b.crcs, b.flags, b.gens, b.rows)))
        blen = -(-sub.lens // 4096) * 4096
        try:
            buf = AlignedBuffer(int(blen.sum()))
        except (OSError, MemoryError) as e:  # no memory for a second look: the copy cannot be vouched for
            log.error("%s: cannot re-read %d objects that failed their CRC: %s", self.path, len(sel), e)
            return bad
        try:
            sub.dst = np.uint64(buf.address) + np.concatenate([[0], np.cumsum(blen)[:-1]]).astype(np.uint64)
            outcome = await self._read(sub, len(sub), None)  # returns only once no read is in flight
        finally:
            buf.close()
        if outcome is None:
            return bad  # the device timed out: it cannot vouch for the copy
        intact = outcome[0] & outcome[1]
        if intact.any():
            refused.add(keys[int(sub.idx[np.flatnonzero(intact)[0]])],
                        "checksum mismatch in the caller's buffer; the stored copy verified (overlapping "
                        "destination buffers, or memory written during the get?)")  # fmt: skip
        return sel[~intact].tolist()
