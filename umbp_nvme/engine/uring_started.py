"""Reads submitted before the call returns (engine/uring.py's mixin): the store's get path starts
its one engine batch from its own step, with no loop pass between its bookkeeping and the device
(a task's first step comes a loop pass later), and awaits it at once.

The rules of read_many hold: the batch's await returns, cancelled or not, only once none of its
ops is in flight; the arbiter is told a read is in flight from the submission to that return.
"""

from __future__ import annotations

import numpy as np

from .uring_batch import Batch


class StartedReads:
    def start_read_crc(self, files, offsets, addrs, lengths, crc_lens) -> Batch | None:
        """read_many_crc's batch submitted before this returns (no loop pass before the device
        starts: the get path), where it fits the ring as it is; None where not (read_many_crc then).
        Await ``finish_read`` at once: until it returns the kernel owns the memory."""
        crc = (np.ascontiguousarray(crc_lens, dtype=np.int64), np.full(len(crc_lens), -1, np.int64))
        if len(crc[0]) != len(lengths):
            raise ValueError(f"crc_lens has {len(crc[0])} entries for {len(lengths)} ops")
        b = self._start_now(self._u.OP_READ, files, offsets, addrs, lengths, crc)
        if b is not None and self._arbiter is not None:
            b.arbiter = self._arbiter
            b.arbiter.read_started()
        return b

    async def finish_read(self, b: Batch) -> tuple[np.ndarray, np.ndarray]:
        """(results, CRCs) of a start_read_crc batch; returns, cancelled or not, only once none of
        its ops is in flight (as read_many)."""
        try:
            return await self._wait(b), b.crc[1]
        finally:
            if b.arbiter is not None:
                b.arbiter.read_done()

    def abandon(self, b: Batch) -> None:
        """A start_read_crc batch outlived its caller's deadline: its queued ops fail, the running
        ones are asked to cancel; finish_read still returns only once they have ended."""
        if b.left and not b.abandoned and not self._closed:
            b.abandoned = True
            self._drop_unsubmitted(b)
            if b.left == 0:
                self._finish(b)
            else:
                b.cancel_running(self._ring)
