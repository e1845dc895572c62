"""The store's side of admission (the policy is admission.py): which new objects a put writes.

``screen`` runs on the objects a put would write (keys new to the store, checked, with their
buffers): it groups them into pages (the components of a page share its hash and one decision),
asks the policy, and drops the declined ones from the write. A declined object's put answers
True: SGLang 0.5.23's controller stops backing up the rest of an operation at the first False
(``_page_backup``), so a False for a page the store chose not to keep would also lose the pages
after it; True says "handled", the page is simply absent at the next hit query, and its next
backup is its second write. Declined objects are counted in ``put_declined``, never in
``put_failed``. ``used`` tells the policy which pages were asked for and present (hits, and
re-puts of stored keys).

``StoreConfig.admission_policy``: ``adaptive`` (admission.py's measured choice), ``all`` (write
every object: LRU as before) or ``second`` (the fixed second-write doorkeeper); ``auto`` is
``all`` here, and the SGLang backend opens its store with ``adaptive`` (sglang/stores.py), so a
direct PageStore user's put keeps meaning "stored until evicted".

Reads: state.config (admission_policy), writer.high_bytes, writer.admission. Changes:
writer.admission (made at the first put), state.counters (put_declined).
"""

from __future__ import annotations

import numpy as np

from . import admission
from .segments import size_classes


def _ids(keys) -> np.ndarray:
    """Page ids of component keys: components of one page (``<hash>_0_k``, ``<hash>_0_v``) share
    the hash in front; a key that does not start with 16 hex digits is a page of its own."""
    return admission.page_ids(keys)


def _policy(store, lens: np.ndarray, n_pages: int):
    """The store's Admission (made at its first put, when object sizes are known); None for ``all``."""
    w = store.writer
    pol = w.admission
    if pol is not None or store.config.admission_policy in ("all", "auto"):
        return pol
    per_page = max(1, round(len(lens) / max(1, n_pages)))
    page_bytes = int(size_classes(lens).mean()) * per_page
    pol = admission.Admission(max(1, int(w.high_bytes) // max(1, page_bytes)))
    if store.config.admission_policy == "second":
        pol.fix("second")
    w.admission = pol
    store.state.counters.setdefault("put_declined", 0)
    return pol


def screen(store, keys, todo: np.ndarray, addrs: np.ndarray, lens: np.ndarray, results: list):
    """(todo, addrs, lens) of the objects to write; declined ones answer True in ``results``."""
    if store.config.admission_policy in ("all", "auto") or not len(todo):
        return todo, addrs, lens
    ids = _ids([keys[int(i)] for i in todo])
    pages, first, inv = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # pages in the order the batch has them
    pol = _policy(store, lens, len(pages))
    ok_sorted = pol.offer(pages[order])
    ok = np.empty(len(pages), bool)
    ok[order] = ok_sorted
    keep = ok[inv]
    if keep.all():
        return todo, addrs, lens
    drop = np.flatnonzero(~keep)
    for j in drop.tolist():
        results[int(todo[j])] = True
    store.state.counters["put_declined"] += len(drop)
    return todo[keep], addrs[keep], lens[keep]


def used(store, keys, mask=None) -> None:
    """Keys asked for and present (``mask``: which of ``keys``; all when None)."""
    w = store.writer
    pol = None if w is None else w.admission  # a read-only opener admits nothing
    if pol is None:
        return
    ks = keys if mask is None else [k for k, m in zip(keys, mask) if m]
    if ks:
        pol.used(np.unique(_ids(ks)))
