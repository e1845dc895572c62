"""An event loop on virtual time: a test's sleeps and timers run in order, never against the wall clock.

``loop.time()`` starts at 0 and moves only when nothing is ready to run: it then jumps to the next
timer. So "sleep 12 ms, then look" sees exactly what 12 ms of the program's own steps produce,
however loaded the machine is (a FakeDevice that sleeps per MiB and an ``Arbiter(clock=loop.time)``
share that clock). Only for code that waits on timers and futures of this loop: a wait on a thread
or a file descriptor with no timer pending is reported as a deadlock instead of blocking.
"""

from __future__ import annotations

import asyncio
import selectors


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.now_s = 0.0
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now_s


class _JumpingSelector(selectors.DefaultSelector):
    """select(timeout) answers what is ready now; if nothing is, time jumps by ``timeout``."""

    def __init__(self, loop: VirtualClockLoop):
        super().__init__()
        self.loop = loop

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None:
            raise RuntimeError("virtual-time loop: nothing ready and no timer pending (the test would hang)")
        self.loop.now_s += timeout
        return []


def run_virtual(main):
    """Run ``main(loop)`` (a coroutine function) to its end on a fresh VirtualClockLoop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main(loop))
    finally:  # as asyncio.run: what a failed assertion left running is cancelled and awaited
        loop.run_until_complete(_cancel_all())
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _cancel_all() -> None:
    left = asyncio.all_tasks() - {asyncio.current_task()}
    for t in left:
        t.cancel()
    await asyncio.gather(*left, return_exceptions=True)
