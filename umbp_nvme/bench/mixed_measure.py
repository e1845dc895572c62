"""What a cell of ``bench mixed`` measures, shared with its ``--sglang`` mode (mixed_sglang.py):
the windows of the backup stream, get latency percentiles and rows, the loop-hop probe."""

from __future__ import annotations

import threading
import time

import numpy as np

MAX_LOADED_S = 10.0  # a loaded phase runs more blocks of gets until a backup batch ends inside it
SPACING_X = 4.0  # spaced gets: one call per 4x the idle back-to-back latency (~1/4 of read bandwidth)


def solo_window(marks: list, solo_s: float) -> tuple[float, float]:
    """[t0, t1] of at least ``solo_s`` with a backup batch ended before it and one inside it (up to
    5x longer while none has), so the backup's solo GB/s is never NaN for want of a batch end."""
    while not marks:
        time.sleep(0.01)
    t0 = time.perf_counter()
    time.sleep(solo_s)
    while marks[-1][0] < t0 and time.perf_counter() - t0 < 5 * solo_s:
        time.sleep(0.02)
    return t0, time.perf_counter()


def loaded_gets(marks: list, t1: float, gets) -> list[float]:
    """Blocks of ``gets()`` until a backup batch has ended since ``t1`` (blocks start for up to
    MAX_LOADED_S), so the backup's GB/s beside the gets spans at least one batch end."""
    lat: list[float] = []
    while True:
        lat += gets()
        if (marks and marks[-1][0] >= t1) or time.perf_counter() - t1 > MAX_LOADED_S:
            return lat


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


class LoopProbe:
    """Times a no-op hop onto the store's loop every 5 ms: how long a get's completion handling
    could be kept waiting by other work on the loop (a put's CRC, index commit, ring submits)."""

    def __init__(self, store):
        self.loop = store.loop
        self.lat: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-loop-probe", daemon=True)

    def _run(self) -> None:
        import asyncio

        async def nop():
            return None

        while not self.stop.wait(0.005):
            t0 = time.perf_counter()
            asyncio.run_coroutine_threadsafe(nop(), self.loop).result()
            self.lat.append((time.perf_counter() - t0) * 1e3)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def row(system, op, size, nget, pattern, lat, **extra) -> dict:
    r = {
        "bench": "mixed", "system": system, "op": op, "object_bytes": size, "gets": nget, "pattern": pattern,
        "p50_ms": round(pct(lat, 50), 2), "p90_ms": round(pct(lat, 90), 2), "p99_ms": round(pct(lat, 99), 2),
        "runs": len(lat),
    }  # fmt: skip
    r.update(extra)
    return r
