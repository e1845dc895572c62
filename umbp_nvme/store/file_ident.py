"""Which file a path names: (st_dev, st_ino), taken around an LMDB open (index.py) and after
each lookup of a read-only store (follower.py), so a file replaced by its writer is noticed; and
the name a damaged or replaced file is kept under.

State: none.
"""

from __future__ import annotations

import os
import time


def file_id(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file at ``path`` (symlinks followed, as LMDB does); None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def opened_id(path: str, before: tuple[int, int] | None, *, created: bool) -> tuple[int, int] | None:
    """The identity of the file an ``lmdb.open`` of ``path`` just mapped, given ``file_id`` taken just
    before it: the file at the path, when it was there all along or this open created it (a writer,
    which holds the store's lock: nobody else replaces the file meanwhile); None when another
    process replaced it during the open (the caller closes that environment and tries again)."""
    after = file_id(path)
    return after if before == after or (before is None and created) else None


def aside_name(path: str) -> str:
    """A free name to keep a replaced or damaged file under: ``<path>.corrupt-<timestamp>[.n]``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = f"{path}.corrupt-{stamp}"
    n = 1
    while os.path.lexists(dest):
        dest = f"{path}.corrupt-{stamp}.{n}"
        n += 1
    return dest
