"""Steps of a store that fault tests replace, handed to it at open (``PageStore.open(...,
hooks=StoreHooks(...))``), as ``engine_factory`` is for its engines: a test holds or fails an
index commit, a tombstone, a staging copy or a drive's session record without patching the store's classes.

Every field is None by default: the store then runs its own step. A hook gets the real step first,
so it can delay it, run it and then fail, or fail without it (``rebuild_step`` is only told where
a rebuild is). The object is shared, not copied:
a test may change what its hook does while the store is open (the store reads the field at each
call). Reads: nothing. Changes: nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(eq=False)
class StoreHooks:
    # async (real_commit, store, puts, deletes) -> bool: one index transaction (PageStore._commit);
    # real_commit(puts, deletes) is the store's own
    commit: Any = None
    # async (real_tombstone, store, rows) -> list | None: clearing deleted rows' records in their
    # segments (RecordSteps._tombstone); real_tombstone(rows) is the store's own
    tombstone: Any = None
    # (dst, src, nbytes) -> None on a worker thread: a bounce-buffer copy (staging.StagePlan), in
    # place of ctypes.memmove; set at open (the store's BouncePool keeps it)
    memmove: Any = None
    # (real_write, path, rec) -> None on a drive's record thread: writing one drive's DRIVES.json
    # (drive_sessions.py: the session record of a multi-drive store); real_write(path, rec) is the store's own
    drive_record: Any = None
    # (name) -> None: called after each step of a rebuild of the index at open (rebuild.OPEN_STEPS)
    # and of a legacy store's index replaced at open (index_swap.STEPS); crash tests kill the
    # process there. Not given the real step: the steps are on-disk states, not calls to replace
    rebuild_step: Any = None
    # (name) -> None on the background load's worker thread (loading.py), before each of its steps
    # ("index": check and open the index file, "rows": rows, allocator, record areas): tests hold
    # the load there, crash tests kill the process there
    load_step: Any = None
