"""A SyncPageStore's loop thread held busy, so a test can tell a call that hops onto it from one
that does not: a call that returns while the loop is held never waited for the loop."""

from __future__ import annotations

import contextlib
import threading


@contextlib.contextmanager
def loop_held(loop, cap_s: float = 30.0):
    """Hold ``loop`` (another thread's running loop) inside the block; yields ``freed``, an Event
    set once the loop runs again (at the block's end, or after ``cap_s`` should a call inside wait
    for the loop: such a call returns only after ``freed`` is set)."""
    held, release, freed = threading.Event(), threading.Event(), threading.Event()

    def hold():
        held.set()
        release.wait(cap_s)
        freed.set()

    loop.call_soon_threadsafe(hold)
    assert held.wait(cap_s), "the store's loop never ran the hold"
    try:
        yield freed
    finally:
        release.set()
        freed.wait(cap_s)
