"""Put batches in doubt (a mixin of PageStore).

A put batch whose index commit outlived io_timeout_s, or whose call was cancelled during it, may
have landed or not (put_publish.py). It is answered False and kept *in doubt*: its slots stay
out of use (a reader in another process may see a landed entry), its keys are not served here,
and ``delete_pending`` reports them. LMDB runs one write transaction at a time, so once a later
commit of ours has returned, the one in doubt has landed or failed: the next commit (a put, a
delete or eviction, ``delete_many`` of such a key, ``close``) settles it by reading the index. An
object whose record is there unchanged is adopted (its slot keeps its right bytes); every other
one (not landed, or overwritten by a later put of its key) gives its record and slot back.
Nothing answered True depends on it, and nothing of it is served until its bytes are known.
A batch cancelled before its commit began is known not to have landed: its slots go back at once.

Reads: state.index, writer.keys, writer.commit_lock. Changes: writer.put_doubt, writer.alloc (slots
given back), writer.areas (records cleared or confirmed); adopted objects become rows
(put_publish.py).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

log = logging.getLogger("umbp_nvme.store")


class _Doubt:
    """One batch in doubt: its published-to-be objects ``pj`` (indexes into the batch)."""

    __slots__ = ("b", "pj", "keys", "recs", "puts")

    def __init__(self, b, pj, keys, recs, puts):
        self.b, self.pj, self.keys, self.recs, self.puts = b, pj, keys, recs, puts


class PutDoubt:
    def _put_doubt_hold(self, b, pj, pub_keys, recs, puts, results) -> None:
        """The commit of ``b``'s objects ``pj`` may land later: keep their slots; the rest of the
        batch (not written, or its key published meanwhile) gives its slots back now."""
        rest = np.setdiff1d(np.arange(len(b.todo)), pj)
        self._put_give_back(b, rest)
        kd = self.writer.keys
        for j in rest.tolist():
            i = int(b.todo[j])
            if b.good[j] and b.keys[i] in kd:
                results[i] = True  # another put of the key published first: its bytes stay
        if self.writer.put_doubt is None:
            self.writer.put_doubt = []
        self.writer.put_doubt.append(_Doubt(b, np.asarray(pj), list(pub_keys), recs, puts))
        log.error("%s: index commit of %d objects outlived io_timeout_s=%g s: in doubt (answered False, their "
                  "slots kept until a later commit says whether it landed)", self.path, len(pj), self.timeout_s)

    def _put_give_back(self, b, js) -> None:
        """Objects ``js`` of ``b`` are not published: their records cleared, their slots free."""
        js = np.asarray(js, np.int64)
        if len(js):
            self._unrecord(b, js)
            self.writer.alloc.free_many(b.segs[js], b.offs[js])

    def put_doubt_keys(self) -> set[str]:
        """Keys of puts in doubt (their entry may be in the index)."""
        return {k for d in self.writer.put_doubt or () for k in d.keys}

    def put_doubt_bytes(self) -> int:
        """Bytes of puts in doubt: written, but whether their index commit landed is not known yet."""
        return sum(int(d.b.nbytes[d.pj].sum()) for d in self.writer.put_doubt or ())

    def _put_doubt_settle(self) -> None:
        """After a commit of ours returned True (the caller holds _commit_lock): every earlier
        commit has landed or failed, so each batch in doubt is adopted or given back."""
        pending, self.writer.put_doubt = self.writer.put_doubt or [], None
        for d in pending:
            try:
                got = self.state.index.get_records([k for k, _ in d.puts])
            except Exception as e:  # noqa: BLE001 - cannot tell yet: it stays in doubt
                log.error("%s: reading the index to settle a put in doubt failed: %s", self.path, e)
                self.writer.put_doubt = (self.writer.put_doubt or []) + [d]
                continue
            kd = self.writer.keys
            landed = np.asarray([g == rec and k not in kd for g, (_, rec), k in zip(got, d.puts, d.keys)], bool)
            b, pj = d.b, d.pj
            if landed.any():
                t = np.flatnonzero(landed)
                self._add_rows(b, pj[t], [d.keys[i] for i in t.tolist()], d.recs[t], b.gen)
                if b.conf is not None:  # synced before its commit: the next image of its blocks says so
                    c = pj[t][b.recorded[pj[t]]]
                    if len(c):
                        self.writer.areas.confirm_later(b.conf[c])
            self._put_give_back(b, pj[~landed])
            log.warning("%s: a put in doubt settled: %d objects landed (served), %d given back", self.path,
                        int(landed.sum()), int((~landed).sum()))  # fmt: skip

    async def _put_doubt_retry(self) -> bool:
        """Settle the puts in doubt now with an empty commit; True when none is left."""
        if not self.writer.put_doubt:
            return True
        try:
            async with self.writer.commit_lock:
                if await self._commit():
                    self._put_doubt_settle()
        except asyncio.TimeoutError:
            pass
        return not self.writer.put_doubt
