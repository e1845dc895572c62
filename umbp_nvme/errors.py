"""Errors the store raises for misuse; I/O failures are never raised, they become per-key False."""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base class for store errors that the caller must act on."""


class StoreLockedError(StoreError):
    """A second writer tried to open a store directory that another process writes."""


class NamespaceMismatchError(StoreError):
    """The store directory was created for a different model / dtype / layout."""


class ReadOnlyStoreError(StoreError):
    """A mutating call on a store opened read-only."""


class UnsafeStorePathError(StoreError, PermissionError):
    """The store directory is a symlink, not a directory, or owned by another user."""
