"""Making a writer's store durable on demand: ``flush`` (and at close ``flush_for_close``):
data fdatasynced, every record of this session confirmed and its block written, then the index
synced. A mixin of PageStore.

A relaxed writer also settles each segment its puts fill, in the background: the segment's data
fdatasynced, then the records of the puts published in it before the sync confirmed and their
blocks written, while those blocks are still in memory. Otherwise they leave memory unconfirmed
and the flush at close reads every one back (~1.7 s per 1 M objects put this session).

Reads: state.files, state.index, writer.rows, writer.open_clock, writer.write_engine,
writer.index_pool. Changes: writer.areas (records confirmed, dirty blocks written), state.counters.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

log = logging.getLogger("umbp_nvme.store")


class FlushSteps:
    def _note_published(self, segs, offs, lens, gen: int) -> None:
        """Relaxed: puts just published (their data landed), to be confirmed when their segment is
        settled; a segment they filled is settled now."""
        w = self.writer
        a = w.alloc
        segs = np.asarray(segs, np.int64)
        for s in np.unique(segs).tolist():
            m = segs == s
            todo = w.unsettled.setdefault(s, [0, []])
            todo[0] += int(m.sum())
            todo[1].append((np.asarray(offs)[m], np.asarray(lens)[m], gen))
            c = a.seg_class[s]
            # full, or as many puts as it has slots since its last settle (one that churns and never fills)
            if c and (a.seg_used[s] >= a.slots(c) or todo[0] >= a.slots(c)) and s not in w.settles:
                task = asyncio.ensure_future(self._settle_segment(s))
                w.settles[s] = task
                task.add_done_callback(lambda _t, s=s: w.settles.pop(s, None))

    async def _settle_segment(self, s: int) -> None:
        """Sync segment ``s``'s data, then confirm the records of the puts published in it before
        the sync (a slot reused since holds another generation and is left alone) and write their
        blocks. Best effort: what it does not confirm, the flush does."""
        w = self.writer
        todo = w.unsettled.pop(s, [0, []])[1]
        if not todo:
            return
        try:
            await asyncio.wait_for(w.write_engine.sync(int(self.state.files.fds[s])), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the flush confirms them instead
            log.debug("%s: settling segment %d: the sync failed: %r", self.path, s, e)
            return
        offs = np.concatenate([o for o, _, _ in todo])
        lens = np.concatenate([n for _, n, _ in todo])
        gens = np.concatenate([np.full(len(o), g, np.uint64) for o, _, g in todo])
        w.areas.confirm(np.full(len(offs), s, np.int64), offs, lens, gens)
        blocks = {(s, b) for b in w.areas.dirty.get(s, ())}
        if blocks:
            await w.areas.write(w.write_engine, self.state.files, blocks, self.timeout_s)

    async def _stop_settles(self) -> None:
        """At close, before its flush (which confirms everything): no settle runs on into it."""
        if self.writer is None:
            return
        tasks = list(self.writer.settles.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.writer.unsettled.clear()

    async def flush(self) -> bool:
        """fdatasync every segment and the index. True when all of it is durable."""
        if self.state.closed:
            self._closed_call("flush")
            return False
        if self.writer is None:
            return True
        if self._loading() and not await self._loaded_for_write(None):  # loading.py
            return False
        return await self._flush()

    async def flush_for_close(self) -> bool:
        """``flush`` that never raises (close uses it): True when data, records and index are durable."""
        # a clean close leaves data, records (all confirmed) and index durable
        try:
            return await self._flush()
        except Exception as e:  # noqa: BLE001 - closing must not raise for a flush
            log.warning("%s: flush at close failed: %s", self.path, e)
            return False

    async def _flush(self) -> bool:
        """Data durable, then every record confirmed and its block written, then synced again."""
        w = self.writer
        t = w.rows
        # only this session's puts can be unconfirmed (strict ones were confirmed at publish)
        live = (t.live[: t.n] & (t.gen[: t.n] > w.open_clock)).nonzero()[0] if t is not None else []
        snap = (t.seg[live].copy(), t.off[live].copy(), t.len[live].copy(), t.gen[live].copy()) if len(live) else None
        w.unsettled.clear()  # every put published so far is in the snapshot
        ok = await self._sync_all()
        dead = dict(w.areas.dead)
        failed: set[int] = set()
        wrote = False
        if ok and snap is not None:
            # a segment at a time: the record blocks a confirmation brings back into memory leave
            # again once written (record_areas.py), so a flush never holds every block at once
            order = np.argsort(snap[0], kind="stable")
            cut = np.flatnonzero(np.diff(snap[0][order])) + 1
            for js in np.split(order, cut):
                # blocks that left memory unconfirmed come back through the read engine, not on the loop
                if not await w.areas.fetch(self.state.read_engine, self.state.files, *(v[js] for v in snap[:3]),
                                           self.timeout_s, only_unconfirmed=True):  # fmt: skip
                    ok = False  # those records stay unconfirmed: a rebuild checks them against their data
                w.areas.confirm(*(v[js] for v in snap))
                s = int(snap[0][js[0]])
                blocks = {(s, b) for b in w.areas.dirty.get(s, ())}
                if blocks:
                    failed |= await w.areas.write(w.write_engine, self.state.files, blocks, self.timeout_s)
                    wrote = True
        dirty = w.areas.dirty_blocks()
        if dirty or wrote:
            if dirty:
                failed |= await w.areas.write(w.write_engine, self.state.files, dirty, self.timeout_s)
            synced = await self._sync_all()
            ok = synced and ok and not failed
            if synced:
                w.areas.forget_dead(dead, set(self.state.files.files) - failed)
        try:
            await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(w.index_pool, self.state.index.sync), self.timeout_s
            )
        except Exception as e:  # noqa: BLE001
            log.error("%s: index sync failed: %s", self.path, e)
            ok = False
        return ok

    async def _sync_all(self) -> bool:
        # all segments at once: a slow disk costs one io_timeout_s, not one per segment
        segs = list(self.state.files.files)
        done = await asyncio.gather(
            *(asyncio.wait_for(self.writer.write_engine.sync(int(self.state.files.fds[s])), self.timeout_s) for s in segs),
            return_exceptions=True,
        )
        ok = True
        for s, r in zip(segs, done):
            if isinstance(r, BaseException):
                log.error("%s: fdatasync of segment %d failed: %r", self.path, s, r)
                if isinstance(r, OSError) and not isinstance(r, TimeoutError):  # a timeout is counted apart
                    self.state.counters["io_errors_sync"] += 1
                ok = False
        return ok
