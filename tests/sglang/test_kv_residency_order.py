"""The residency tracker's deferred half (kv_residency.py): ``shown`` items are worked out on the
publisher's thread later, against the store as it is then, while ``hidden`` is exact at once.
Whatever the store does between an item and its handling, once every item is handled a
subscriber's tally equals the pages the store holds whole. Random sequences of puts (whole
pages, half pages, re-puts) and drops over a few pages, handled at random moments."""

from __future__ import annotations

import hashlib
import random

import pytest

from umbp_nvme.sglang.kv_residency import Residency

SFX = ("_0_k", "_0_v")
PAGES = [hashlib.sha256(f"o{i}".encode()).hexdigest() for i in range(6)]


class Store:
    """Published keys, and the two hooks in the order a PageStore calls them."""

    def __init__(self, rz):
        self.keys: set[str] = set()
        self.rz = rz

    def put(self, objects: list[str], pages: list[str]) -> None:
        whole = objects == [p + s for p in pages for s in SFX]  # the backend links only its full object list
        self.rz.link(pages, None, objects if whole else None)
        new = [k for k in objects if k not in self.keys]
        self.keys.update(new)
        if new:
            self.rz.shown(objects if len(new) == len(objects) else new)  # the very list only when all published

    def drop(self, objects: list[str]) -> None:
        gone = [k for k in objects if k in self.keys]
        self.keys.difference_update(gone)
        if gone:
            self.rz.hidden(gone)

    def whole(self) -> set[str]:
        return {p for p in PAGES if all(p + s in self.keys for s in SFX)}


class Later:
    """A publisher whose thread runs when the test says: items wait in a queue meanwhile."""

    def __init__(self):
        self.queue, self.tally, self.rz = [], set(), None

    def offer(self, kind, payload):
        self.queue.append((kind, payload))
        return True

    def run(self):
        items, self.queue = self.queue, []
        for kind, pages in self.rz.resolve(items):
            for p in pages:
                if kind == "stored":
                    self.tally.add(p[0])
                else:
                    self.tally.discard(p)


@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("seed", range(40))
def test_the_tally_equals_the_whole_pages_held_whatever_happens_before_items_are_handled(seed, single):
    rng = random.Random(seed)
    pub = Later()
    rz = pub.rz = Residency(pub, SFX)
    rz.single = single
    store = Store(rz)
    rz.exists = lambda ks: [k in store.keys for k in ks]
    for _ in range(60):
        pages = rng.sample(PAGES, rng.randint(1, 3))
        objects = [p + s for p in pages for s in SFX]
        op = rng.random()
        if op < 0.45:
            store.put(objects, pages)
        elif op < 0.6:
            store.put([o for o in objects if rng.random() < 0.5] or objects[:1], pages)  # part of pages
        else:
            store.drop([o for o in objects if rng.random() < 0.7] or objects[:1])
        if rng.random() < 0.3:
            pub.run()
    pub.run()
    assert pub.tally == store.whole()
