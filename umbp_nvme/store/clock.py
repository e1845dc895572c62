"""The generation clock: put generations and recency ticks that never run backwards.

A record's generation decides which copy of a key a rebuild keeps (rebuild.py) and, across
drives, which copy a lookup serves. So no value may ever be handed out twice or below one a
record on disk may carry, whatever crashed when. Every value handed out lies below a bound that
was persisted (committed and synced) in each store's index before the value was used; an open
starts above that bound, above the index's next generation and above every record it read, and
a rebuild (index lost) starts above every sound record in the segments (rebuild.py).

One clock may serve several stores (the drives of one writer): generations then order puts
across drives, and every store's persisted bound covers the values all of them hand out.

State: its own (the clock's now and bound); a writer's is writer.clock, shared by the drives of one
writer.
"""

from __future__ import annotations

BOUND_STEP = 1 << 32  # values handed out per persisted bound: one index sync per 4 G ticks


class GenerationClock:
    def __init__(self) -> None:
        self.now = 0
        self.bound = 0
        self._sinks: list = []  # persist(bound) of each store on this clock

    def join(self, floor: int, persist) -> None:
        """A store opened on this clock: every value from now on exceeds ``floor``; ``persist``
        records a bound in that store's index (durably) before values up to it are used."""
        self.now = max(self.now, int(floor))
        self._sinks.append(persist)
        if self.now < self.bound:  # the others' bound covers it: only the newcomer writes (a stalled
            persist(self.bound)  # drive of the set must not hold up a drive that joins)
        else:
            self._extend()

    def leave(self, persist) -> None:
        if persist in self._sinks:
            self._sinks.remove(persist)

    def tick(self) -> int:
        self.now += 1
        if self.now >= self.bound:
            self._extend()
        return self.now

    def _extend(self) -> None:
        bound = self.now + BOUND_STEP
        for persist in list(self._sinks):
            persist(bound)
        self.bound = bound
