"""Polling for a condition that a background task (the drive probe, a rejoin) makes true."""

from __future__ import annotations

import asyncio
import time


async def until(pred, timeout_s: float, every_s: float = 0.05) -> bool:
    """True once ``pred()`` holds, polled every ``every_s`` for up to ``timeout_s``; else pred()'s last answer."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(every_s)
    return pred()
