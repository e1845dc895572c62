"""The counters every store keeps (``stats()`` reports them; ``drives.py`` sums them over drives).

State: none (the names; each store's live dict is state.counters).
"""

from __future__ import annotations

COUNTERS = (
    "puts", "put_dedup", "put_failed", "gets", "hits", "misses", "crc_errors", "evictions", "deletes",
    "bytes_written", "bytes_read", "timeouts",
    "io_errors_read", "io_errors_write", "io_errors_sync",  # ops that failed with an errno, syncs that raised
    "loading_misses", "puts_refused_loading",  # lookups missed / puts refused while the index loaded (loading.py)
    "key_set_builds",  # a follower's key sets built from its index (follower_keys.py)
)  # fmt: skip


def new_counters() -> dict[str, int]:
    """A store's counters at open: every name at 0."""
    return dict.fromkeys(COUNTERS, 0)
