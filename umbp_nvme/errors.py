"""Errors the store raises for misuse; I/O failures are never raised, they become per-key False."""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base class for store errors that the caller must act on."""


class StoreLockedError(StoreError):
    """A second writer tried to open a store directory that another process writes.

    ``path`` and ``holder`` (the writer's pid as its LOCK file says, or "unknown") when the lock
    was refused by the open; None otherwise."""

    path: str | None = None
    holder: str | None = None


class NamespaceMismatchError(StoreError):
    """The store directory was created for a different model / dtype / layout."""


class ReadOnlyStoreError(StoreError):
    """A mutating call on a store opened read-only."""


class UnsafeStorePathError(StoreError, PermissionError):
    """The store directory is a symlink, not a directory, or owned by another user."""


class DriveNotMountedError(StoreError):
    """A root does not lie on a mounted drive (``ssd_require_mount``, or a multi-drive store's guard
    against an unmounted drive's empty mount point): nothing is created there."""


class NotAStoreError(StoreError, FileNotFoundError):
    """The path is not a store directory (missing, no MANIFEST.json, or a damaged manifest)."""


class StoreDamagedError(StoreError):
    """A file of the store's own metadata (index or manifest) is damaged.

    A writer moves the file aside (``<name>.corrupt-<time>``), logs one ERROR line and comes up
    (a cache keeps serving); a read-only opener raises this with the path, and a follower rank
    reports misses until the writer has repaired the store.
    """


class IndexDamagedError(StoreDamagedError):
    """index.lmdb is not a readable LMDB file (truncated, overwritten, zeroed, wrong version).

    A writer moves the file aside and starts empty (the index is a cache of what the segments
    hold); a read-only opener raises this with the path.
    """


class ManifestDamagedError(NotAStoreError, StoreDamagedError):
    """MANIFEST.json is not valid JSON, or a field is missing or out of range (the message names
    the field, the value and the file). A writer moves it aside and re-derives it."""


class CapacityShrinkError(StoreError):
    """A writer asked for less capacity than the store records, without asking to shrink."""
