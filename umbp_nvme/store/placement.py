"""Which drive a page lives on: rendezvous hashing of its page hash over drives.

All component objects of one page (K, V, side pools, every rank suffix) share the page hash, so
they land on one drive and a lost drive costs whole pages. The page hash comes from the caller's
``page_of``; without one, ``key_page`` (a key's text before its first ``_``). The store knows no key
format beyond that: the SGLang adapter passes sglang/keys.py's ``page_of`` (config prefixes, legacy
``flat_`` keys), as the CLI's warm-up does. Rendezvous (highest random weight)
hashing (a per-drive lane of the page hash XOR the drive's salt) gives each page a stable order over the drives;
drives.MultiDriveStore uses it to break ties when it spreads a batch evenly, and lookups search every drive, so a restart, an added drive
or a page written while its drive was degraded is always found.

State: none (hashing).
"""

from __future__ import annotations

import hashlib
import os

_LANES = 8  # independent 64-bit weights per page hash (one blake2b call gives all of them)


def key_page(key: str) -> str:
    """The page of ``key`` when the caller gives no ``page_of``: its text before the first ``_``
    (``p7_0_k`` and ``p7_0_v`` -> ``p7``), the whole key when it has none."""
    return key.partition("_")[0] or key


def page_weights(page: str, n: int) -> list[int]:
    """One independent 64-bit value per drive index (lanes repeat beyond 8 drives)."""
    d = hashlib.blake2b(page.encode("utf-8", "surrogateescape"), digest_size=8 * min(n, _LANES)).digest()
    lanes = [int.from_bytes(d[i : i + 8], "little") for i in range(0, len(d), 8)]
    return [lanes[i % _LANES] for i in range(n)]


def drive_order(page: str, salts: list[int]) -> list[int]:
    """Drive indexes for ``page``, most preferred first: weight = the page's lane XOR the drive's salt."""
    w = page_weights(page, len(salts))
    return sorted(range(len(salts)), key=lambda i: w[i] ^ salts[i], reverse=True)


def drive_id(root: str) -> int:
    """A drive's placement salt: 64 bits of its root's absolute path (stable across restarts)."""
    p = os.path.abspath(root).encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(p, digest_size=8).digest(), "little")


def spread(pages: list[str], usable, salts: list[int], held=None) -> list[int]:
    """The drive for each object of a batch (-1: no usable drive), given its page hash.

    Where it already is (``held[j] >= 0``: a re-put dedups there), else where its page already is
    (all components of a page on one drive), else the least loaded usable drive of this batch,
    ties broken by the page's rendezvous order. A batch's time is its busiest drive's, so pure
    hashing (busiest drive ~1.25x the mean for 128 pages on 4 drives) would cap the scaling;
    consecutive pages land on different drives, so any later range of them reads evenly too.
    Lookups search every drive: placement needs no stability to find a page.
    """
    seen: dict[str, int] = {}  # page -> its drive in this batch
    load = [0] * len(usable)
    if held is not None:
        for p, h in zip(pages, held):
            if h >= 0 and usable[h]:
                seen.setdefault(p, h)
    out = []
    for j, page in enumerate(pages):
        d = held[j] if held is not None and held[j] >= 0 else seen.get(page)
        if d is None:
            w, d, d_load, d_w = page_weights(page, len(usable)), -1, 0, 0
            for i, salt in enumerate(salts):
                if usable[i] and (d < 0 or load[i] < d_load or (load[i] == d_load and w[i] ^ salt > d_w)):
                    d, d_load, d_w = i, load[i], w[i] ^ salt
            seen[page] = d
        if d >= 0:
            load[d] += 1
        out.append(d)
    return out
