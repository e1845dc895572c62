"""Waiting for the engine: every wait on I/O ends only once the kernel has let go of the memory.

A mixin of PageStore (the put and get paths call ``_await_io``); it counts and logs stalls.

Reads: state.timeout_s. Changes: state.counters (timeouts, io_errors_*), state.stalled_ops,
state.late_completions, state.stalled_wait_s.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from .segments import segment_name
from .staging import settle

log = logging.getLogger("umbp_nvme.store")


class IoWaits:
    async def _await_io(self, task: asyncio.Future, what: str, segs: np.ndarray, timeout_s: float | None = None):
        """The engine's result for ``task``, or None when it outlived io_timeout_s.

        Either way this returns only once the engine batch has ended: until then the kernel may
        still read or write the caller's memory, the slots and the bounce buffer. At the timeout
        the stall is counted and logged once with its segments and the engine is asked to cancel
        (io_uring tries IORING_OP_ASYNC_CANCEL; block I/O usually runs on to its end or to the
        block layer's timeout, and the wait goes on). A cancellation of our caller waits the same
        way (awaiting a task that is cancelled waits for its end). One timer per call: no
        wait_for/shield futures on the hot path.
        """
        stalled_at = None

        def on_timeout() -> None:
            nonlocal stalled_at
            if task.done():
                return
            stalled_at = self._stalled(what, segs)
            task.cancel()

        h = asyncio.get_running_loop().call_later(self.timeout_s if timeout_s is None else timeout_s, on_timeout)
        try:
            res = await task
            out = res[0] if type(res) is tuple else res  # the device write path returns (res, crcs)
            if isinstance(out, np.ndarray) and out.min(initial=0) < 0:
                self.state.counters[f"io_errors_{what}"] += int(np.count_nonzero(out < 0))
            return res
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if stalled_at is None or (me is not None and me.cancelling()):
                if not task.done():  # our caller gave up: the engine batch still owns the memory
                    task.cancel()
                    await settle(task)
                raise
            return None  # our own timeout: the batch has ended (task is done)
        finally:
            h.cancel()
            if stalled_at is not None and task.done():
                self._stall_ended(segs, stalled_at)

    async def _await_started(self, eng, batch, what: str, segs: np.ndarray, timeout_s: float):
        """_await_io for a batch the engine submitted already (``eng.start_read_crc``): its
        (results, CRCs), or None when it outlived ``timeout_s`` (then its ops are cancelled and the
        wait goes on until they have ended). A cancellation of our caller waits the same way."""
        stalled_at = None

        def on_timeout() -> None:
            nonlocal stalled_at
            if batch.left:
                stalled_at = self._stalled(what, segs)
                eng.abandon(batch)

        h = asyncio.get_running_loop().call_later(timeout_s, on_timeout)
        try:
            res = await eng.finish_read(batch)  # returns only once the batch has ended
        finally:
            h.cancel()
            if stalled_at is not None and not batch.left:
                self._stall_ended(segs, stalled_at)
        if stalled_at is not None:
            return None
        if res[0].min(initial=0) < 0:
            self.state.counters[f"io_errors_{what}"] += int(np.count_nonzero(res[0] < 0))
        return res

    def _stalled(self, what: str, segs: np.ndarray) -> float:
        """Count and log a batch that outlived io_timeout_s; the time it did."""
        n = len(segs)
        self.state.counters["timeouts"] += 1
        self.state.stalled_ops += n
        u = np.unique(segs)
        names = ", ".join(segment_name(int(x)) for x in u[:4].tolist()) + (" ..." if len(u) > 4 else "")
        log.error(
            "%s: %s of %d objects outlived io_timeout_s=%.1f s on %s; cancelling it and waiting for the "
            "kernel to give back the memory", self.path, what, n, self.timeout_s, names,
        )  # fmt: skip
        return time.monotonic()

    def _stall_ended(self, segs: np.ndarray, stalled_at: float) -> None:
        self.state.late_completions += len(segs)
        self.state.stalled_wait_s = max(self.state.stalled_wait_s, time.monotonic() - stalled_at)
