"""The store's use of the records in its segments (records.py): a put batch's records, giving
back the records of slots that go back unpublished, tombstones for deletes, the areas at open,
and the rebuild of the index at open (rebuild.py). A mixin of PageStore.

Reads: state.files, state.hooks, writer.rows, writer.write_engine, OpenFacts at open. Changes: writer.areas
(records, tombstones), state.index (a rebuild at open), state.manifest (migration).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import lmdb
import numpy as np

from ..errors import StoreError
from . import layout
from .checks import encode_all
from .index import FLAG_CRC, FLAG_KEYCRC, REC_DTYPE, Index, key_crcs, wrap_lmdb_error
from .layout import MANIFEST_FILE
from .rebuild import boot_id, clear_area, rebuild_index, write_area
from .row_keys import WriterKeys
from .record_areas import RecordAreas
from .records import R_VALID, RECORD_DTYPE, area_of, batch_records, confirmed_copy, make_records, record_values
from .segments import segment_name
from .state import OpenFacts
from .staging import wait_out

log = logging.getLogger("umbp_nvme.store")


class RecordSteps:
    async def _records_early(self, b, refused):
        """Once the batch's CRCs are in, its records go out while its data is still landing: the
        fdatasync after both covers both, and a record whose data did not land is unconfirmed,
        so a rebuild checks it against the data. Returns the records' write task."""
        if b.crc_job is not None:  # None: computed on the loop thread already
            await wait_out(b.crc_job)
        b.crcs = b.crc_out
        await self._fetch_records(b)  # before the task, whose records go in at its first step
        return asyncio.ensure_future(self._write_records(b, refused, early=True))

    async def _fetch_records(self, b) -> None:
        """Record blocks of freed slots in old segments (a store at capacity) come back beside the
        data through the read engine, never by a read on the loop thread: an object whose block
        could not be read back (a stalled or failing drive) gets no record and is refused."""
        a = self.writer.areas
        if not await a.fetch(self.state.read_engine, self.state.files, b.segs, b.offs, b.nbytes, self.timeout_s):
            b.lost |= a.out(b.segs, b.offs, b.nbytes)

    async def _records_landed(self, b, rec, refused) -> None:
        await asyncio.shield(rec)  # never raises; keeps running if our caller gives up
        for j in np.flatnonzero(b.good & b.lost)[:1].tolist():
            refused.add(b.key(j), "index record write failed")
        b.good &= ~b.lost

    async def _write_records(self, b, refused, early: bool = False) -> None:
        """Each written object's record (``early``: every object's, its data still in flight) into
        its segment's area, the touched blocks written; an object whose block did not land is not
        durable (``b.lost``; the fdatasync after covers records and data). Early, the batch's LMDB
        puts and confirmed records are made here too, so publishing after the sync only copies."""
        if not early:  # device batches: their data landed first
            await self._fetch_records(b)
        m = len(b.todo)
        j = np.flatnonzero(~b.lost if early else b.good & ~b.lost)
        if early:  # every record of the batch in one C pass (records.batch_records)
            enc = encode_all(b.keys, b.todo.tolist())
            recs48, recs, conf = batch_records(enc, b.segs, b.offs, b.nbytes, self._batch_depths(b), b.crcs, b.gen,
                                               REC_DTYPE, self.strict)  # fmt: skip
            b.pre = (recs48, enc)
            b.puts = list(zip(enc, record_values(recs48)))
            b.conf = conf
            recs = recs if len(j) == m else recs[j]
        else:
            recs48, enc = b.pre if b.pre is not None else self._pack_pending(b)
            sub, keys = recs48[j], [enc[i] for i in j.tolist()]
            recs = make_records(b.segs[j], b.offs[j], b.nbytes[j], b.gen, b.crcs[j], sub["depth"], sub["key_crc"], keys,
                                R_VALID)  # fmt: skip
            if self.strict:
                conf = np.zeros(m, RECORD_DTYPE)
                conf[j] = confirmed_copy(recs)
                b.conf = conf
        touched = self.writer.areas.put(recs)
        b.recorded[j] = True
        failed = await self.writer.areas.write(self.writer.write_engine, self.state.files, touched, self.timeout_s)
        if failed:
            b.lost |= np.isin(b.segs, list(failed))
        if not early and b.lost.any():  # early: the data write's outcome is not known yet (_write reports)
            for k in np.flatnonzero(b.lost & b.good)[:1].tolist():
                refused.add(b.key(k), "index record write failed")
            b.good &= ~b.lost

    def _unrecord(self, b, js) -> None:
        """Clear the records of objects whose slots go back unpublished (rewritten with the next
        write of their blocks; a rebuild meanwhile checks them against their data)."""
        js = np.asarray(js, np.int64)
        if len(js) and b.recorded[js].any():
            js = js[b.recorded[js]]
            touched, _ = self.writer.areas.clear(b.segs[js], b.offs[js], b.nbytes[js])
            self.writer.areas.mark_dead(touched)  # on disk before any delete or clear is acknowledged
            b.recorded[js] = False

    async def _retire_changed(self, segs, lens) -> set[int]:
        """Segments the allocator just gave a new size class: their old record area is brought to
        disk as memory has it (no record left: every slot was freed) and forgotten before the new
        class's data goes in, where its blocks lie; a block write of the old area landing later
        would zero the new class's objects. Returns the segments that could not be retired."""
        a = self.writer.areas
        changed = []
        if len(segs) and segs[0] == segs[-1] and (segs == segs[0]).all():  # the usual batch: one segment
            old = a.size_class(int(segs[0]))
            if old is not None and old != -(-int(lens[0]) // layout.SLOT_ALIGN_BYTES) * layout.SLOT_ALIGN_BYTES:
                changed.append(int(segs[0]))
        else:
            cls = (-(-np.asarray(lens, np.int64) // layout.SLOT_ALIGN_BYTES)) * layout.SLOT_ALIGN_BYTES
            for s in np.unique(segs).tolist():
                old = a.size_class(s)
                if old is not None and old != int(cls[np.flatnonzero(segs == s)[0]]):
                    changed.append(s)
        failed = set()
        for s in changed:
            busy = a.busy(s)
            if busy:
                _, late = await asyncio.wait(busy, timeout=self.timeout_s)
                if late:
                    failed.add(s)
                    continue
            blocks = {(s, blk) for blk in a.dirty.get(s, ())}
            if blocks and await a.write(self.writer.write_engine, self.state.files, blocks, self.timeout_s):
                failed.add(s)
                continue
            a.drop(s)
        if failed:
            log.error("%s: the old record areas of segments %s could not be retired; their puts are refused",
                      self.path, sorted(failed))  # fmt: skip
        return failed

    def _records(self, b, pj, pub_idx, pub_keys, gen):
        """(index records, encoded keys) of the objects ``pj`` of the batch, stamped with ``gen``."""
        if b.pre is not None:
            all_recs, enc_keys = b.pre
            full = len(pj) == len(b.todo)
            recs = all_recs if full else all_recs[pj]
            enc = enc_keys if full else [enc_keys[j] for j in pj.tolist()]
        else:
            depths = b.depths
            recs = np.zeros(len(pj), REC_DTYPE)
            recs["segment"], recs["length"], recs["offset"] = b.segs[pj], b.nbytes[pj], b.offs[pj]
            recs["depth"] = -1 if depths is None else np.asarray([int(depths[i]) for i in pub_idx], np.int32)
            recs["flags"] = FLAG_CRC | FLAG_KEYCRC
            enc = encode_all(pub_keys)
            recs["key_crc"] = key_crcs(enc)
        recs["generation"] = recs["group"] = gen
        recs["crc"] = b.crcs[pj]
        return recs, enc

    @staticmethod
    def _batch_depths(b) -> np.ndarray:
        """Each object's depth (int32; -1 where the call gave none)."""
        depths = b.depths
        if depths is None:
            return np.full(len(b.todo), -1, np.int32)
        if isinstance(depths, np.ndarray):
            return depths[b.todo]
        return np.asarray([depths[i] for i in b.todo.tolist()], np.int32)

    @staticmethod
    def _pack_pending(b):
        """(records, encoded keys) for every object of a write batch, CRC and generation left 0."""
        todo = b.todo
        recs = np.zeros(len(todo), REC_DTYPE)
        recs["segment"], recs["length"], recs["offset"] = b.segs, b.nbytes, b.offs
        todo_l = todo.tolist()
        recs["depth"] = RecordSteps._batch_depths(b)
        recs["flags"] = FLAG_CRC | FLAG_KEYCRC
        enc = encode_all(b.keys, todo_l)
        recs["key_crc"] = key_crcs(enc)
        return recs, enc

    async def _tombstone(self, rows) -> list | None:
        """Clear the rows' records in their segments durably (strict: fdatasync), together with the
        records of puts that never published (``RecordAreas.dead``), so no rebuild after this
        delete can bring back a key it removed; the undo list, or None when a block write or sync
        failed (the records are restored in memory). Through ``StoreHooks.tombstone`` when given."""
        hook = self.state.hooks.tombstone
        if hook is not None:
            return await hook(self._tombstone_now, self, rows)
        return await self._tombstone_now(rows)

    async def _tombstone_now(self, rows) -> list | None:
        t = self.writer.rows
        # blocks that left memory since the drop named its keys: read back through the engine, not on the loop
        if not await self.writer.areas.fetch(self.state.read_engine, self.state.files, t.seg[rows], t.off[rows],
                                             t.len[rows], self.timeout_s):  # fmt: skip
            log.error("%s: the records of %d objects to clear could not be read back; the objects stay", self.path,
                      len(rows))  # fmt: skip
            return None
        touched, undo = self.writer.areas.clear(t.seg[rows], t.off[rows], t.len[rows])
        dead = dict(self.writer.areas.dead)
        touched |= set(dead)
        if not touched:
            return undo
        failed = await self.writer.areas.write(self.writer.write_engine, self.state.files, touched, self.timeout_s)
        segs = sorted({s for s, _ in touched})
        if not failed and self.strict:
            done = await asyncio.gather(
                *(asyncio.wait_for(self.writer.write_engine.sync(int(self.state.files.fds[s])), self.timeout_s) for s in segs),
                return_exceptions=True,
            )
            failed = {s for s, r in zip(segs, done) if isinstance(r, BaseException)}
        self.writer.areas.forget_dead(dead, set(segs) - set(failed))
        if failed:
            log.error("%s: clearing %d records in segments %s failed; the objects stay", self.path, len(rows),
                      sorted(failed))  # fmt: skip
            self.writer.areas.restore(undo)
            self.writer.areas.mark_dirty(touched)
            return None
        return undo

    def _load_records(self, keys: list, recs: np.ndarray, o: OpenFacts) -> None:
        """The record areas in memory, from the rows; brought to disk where it may be behind.

        After a rebuild, an unclean close or for a store made before the records (migrated here,
        then the manifest says so): the data is fdatasynced first, so every record may say
        confirmed, then every area is written and synced. A clean open writes nothing.
        """
        self.writer.areas = RecordAreas(self.segment_bytes, self._read_record_blocks, self._segment_class,
                                        int(self.config.ssd_record_cache_bytes))  # fmt: skip
        src = self.writer.keys.source = WriterKeys(self)  # the keys are on disk, their hashes in memory
        n = len(keys)
        if not (o.migrate or o.rebuilt or o.unclean):
            return
        src.open_keys = keys  # rows 0..n-1 hold these while every area is written
        try:
            self._write_all_areas(o, n)
        finally:
            src.open_keys = None

    def _write_all_areas(self, o: OpenFacts, n: int) -> None:
        t0 = time.perf_counter()
        segs = sorted(self.state.files.files)
        for s in segs:
            os.fdatasync(self.state.files.files[s].fd)
        for s in segs:  # one segment's area in memory at a time, from the rows (the open's keys)
            recs = self.writer.keys.source.open_records(s)
            area, cls = area_of(self.segment_bytes, recs) if recs is not None else (None, 0)
            write_area(os.path.join(self.path, segment_name(s)), self.segment_bytes, area, cls)
        # segments without an object may still hold records of puts that never published (killed
        # between their records and the commit): cleared, or a later rebuild would adopt them
        n_segments = self.capacity_bytes // self.segment_bytes
        for s, name in sorted(layout.segment_files(self.path).items()):
            if s < n_segments and s not in self.state.files.files:
                clear_area(os.path.join(self.path, name), self.segment_bytes)
        if o.migrate:
            self.manifest["layout"]["record_bytes"] = layout.SEGMENT_RECORD_BYTES
            layout.write_manifest(os.path.join(self.path, MANIFEST_FILE), self.manifest)
            self.state.index.set_writer_state(b"open:" + boot_id())
        log.warning("%s: wrote the record areas of %d segments (%d records, %s) in %.2f s", self.path, len(segs), n,
                    "migrated to records in the segments" if o.migrate else "after a rebuild or unclean close",
                    time.perf_counter() - t0)  # fmt: skip
        o.migrate = False

    def _segment_class(self, seg: int) -> int | None:
        """The size class of segment ``seg``'s published objects (so of its records on disk); None: it has none."""
        t = self.writer.rows
        first = np.flatnonzero(t.live[: t.n] & (t.seg[: t.n] == seg))[:1]
        return -(-int(t.len[first[0]]) // layout.SLOT_ALIGN_BYTES) * layout.SLOT_ALIGN_BYTES if len(first) else None

    def _read_record_blocks(self, seg: int, offset: int, bufs) -> int:
        """Record blocks of segment ``seg`` read at ``offset`` into ``bufs`` (whole pages: O_DIRECT takes them)."""
        fds = self.state.files.fds
        if not 0 <= seg < len(fds) or fds[seg] < 0:
            raise OSError(f"segment {seg} has no open file")
        return os.preadv(int(fds[seg]), bufs, offset)

    def _rebuild_from_segments(self, ipath: str, map_size: int, why: str, o: OpenFacts, *, damaged: bool) -> None:
        """Write a new index from the segments' records, marked as this writer's, and put it at
        the path (the old file, if any, stays there until the new one is complete; then it is
        kept as a damaged copy when ``damaged``, else removed: the records are the truth)."""
        if self.state.index is not None:
            self.state.index.close()
            self.state.index = None
        step = self.state.hooks.rebuild_step
        try:
            rebuild_index(self.path, ipath, self.segment_bytes, self.capacity_bytes // self.segment_bytes, map_size, why,
                          state=b"open:" + boot_id(), old_damaged=damaged, step=step)  # fmt: skip
            self.state.index = Index(ipath, readonly=False, map_size=map_size, durable=False, writemap=True)
        except OSError as e:
            raise StoreError(f"{why}, and rebuilding it from the segments failed: {e}") from None
        except lmdb.Error as e:
            raise wrap_lmdb_error(ipath, e, "rebuilding it from the segments") from None
        if step is not None:
            step("reopened")
        o.scan = self.state.index.scan()
        o.scan_next_gen = max(self.state.index.next_generation(), time.time_ns() // 1000)
        o.rebuilt = why
