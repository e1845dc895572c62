"""Which KV pages the store holds, as they change: the store's hooks -> page-level DISK events.

The store knows objects (component keys: ``<page>_0_1_k``, ``<page>_0_1_v``, ``<page>__k``, ...);
a router knows pages. A page is *on disk* when every KV-anchor component of it is visible to
lookups (what ``batch_exists`` counts), so:

- ``shown(keys)`` (the store published these keys: a put, a put in doubt that landed, a drop that
  did not happen after all): each page of them that is complete is announced stored;
- ``hidden(keys)`` (these keys stopped being visible: eviction, delete, drop after a bad CRC or a
  drop in doubt, ``clear()``): each page of them that was complete just before is announced
  removed: the components not in ``keys`` are all still there, and the page is not complete now
  (a store over several drives may hold another copy).

Both are called on the store's loop thread in the step that changes visibility, and queue one
item each (kv_events.Publisher.offer) in that order; they never raise. ``hidden`` works its pages
out there and then: it needs the state just before and after the step. ``shown`` costs the put
nothing but the queueing: the publisher's thread works out its pages (``resolve``), the common
put (every component of each page in the call) without a lookup, a page completed by another
call with a lookup at that time. That is safe because items are handled in order and removals are
exact: a page found complete later than its put was complete then or is put again (its own item
follows), and a page no longer complete has a removal queued after this item.

``link(pages, parent)``: the backend queues, before a ``batch_set_v1``, the call's pages and the
first one's parent (``extra_info.prefix_keys[-1]``); each later page's parent is the page before
it. The publisher's thread keeps page -> parent until the page is announced (bounded).

Side-pool objects (Mamba state, SWA, indexer) are not announced: the KV anchor is what a
router's prefix match and ``batch_exists`` mean by a hit.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Optional

log = logging.getLogger(__name__)

PAGE_HEX = 64  # SGLang page keys are SHA-256 hex digests
PARENTS_MAX = 100_000  # page -> parent kept for pages not announced yet (a put that failed never is)
CALLS_MAX = 64  # recent puts' object lists: a shown item that is one of them needs no parsing


class Residency:
    def __init__(self, publisher, suffixes: tuple[str, ...], *, prefix: str = ""):
        self.pub = publisher
        self._sfx = tuple(suffixes)
        self._sfx_set = frozenset(suffixes)
        self._prefix = prefix
        self._start = len(prefix)
        self._parents: dict[str, Optional[str]] = {}  # the publisher thread's: page -> parent page
        self._calls: dict[int, tuple] = {}  # the publisher thread's: id(objects) -> (objects, pages) of recent puts
        self.exists: Callable[[list], list] = lambda keys: [False] * len(keys)
        self.keys: Callable[[], list] = list
        # its own counters, merged into the backend's store stats and metrics (sglang/stores.py)
        self.counters: dict[str, int] = {"kv_events_dropped": 0}
        self.single = False  # one PageStore (no other drive can hold a copy): set by attach()
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
        """The store published ``keys`` (a list it no longer changes): queued as they are."""
        if keys:
            self._offer("shown", keys)

    def link(self, pages: list[str], parent: Optional[str], objects: Optional[list] = None) -> None:
        """A put of ``pages`` (in chain order) is about to start; ``parent``: the first one's;
        ``objects``: the list of their KV objects the put is given (never changed afterwards), page
        by page: when the store publishes that very list, its pages are these, unparsed."""
        if pages:
            self._offer("links", (list(pages), parent, objects))

    def resolve(self, items: list) -> list:
        """The publisher thread's side: ``shown`` and ``links`` items -> ``("stored", [(page, parent,
        None), ...])``; ``removed`` items pass through."""
        out = []
        for kind, payload in items:
            try:
                if kind == "links":
                    self._learn(*payload)
                elif kind == "shown":
                    pages = self._complete(payload)
                    if pages:
                        pop = self._parents.pop
                        out.append(("stored", [(p, pop(p, None), None) for p in pages]))
                else:
                    out.append((kind, payload))
            except Exception as e:  # noqa: BLE001 - one bad item costs its events, not the thread
                self._fail(e)
        return out

    def _learn(self, pages: list[str], parent: Optional[str], objects: Optional[list] = None) -> None:
        parents = self._parents
        parents.update(zip(pages, [parent, *pages[:-1]]))
        while len(parents) > PARENTS_MAX:  # oldest first (dicts keep insertion order)
            del parents[next(iter(parents))]
        if objects is not None:
            calls = self._calls
            calls[id(objects)] = (objects, pages)  # the list is held: its id is not reused meanwhile
            if len(calls) > CALLS_MAX:
                del calls[next(iter(calls))]

    def _complete(self, keys) -> list[str]:
        """The pages of ``keys`` that are complete: all their components among ``keys`` (the usual
        put, no lookup), else looked up now."""
        m = len(self._sfx)
        a = self._start
        b = a + PAGE_HEX
        call = self._calls.get(id(keys))
        if call is not None and call[0] is keys:  # the usual put: the very list the backend made, all published
            return call[1]
        if m == 1:
            return self._pages(keys)
        sfx, pre = self._sfx_set, self._prefix
        count = Counter(k[a:b] for k in keys if type(k) is str and k[b:] in sfx and (not a or k.startswith(pre)))
        pages = [p for p, c in count.items() if c == m]
        part = [p for p, c in count.items() if c < m]
        if part:  # the others were published by another call, or are not there (yet)
            ex = self.exists(self._components(part))
            pages += [p for i, p in enumerate(part) if all(ex[i * m : (i + 1) * m])]
        return pages

    def hidden(self, keys) -> None:
        """Synchronous (the state just before and after the step is needed): a page all of whose
        components left at once was complete and is not now (one store: no lookup); a page that
        lost only some is looked up."""
        try:
            a = self._start
            b = a + PAGE_HEX
            sfx, pre = self._sfx_set, self._prefix
            count = Counter([k[a:b] for k in keys if k[b:] in sfx and (not a or k.startswith(pre))])
            if not count:
                return
            m = len(self._sfx)
            whole = [p for p, c in count.items() if c >= m]
            part = [p for p, c in count.items() if c < m]
            out = whole if self.single else self._not_served(whole)
            if part:
                gone = set(keys)
                comps = self._components(part)
                ex = self.exists(comps)
                for i, p in enumerate(part):
                    js = range(i * m, (i + 1) * m)
                    if not all(ex[j] for j in js) and all(ex[j] or comps[j] in gone for j in js):
                        out.append(p)
            self._offer("removed", out)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def _not_served(self, pages: list[str]) -> list[str]:
        """Of pages that left one drive whole, those no other drive serves (an older copy may)."""
        if not pages:
            return []
        m = len(self._sfx)
        ex = self.exists(self._components(pages))
        return [p for i, p in enumerate(pages) if not all(ex[i * m : (i + 1) * m])]

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
    """Hook ``residency`` into every PageStore of a writer's store (PageStore.attach_residency); a
    multi-drive store hooks the drives that serve reads and follows them (store/drive_residency.py)."""
    top = sync_store.store
    residency.exists = top.exists_many_nowait
    residency.keys = getattr(top, "served_keys", top.keys)
    residency.single = not hasattr(top, "stores")
    top.attach_residency(residency)


def detach(sync_store) -> None:
    top = getattr(sync_store, "store", None)
    if top is None:
        return
    top.detach_residency()
