"""Making a writer's store durable on demand: ``flush`` (and at close ``flush_for_close``):
data fdatasynced, every record of this session confirmed and its block written, then the index
synced. A mixin of PageStore.

Reads: state.files, state.index, writer.rows, writer.open_clock, writer.write_engine,
writer.index_pool. Changes: writer.areas (records confirmed, dirty blocks written), state.counters.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

log = logging.getLogger("umbp_nvme.store")


class FlushSteps:
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
