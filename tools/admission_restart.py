#!/usr/bin/env python3
"""What a restart costs the store's adaptive admission (its state is in memory only).

``python tools/admission_restart.py --trace FILE.jsonl --capacity 1000,6000,20000``

Replays the trace in the simulator (umbp_nvme/bench/trace_sim.py) three ways and prints the hit
rate over the requests after the restart point (half the trace by default): LRU; the adaptive
admission kept all along; and the same with its state dropped at the restart point while the
cache keeps its contents, as a store reopened on its segments does. The issue's bar: a restart
costs no more than a cold LRU, i.e. the restarted run stays at or above LRU's.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from umbp_nvme.bench import trace_file, trace_sim as sim  # noqa: E402
from umbp_nvme.store.admission import Admission  # noqa: E402


class Restarted(sim.LRU):
    """LRU with the adaptive admission, whose state is dropped at request ``at`` (contents kept)."""

    def __init__(self, capacity: int, at: int):
        super().__init__(capacity, Admission(capacity))
        self.at = at

    def prefix(self, blocks, now) -> int:
        if self.at is not None and now >= self.at:
            self.admission, self.at = Admission(self.capacity), None
        return super().prefix(blocks, now)


def after(full: sim.SimResult, head: sim.SimResult) -> float:
    """Hit rate over the requests ``full`` replayed beyond ``head``."""
    total = full.total_blocks - head.total_blocks
    return (full.hit_blocks - head.hit_blocks) / total if total else 0.0


def rates(trace, capacity: int, at: int) -> dict[str, float]:
    head = trace.head(at)
    lru = after(sim.simulate(trace, sim.LRU(capacity)), sim.simulate(head, sim.LRU(capacity)))
    kept_head = sim.simulate(head, sim.LRU(capacity, Admission(capacity)))
    kept = after(sim.simulate(trace, sim.LRU(capacity, Admission(capacity))), kept_head)
    restarted = after(sim.simulate(trace, Restarted(capacity, at)), kept_head)
    return {"lru": lru, "adaptive": kept, "restarted": restarted}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--capacity", default="1000,6000,20000", help="blocks; a comma list")
    ap.add_argument("--at", type=float, default=0.5, help="restart point, as a share of the requests")
    a = ap.parse_args(argv)
    trace = trace_file.load(a.trace)
    at = int(len(trace.reqs) * a.at)
    print(f"{os.path.basename(a.trace)}: {len(trace.reqs)} requests, restart before request {at}; "
          "hit rate of the requests after it")  # fmt: skip
    for cap in [int(c) for c in a.capacity.split(",")]:
        r = rates(trace, cap, at)
        print(f"{cap} blocks: LRU {r['lru']:.4f}, adaptive kept {r['adaptive']:.4f}, "
              f"adaptive restarted {r['restarted']:.4f} ({r['restarted'] / r['lru']:.2f}x LRU)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
