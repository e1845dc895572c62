"""Checking what a get read: each object's CRC32C against its index record, on the loop thread
for small parts (one C call per INLINE_VERIFY_BYTES, the loop turning between them) or on a worker
for large or bounced ones (copied out to the caller's memory first). A mixin of GetPath
(get_path.py), which calls ``_verify`` as each read part completes.

Reads: state.crc32c_many, verify_crc. Changes: the caller's memory (bounced objects copied out).
"""

from __future__ import annotations

import asyncio

import numpy as np

from .index import FLAG_CRC
from .lookups import ReadBatch
from .staging import wait_out

# Verification of the objects whose reads completed: a part of up to INLINE_VERIFY_BYTES on the loop thread
# (one C call, GIL released: handing them to a worker and back costs ~200 us of CPU, more than the
# CRC of 2 MiB); more goes to a worker so the loop is never blocked for long. (Splitting a large
# set between the loop and a worker gained nothing here: two cores checking freshly read memory
# each ran at half speed.)
INLINE_VERIFY_BYTES = 4 << 20
# A part of up to INLINE_PART_BYTES with nothing bounced is checked on the loop thread too, in
# calls of INLINE_VERIFY_BYTES with the loop turning between them: the worker hop cost more CPU
# than the CRC of a 16 MiB part's last chunk blocks the loop (issue 36, RAM device).
INLINE_PART_BYTES = 16 << 20


class ReadChecks:
    async def _verify(self, b: ReadBatch, plan, sel: np.ndarray, ok: np.ndarray, got=None) -> np.ndarray:
        """Verified per op of ``sel`` (ops whose reads completed): bounced objects copied out and
        CRCs checked, on the loop thread when small and nothing is bounced, else on a worker.
        ``got``: the CRCs the engine computed as the reads completed (-1: not computed), or None."""
        if not self.verify_crc and not plan.bounced:
            return ok
        if got is not None:  # the engine's CRCs; the few it could not compute (a read in pieces) here
            unchecked = (b.flags[sel] & FLAG_CRC) == 0
            if (got < 0).any():
                need = np.flatnonzero(ok & (got < 0) & ~unchecked)
                got = got.copy()
                out = np.empty(len(need), np.uint32)
                self.state.crc32c_many(b.dst[sel[need]], b.lens[sel[need]], out)
                got[need] = out
            return ok & ((got == b.crcs[sel]) | unchecked)
        if not plan.bounced and int(b.lens[sel].sum()) <= INLINE_PART_BYTES:
            return await self._check_inline(b, sel, ok)
        # the thread copies into the caller's memory: wait_out keeps us here until it has ended
        return await wait_out(asyncio.get_running_loop().run_in_executor(None, self._check, b, plan, sel, ok))

    async def _check_inline(self, b: ReadBatch, sel: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """CRCs of ops ``sel`` (nothing bounced) on the loop thread, one C call per
        INLINE_VERIFY_BYTES or so, other tasks running between the calls."""
        lens = b.lens[sel]
        got = np.empty(len(sel), np.uint32)
        ends = np.cumsum(lens)
        lo, m = 0, len(sel)
        while lo < m:
            start = int(ends[lo] - lens[lo])
            hi = max(lo + 1, int(np.searchsorted(ends, start + INLINE_VERIFY_BYTES, "right")))
            if lo:
                await asyncio.sleep(0)
            self.state.crc32c_many(b.dst[sel[lo:hi]], lens[lo:hi], got[lo:hi])
            lo = hi
        return ok & ((got == b.crcs[sel]) | ((b.flags[sel] & FLAG_CRC) == 0))

    def _check(self, b: ReadBatch, plan, sel: np.ndarray, ok: np.ndarray) -> np.ndarray:
        """Copy bounced objects of ``sel`` out, then check their CRCs in one C call (a worker
        thread, or the loop thread for a small share with nothing bounced)."""
        plan.copy_out(sel, ok)
        if not self.verify_crc:
            return ok
        got = np.empty(len(sel), np.uint32)
        self.state.crc32c_many(b.dst[sel], b.lens[sel], got)
        return ok & ((got == b.crcs[sel]) | ((b.flags[sel] & FLAG_CRC) == 0))
