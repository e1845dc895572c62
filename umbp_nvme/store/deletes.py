"""Deletes: ``delete_many``, and drops in doubt (a mixin of PageStore).

A drop (page_store._drop_rows: a delete, an eviction, a bad CRC) whose index commit outlived
io_timeout_s may land later, or never; one whose commit failed after its tombstones (the cleared
records in the segments) landed is half done on disk: served again, it would answer from a record
a rebuild no longer has. Both are treated alike. Its keys are already hidden (no new reader pins their rows),
so it is kept *in doubt*: its slots stay out of use, it is not acknowledged, a later delete of the
key or the next eviction retries it (tombstone and commit again: both idempotent), and until one lands
``delete_pending`` reports the key, so an owed delete (drive_probe.py, owed_deletes.py) is not
settled on a drive that may still serve it after a restart.
"""

from __future__ import annotations

import logging

from .checks import begin_call

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
        results = begin_call(self, "delete_many", keys, writes=True)
        if results is None:
            return [False] * len(keys)
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
