"""Which drive a page lives on: the page hash of a key, rendezvous hashing over drives.

All component objects of one page (K, V, side pools, every rank suffix) share the page hash, so
they land on one drive and a lost drive costs whole pages. Rendezvous (highest random weight)
hashing gives each page a stable order over the drives; drives.MultiDriveStore uses it to break
ties when it spreads a batch evenly, and lookups search every drive, so a restart, an added drive
or a page written while its drive was degraded is always found.
"""

from __future__ import annotations

import hashlib
import os
import re

from ..config import parse_roots  # noqa: F401 - the root list lives with the config that carries it

_HASH_RE = re.compile(r"(?:^|_)([0-9a-fA-F]{64})(?=_|$)")  # SGLang page hashes are 64 hex digits
FLAT_PREFIX = "flat_"


def page_of(key: str, config_prefix: str | None = None) -> str:
    """The page hash part of a component key (the part before the rank / MLA / pool suffixes).

    A 64-hex-digit run is the page hash wherever it sits (side-pool keys carry a config prefix
    in front of it); otherwise the config prefix and the legacy ``flat_`` prefix are removed
    and the part before the first ``_`` is the page.
    """
    m = _HASH_RE.search(key)
    if m is not None:
        return m.group(1)
    if config_prefix and key.startswith(config_prefix + "_"):
        key = key[len(config_prefix) + 1:]
    if key.startswith(FLAT_PREFIX):
        key = key[len(FLAT_PREFIX):]
    head, _, _ = key.partition("_")
    return head or key


def _weight(drive_id: bytes, page: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(page, digest_size=8, key=drive_id).digest(), "little")


def drive_order(page: str, drive_ids: list[bytes]) -> list[int]:
    """Drive indexes for ``page``, most preferred first (stable for the same ids)."""
    p = page.encode("utf-8", "surrogateescape")
    w = [_weight(d, p) for d in drive_ids]
    return sorted(range(len(drive_ids)), key=lambda i: w[i], reverse=True)


def preferred(page: str, drive_ids: list[bytes], usable) -> int:
    """The most preferred drive among those where ``usable[i]`` is true; -1 when none is."""
    p = page.encode("utf-8", "surrogateescape")
    best, best_w = -1, -1
    for i, d in enumerate(drive_ids):
        if usable[i]:
            w = _weight(d, p)
            if w > best_w:
                best, best_w = i, w
    return best


def drive_id(root: str) -> bytes:
    """A drive's placement identity: its root's absolute path (blake2b key: at most 64 bytes)."""
    return hashlib.blake2b(os.path.abspath(root).encode("utf-8", "surrogateescape"), digest_size=32).digest()
