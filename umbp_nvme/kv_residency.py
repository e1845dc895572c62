"""Which KV pages the store holds, as they change: the store's hooks -> page-level DISK events.

The store knows objects (component keys: ``<page>_0_1_k``, ``<page>_0_1_v``, ``<page>__k``, ...);
a router knows pages. A page is *on disk* when every KV-anchor component of it is visible to
lookups (what ``batch_exists`` counts), so:

- ``shown(keys)`` (the store published these keys: a put, a put in doubt that landed, a drop that
  did not happen after all): each page of them that is now complete is announced stored;
- ``hidden(keys)`` (these keys stopped being visible: eviction, delete, drop after a bad CRC or a
  drop in doubt, ``clear()``): each page of them that was complete just before is announced
  removed: the components not in ``keys`` are all still there, and the page is not complete now
  (a store over several drives may hold another copy).

Both run on the store's loop thread, synchronously in the step that changes visibility, so the
check sees exactly the state before and after that step (no other step runs in between). They
only look up keys and queue one item (kv_events.Publisher.offer); they never raise. Side-pool
objects (Mamba state, SWA, indexer) are not announced: the KV anchor is what a router's prefix
match and ``batch_exists`` mean by a hit.

``links``: page -> parent page, filled by the backend for the pages of one ``batch_set_v1`` while
the call runs (from ``extra_info.prefix_keys[-1]`` and the call's own key order).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Optional

log = logging.getLogger(__name__)

PAGE_HEX = 64  # SGLang page keys are SHA-256 hex digests


class Residency:
    def __init__(self, publisher, suffixes: tuple[str, ...], *, prefix: str = ""):
        self.pub = publisher
        self._sfx = tuple(suffixes)
        self._sfx_set = frozenset(suffixes)
        self._prefix = prefix
        self._start = len(prefix)
        self.links: dict[str, str] = {}
        self.exists: Callable[[list], list] = lambda keys: [False] * len(keys)
        self.keys: Callable[[], list] = list
        self.counters: dict = {}  # the first drive's stats counters: kv_events_dropped is exported there
        self._failed = False

    def _pages(self, keys) -> list[str]:
        """The pages of the KV-anchor keys among ``keys``, in order, once each."""
        a = self._start
        b = a + PAGE_HEX
        sfx, pre = self._sfx_set, self._prefix
        out: dict[str, None] = {}
        for k in keys:
            if type(k) is str and k[b:] in sfx and (not a or k.startswith(pre)):
                out[k[a:b]] = None
        return list(out)

    def _components(self, pages: list[str]) -> list[str]:
        pre = self._prefix
        return [f"{pre}{p}{s}" for p in pages for s in self._sfx]

    def shown(self, keys) -> None:
        try:
            m = len(self._sfx)
            if m == 1:
                pages = self._pages(keys)
            else:  # a page whose m objects are all among keys is complete: no lookup (the usual put)
                a = self._start
                b, sfx = a + PAGE_HEX, self._sfx_set
                count = Counter(k[a:b] for k in keys if type(k) is str and k[b:] in sfx)
                pages = [p for p, c in count.items() if c == m]
                part = [p for p, c in count.items() if c < m]
                if part:  # the others were published earlier, or are not there yet
                    ex = self.exists(self._components(part))
                    pages += [p for i, p in enumerate(part) if all(ex[i * m : (i + 1) * m])]
            if not pages:
                return
            links = self.links
            self._offer("stored", [(p, links.get(p), None) for p in pages])
        except Exception as e:  # noqa: BLE001 - events never fail a store step
            self._fail(e)

    def hidden(self, keys) -> None:
        try:
            pages = self._pages(keys)
            if not pages:
                return
            gone = set(keys)
            comps = self._components(pages)
            ex = self.exists(comps)
            m = len(self._sfx)
            out = []
            for i, p in enumerate(pages):
                js = range(i * m, (i + 1) * m)
                if not all(ex[j] for j in js) and all(ex[j] or comps[j] in gone for j in js):
                    out.append(p)
            self._offer("removed", out)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _offer(self, kind: str, pages: list) -> None:
        if not self.pub.offer(kind, pages):  # full: dropped (a re-announcement follows)
            self.counters["kv_events_dropped"] = self.pub.stats["dropped_pages"]

    def snapshot(self) -> list[tuple[str, Optional[str], None]]:
        """Every complete page the store holds now (the publisher's re-announcement)."""
        for _ in range(3):
            try:
                keys = self.keys()
                break
            except RuntimeError:  # a dict resized under the copy: take it again
                continue
        else:
            return []
        m = len(self._sfx)
        count: dict[str, int] = {}
        for p in self._pages_all(keys):
            count[p] = count.get(p, 0) + 1
        return [(p, None, None) for p, c in count.items() if c == m]

    def _pages_all(self, keys):
        a = self._start
        b = a + PAGE_HEX
        sfx, pre = self._sfx_set, self._prefix
        for k in keys:
            if type(k) is str and k[b:] in sfx and (not a or k.startswith(pre)):
                yield k[a:b]

    def _fail(self, e: BaseException) -> None:
        if not self._failed:
            self._failed = True
            log.error("umbp_nvme: KV residency events failed: %r (logged once; the store is unaffected)", e)


def drives_of(top) -> list:
    """The PageStores under a store (one, or one per drive of a MultiDriveStore)."""
    stores = getattr(top, "stores", None)
    return [s for s in stores if s is not None] if stores is not None else [top]


def attach(sync_store, residency: Residency) -> None:
    """Hook ``residency`` into every PageStore of a writer's store (see PageStore._residency)."""
    top = sync_store.store
    residency.exists = top.exists_many_nowait
    residency.keys = top.keys
    drives = drives_of(top)
    residency.counters = drives[0]._counters
    residency.counters.setdefault("kv_events_dropped", 0)
    for st in drives:
        st._residency = residency


def detach(sync_store) -> None:
    top = getattr(sync_store, "store", None)
    if top is not None:
        for st in drives_of(top):
            st._residency = None
