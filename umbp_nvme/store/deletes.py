"""Deletes: ``delete_many``, and drops in doubt (a mixin of PageStore).

A drop (``_drop_rows`` below: a delete, an eviction, a bad CRC) whose index commit outlived
io_timeout_s may land later, or never; one whose commit failed after its tombstones (the cleared
records in the segments) landed is half done on disk: served again, it would answer from a record
a rebuild no longer has. Both are treated alike. Its keys are already hidden (no new reader pins their rows),
so it is kept *in doubt*: its slots stay out of use, it is not acknowledged, a later delete of the
key or the next eviction retries it (tombstone and commit again: both idempotent), and until one lands
``delete_pending`` reports the key, so an owed delete (drive_probe.py, owed_deletes.py) is not
settled on a drive that may still serve it after a restart.

Reads: writer.commit_lock, writer.clock, writer.put_doubt. Changes: writer.keys, writer.rows
(dropped, released), writer.drop_doubt, state.index (commits), writer.areas (tombstones,
record_steps.py), state.counters; tells writer.residency.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from ..keybytes import encode_key

log = logging.getLogger("umbp_nvme.store")


class DeleteSteps:
    def _doubt_now(self, rows: list[int], keys: list[str]) -> None:
        if self.writer.drop_doubt is None:
            self.writer.drop_doubt = {}
        self.writer.drop_doubt.update(zip(rows, keys))

    def _doubt_settled(self, rows: list[int]) -> None:
        if self.writer.drop_doubt:
            for r in rows:
                self.writer.drop_doubt.pop(r, None)

    async def _settle_doubts(self, *, closing: bool = True) -> None:
        """Finish the drops in doubt and settle the puts in doubt (put_doubt.py): at close, so the
        index the next open trusts agrees with the records, and when a put finds no room (their
        slots are not rows eviction can take)."""
        if self.writer.drop_doubt:
            await self._drop_rows(list(self.writer.drop_doubt), evicted=False)
        if not await self._put_doubt_retry() and closing:
            log.warning("%s: %d bytes of puts in doubt at close (the next open trusts the index)", self.path,
                        self.put_doubt_bytes())  # fmt: skip

    async def delete_many(self, keys: list[str]) -> list[bool]:
        """Remove ``keys``; one bool per key, True once that key's removal is durable.

        False: the key was absent (or cannot be a key), the index commit failed (logged; the entry may
        still be there: a later delete retries it), or the store is closed. A key given twice answers
        True once. Raises ReadOnlyStoreError on a store opened read-only.
        """
        results = self._begin_call("delete_many", keys, writes=True)
        if results is None:
            return [False] * len(keys)
        if self._loading() and not await self._loaded_for_write(None):  # loading.py: a key not loaded yet
            log.warning("%s: delete_many of %d keys refused: the index did not load", self.path, len(keys))
            return results
        if self.writer.put_doubt and not self.put_doubt_keys().isdisjoint(k for k in keys if type(k) is str):
            await self._put_doubt_retry()  # settled first: a landed put is then deleted like any other
        rows, where = [], []
        seen = set()
        for i, r in enumerate(self._writer_rows(keys)):
            if r is not None and r not in seen:
                seen.add(r)
                rows.append(r)
                where.append(i)
        if self.writer.drop_doubt:  # a delete of a key in doubt retries its drop
            at: dict[str, int] = {}
            for i, k in enumerate(keys):
                if type(k) is str:
                    at.setdefault(k, i)
            for r, k in list(self.writer.drop_doubt.items()):
                if k in at:
                    rows.append(r)
                    where.append(at[k])
        if rows and await self._drop_rows(rows, evicted=False):
            for i in where:
                results[i] = True
        return results

    def delete_pending(self, keys) -> list[bool]:
        """Writers: per key, whether it is still stored, its delete is in doubt or a put of it is in
        doubt (put_doubt.py): a delete owed for such a key is not settled (drive_probe.py)."""
        held = self.exists_many_nowait(keys)
        if not self.writer.drop_doubt and not self.writer.put_doubt:
            return held
        doubt = set(self.writer.drop_doubt.values()) if self.writer.drop_doubt else set()
        doubt |= self.put_doubt_keys()  # a put in doubt may have landed
        return [h or (type(k) is str and k in doubt) for h, k in zip(held, keys)]

    async def _records_back(self, rows: list[int], evicted: bool) -> list[int]:
        """The rows to drop, their record blocks in memory: read back through the read engine where
        they left (record_areas.py), never by a read on the loop thread, so a stalled drive cannot
        stop the store. Rows dropped, released or reused while the read ran are left out. A row whose
        block could not be read stays: an eviction drops the others; a delete drops nothing (a later
        delete retries it)."""
        w, t = self.writer, self.writer.rows
        r = np.asarray(rows, np.int64)
        if not w.areas.out(t.seg[r], t.off[r], t.len[r]).any():
            return rows
        gen, live, doubt = t.gen[r].copy(), t.live[r].copy(), [x in (w.drop_doubt or ()) for x in rows]
        await w.areas.fetch(self.state.read_engine, self.state.files, t.seg[r], t.off[r], t.len[r], self.timeout_s)
        same = (t.gen[r] == gen) & (t.live[r] == live) & (np.array([x in (w.drop_doubt or ()) for x in rows]) == doubt)
        out = w.areas.out(t.seg[r], t.off[r], t.len[r]) & same
        if out.any():
            log.error("%s: the records of %d of %d objects to %s could not be read back; they stay", self.path,
                      int(out.sum()), len(rows), "evict" if evicted else "delete")  # fmt: skip
            if not evicted:
                return []
        return r[same & ~out].tolist()

    async def _drop_rows(self, rows: list[int], *, evicted: bool) -> bool:
        """Durably remove rows' keys from the index, then free their slots. Caller holds no lock.
        True: dropped; False: nothing dropped (no tombstone landed), the rows serve again; else the
        drop is in doubt (deletes.py: the commit outlived io_timeout_s, was cancelled, or failed
        after the tombstones landed): hidden, not acknowledged, retried by delete_many, an eviction
        or close()."""
        w = self.writer
        if not rows:
            return True
        rows = await self._records_back(rows, evicted)
        if not rows:
            return False
        # the rows' keys from their records, in one pass (the key table holds only hashes: keymap.py)
        keys = [w.drop_doubt.get(r) if w.drop_doubt and r in w.drop_doubt else None for r in rows]
        ask = [j for j, k in enumerate(keys) if k is None]
        if ask:
            for j, k in zip(ask, w.keys.keys_of([rows[j] for j in ask])):
                keys[j] = k
        if None in keys:  # neither its record nor the index names it: nothing to delete by (logged)
            lost = [r for r, k in zip(rows, keys) if k is None]
            log.error("%s: %d rows to drop have no key on disk; hidden, their slots kept", self.path, len(lost))
            w.keys.unmap(lost)
            w.rows.live[lost] = False
            rows = [r for r, k in zip(rows, keys) if k is not None]
            keys = [k for k in keys if k is not None]
            if not rows:
                return False
        mapped = w.keys.mapped(rows)
        was_live = [(r, k) for r, k, m in zip(rows, keys, mapped.tolist()) if m]
        w.keys.unmap([r for r, _ in was_live])  # invisible to new readers first: nothing new pins these rows
        if w.residency is not None:
            w.residency.hidden([k for _, k in was_live])
        w.rows.live[rows] = False
        dels = dict.fromkeys(k for k in keys if k not in w.keys)  # a key put again since a drop in doubt stays
        ok = None  # not known: a commit that outlived io_timeout_s (or a cancelled call) may still land
        try:
            async with w.commit_lock:
                if await self._tombstone(rows) is None:
                    ok = False
                else:  # keys decoded from bytes: always encode
                    ok = await self._commit(deletes=[encode_key(k) for k in dels])
                    if ok and w.put_doubt:  # every earlier commit has landed or failed
                        self._put_doubt_settle()
                    # the tombstones landed but the index still holds the keys: serving them again
                    # would answer from a record a rebuild no longer has (the page is gone after a
                    # restart): the drop stays hidden and in doubt, and a retry finishes it
                    ok = ok or None
        except asyncio.TimeoutError:
            pass
        finally:
            if ok is None:  # in doubt: the slots stay out of use, not acknowledged, retried by a delete
                self._doubt_now(rows, keys)
        if ok:
            self._doubt_settled(rows)
            w.rows.release(rows)
            self.state.counters["evictions" if evicted else "deletes"] += len(rows)
            if evicted and w.drop_doubt:  # then the drops in doubt, apart: their slots come back
                await self._drop_rows(list(w.drop_doubt), evicted=False)
            return True
        if ok is False:  # nothing committed: the entries stand, keep serving them (rows in doubt stay so)
            orphans = []
            for r, k in was_live:
                if k not in w.keys:
                    w.keys[k] = r
                    w.rows.live[r] = True
                else:
                    orphans.append(r)  # re-put meanwhile: the index holds the new record, not this one
            w.rows.release(orphans)
            if w.residency is not None:
                w.residency.shown([k for r, k in was_live if w.keys.get(k) == r])
        return False

    async def clear(self) -> None:
        """Drop every entry durably and free all space (slots being read are freed after the read)."""
        w = self.writer
        if self._begin_call("clear", (), writes=True) is None:
            return
        if self._loading() and not await self._loaded_for_write(None):  # loading.py
            raise OSError(f"{self.path}: clear refused: the index did not load ({self.loading_state()})")
        async with w.commit_lock:
            rows = list(w.keys.values())
            gone = list(w.keys) if w.residency is not None else ()
            # also with no rows: records of puts that never published must not outlive the clear
            if await self._tombstone(rows) is None:
                raise OSError(f"{self.path}: clear could not clear the records in the segments; nothing was dropped")
            w.keys.clear()
            if gone:
                w.residency.hidden(gone)
            w.rows.live[rows] = False
            self.state.index.drop_all(next_generation=w.clock.now + 1)
            w.rows.release(rows)
            self.state.counters["deletes"] += len(rows)
