#!/usr/bin/env python3
"""How much an admission rule keyed on one request feature could give, fixed in hindsight.

``python tools/admission_bound.py --trace FILE.jsonl --capacity 6000,20000``

For each feature (``size``: log2 of the write batch's new blocks, what the store sees when
SGLang backs a request up; ``output``: log2 of the request's output length, which the storage
API never sees at backup time), the trace is read once to learn each class's true reuse rate
(share of its first-time blocks some later request uses), then replayed in the simulator
(umbp_nvme/bench/trace_sim.py) with "admit a first-time block when its class's rate is at least
the threshold, else on its second write" for a sweep of thresholds. The best of the sweep is an
upper bound for any online rule on that feature: it knows the rates before it starts. LRU and
perfect admission (only blocks that will be reused) are printed beside it. docs/cache-policy.md
uses it to say why 1.15x LRU at 6,000 blocks is out of reach on Mooncake's synthetic trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from umbp_nvme.bench import trace_file, trace_sim as sim  # noqa: E402

THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def output_lengths(path: str, n: int) -> list[int]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip() and len(out) < n:
                out.append(int(json.loads(line).get("output_length", 0)))
    return out


def features(trace: trace_file.Trace, outputs: list[int]) -> dict[str, list[int]]:
    """Per request, its class under each feature (the write batch is the blocks after the
    longest prefix of blocks seen before: what an infinite cache would not hold)."""
    seen: set[int] = set()
    size, out = [], []
    for blocks, o in zip(trace.reqs, outputs):
        bl = blocks.tolist()
        k = 0
        while k < len(bl) and bl[k] in seen:
            k += 1
        size.append(max(0, len(bl) - k).bit_length())
        out.append(min(12, int(o + 1).bit_length()))
        seen.update(bl)
    return {"size": size, "output": out}


def class_rates(trace: trace_file.Trace, nxt: np.ndarray, cls: list[int]) -> dict[int, float]:
    done, reused, seen, pos = Counter(), Counter(), set(), 0
    for blocks, c in zip(trace.reqs, cls):
        for j, b in enumerate(blocks.tolist()):
            if b not in seen:
                done[c] += 1
                reused[c] += int(nxt[pos + j] != sim.NEVER)
                seen.add(b)
        pos += len(blocks)
    return {c: reused[c] / done[c] for c in done}


class HindsightClass:
    """Admission by a class whose reuse rate is known in advance; else on the second write."""

    def __init__(self, cls: list[int], rates: dict[int, float], threshold: float):
        self.cls, self.rates, self.threshold = cls, rates, threshold
        self.now = 0  # the simulator sets the request index
        self.offered: set[int] = set()

    def offer(self, pages: np.ndarray) -> np.ndarray:
        ids = pages.tolist()
        if self.rates.get(self.cls[self.now], 1.0) >= self.threshold:
            ok = np.ones(len(ids), bool)
        else:
            ok = np.fromiter((p in self.offered for p in ids), bool, len(ids))
        self.offered.update(ids)
        return ok

    def used(self, pages) -> None:
        pass

    def evicted(self, pages) -> None:
        pass


def bound(trace, nxt, cls, rates, capacity: int, lru: sim.SimResult) -> tuple[float, float, float]:
    """(threshold, hit / LRU's, writes per hit / LRU's) of the best threshold."""
    best = None
    for th in THRESHOLDS:
        r = sim.simulate(trace, sim.LRU(capacity, HindsightClass(cls, rates, th)))
        row = (th, r.hit_rate / lru.hit_rate, r.written_per_hit / lru.written_per_hit)
        if best is None or row[1] > best[1]:
            best = row
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True)
    ap.add_argument("--capacity", default="6000,20000", help="blocks; a comma list")
    ap.add_argument("--limit", type=int, default=None, help="the first N requests only")
    a = ap.parse_args(argv)
    trace = trace_file.load(a.trace, limit=a.limit)
    nxt = sim.next_use(trace)
    feats = features(trace, output_lengths(a.trace, len(trace.reqs)))
    rates = {name: class_rates(trace, nxt, cls) for name, cls in feats.items()}
    print(f"{os.path.basename(a.trace)}: {len(trace.reqs)} requests; infinite {sim.infinite(trace).hit_rate:.3f}")
    for cap in [int(c) for c in a.capacity.split(",")]:
        lru = sim.simulate(trace, sim.LRU(cap))
        perfect = sim.simulate(trace, sim.LRU(cap, sim.PerfectAdmission(trace, nxt)))
        cells = [f"LRU {lru.hit_rate:.3f}", f"perfect admission {perfect.hit_rate / lru.hit_rate:.2f}x"]
        for name, cls in feats.items():
            th, hit, w = bound(trace, nxt, cls, rates[name], cap, lru)
            cells.append(f"{name} in hindsight {hit:.2f}x (threshold {th}, writes {w:.2f}x)")
        print(f"{cap} blocks: " + "; ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
