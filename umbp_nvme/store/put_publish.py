"""Publishing a put batch: one index commit for its objects that are on the file (and durable,
strict), their rows added so they are served; the slots of the rest given back. A commit that
outlives io_timeout_s or is cancelled leaves the batch in doubt (put_doubt.py). A mixin of PageStore.

Reads: writer.commit_lock, state.index (through _commit). Changes: writer.rows and writer.keys
(the new rows), writer.alloc (slots given back), writer.areas (records confirmed later),
writer.residency (told the keys shown), state.counters.
"""

from __future__ import annotations

import asyncio

import numpy as np

from .index import FLAG_CRC
from .records import record_values


class PutPublish:
    async def _publish(self, b: WriteBatch, results, refused) -> None:
        """One index commit for the batch's good objects not published meanwhile; the rest's slots freed.
        A commit that outlives io_timeout_s (or is cancelled) leaves the batch in doubt (put_doubt.py)."""
        m = len(b.todo)
        gen = b.gen
        committed = begun = False
        try:
            async with self.writer.commit_lock:
                pj = np.flatnonzero(b.good)
                # todo is increasing: every key of the call written means todo[pj] is 0..n-1
                full = len(pj) == m == len(b.keys)
                pub_idx = range(m) if full else b.todo[pj].tolist()
                pub_keys = b.keys if full else [b.keys[i] for i in pub_idx]
                kd = self.writer.keys
                # every key found absent and no key mapped since: none can have been published meanwhile
                since = b.absent[1] if b.absent is not None and b.absent[0] is kd else None
                if since is not None and since != kd.adds:
                    since = None
                if since is None and len(pub_keys) and int(kd.rows(pub_keys).max()) >= 0:  # one native lookup
                    keep = [t for t, k in enumerate(pub_keys) if k not in kd]
                    pj = pj[keep]
                    pub_idx = [pub_idx[t] for t in keep]
                    pub_keys = [pub_keys[t] for t in keep]
                    full = False
                if full and b.puts is not None:  # the common batch: records and puts made during the write
                    recs, puts = b.pre[0], b.puts
                else:
                    recs, enc = self._records(b, pj, pub_idx, pub_keys, gen)
                    puts = list(zip(enc, record_values(recs)))
                begun = True
                try:
                    committed = await self._commit(puts) if puts else True
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    self._put_doubt_hold(b, pj, pub_keys, recs, puts, results)  # may still land
                    for i in pub_idx:
                        refused.add(b.keys[i], "index commit outlived io_timeout_s (in doubt)")
                    raise
                if committed and len(pj):
                    self._add_rows(b, pj, pub_keys, recs, gen, since)
                if committed and puts and self.writer.put_doubt:  # every earlier commit has landed or failed
                    self._put_doubt_settle()
        except asyncio.TimeoutError:
            return
        except asyncio.CancelledError:
            if not begun:  # cancelled before its commit began: nothing of it can land
                self._put_give_back(b, np.arange(m))
            raise
        published = np.zeros(m, bool)
        if committed:
            published[pj] = True
            if full:
                results[:] = [True] * len(results)
            else:
                for i in pub_idx:
                    results[i] = True
            if b.conf is not None and len(pj):  # their fdatasync completed: the next image of their blocks says so
                c = pj[b.recorded[pj]]
                self.writer.areas.confirm_later(b.conf if len(c) == m else b.conf[c])
            elif not self.strict and len(pj):  # relaxed: confirmed when their segment is settled (flushing.py)
                self._note_published(b.segs[pj], b.offs[pj], b.nbytes[pj], gen)
        rest = np.flatnonzero(~published)
        if len(rest):
            self._unrecord(b, rest)
            self.writer.alloc.free_many(b.segs[rest], b.offs[rest])
            for j in rest.tolist():
                if b.good[j]:
                    i = int(b.todo[j])
                    if not committed:
                        refused.add(b.keys[i], "index commit failed")
                    else:
                        results[i] = True  # another put of the same key published first: keep its bytes

    def _add_rows(self, b: WriteBatch, pj, pub_keys, recs, gen, absent_since: int | None = None) -> None:
        t = self.writer.rows
        rows = t.new(len(pj))
        whole = len(pj) == len(b.segs)  # pj is increasing: every object, in order
        sel = slice(None) if whole else pj
        t.fill(rows, b.segs[sel], b.offs[sel], b.nbytes[sel], recs["crc"], FLAG_CRC, gen, recs["depth"])
        t.index.set_rows(pub_keys, rows, absent_since=absent_since)  # each row holds its key, mapped to it
        if self.writer.residency is not None:
            self.writer.residency.shown(pub_keys)
        self.state.counters["bytes_written"] += int(b.nbytes[pj].sum())
