"""The store: key -> object on local NVMe (see docs/architecture.md for the module map).

``from umbp_nvme.store import PageStore, read_manifest, MANIFEST_FILE, LOCK_FILE, lock_holder`` is
the public surface; ``SyncPageStore`` is in ``umbp_nvme.store.sync``.

State: none (re-exports).
"""

from .layout import (
    FORMAT_VERSION,
    LOCK_FILE,
    MANIFEST_FILE,
    lock_holder,
    read_manifest,
    recorded_capacity_bytes,
)
from .page_store import PageStore

__all__ = [
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MANIFEST_FILE",
    "PageStore",
    "lock_holder",
    "read_manifest",
    "recorded_capacity_bytes",
]
