"""Per-key checks shared by the put and get paths, and the one log line per call for refused keys.

Reads: the store's ``readonly`` and ``closed`` (writer, state.closed). Changes: nothing (a closed
store's ``_closed_call`` logs once, setting state.closed_logged).
"""

from __future__ import annotations

import logging

from ..errors import ReadOnlyStoreError
from ..keybytes import encode_key, printable_key

log = logging.getLogger("umbp_nvme.store")


class Refusals:
    """One log line per call for the keys it refused, naming the first reason.

    A ``quiet`` refusal is one whose cause the store already logged once (a full file system:
    space.py), so a call with only those logs at DEBUG: a full drive is one WARNING, not one per
    batch (issue 35)."""

    __slots__ = ("op", "count", "first", "loud")

    def __init__(self, op: str):
        self.op, self.count, self.first, self.loud = op, 0, None, False

    def add(self, key, reason: str, quiet: bool = False) -> None:
        self.count += 1
        if self.first is None or (not quiet and not self.loud):
            shown = repr(printable_key(key)) if type(key) is str else f"of type {type(key).__name__}"
            self.first = f"key {shown}: {reason}"
        self.loud = self.loud or not quiet

    def log(self, total: int) -> None:
        if self.count:
            log.log(logging.WARNING if self.loud else logging.DEBUG, "%s: %d of %d keys failed (first: %s)",
                    self.op, self.count, total, self.first)


def plain_keys(keys) -> bool:
    """True when every key is a non-empty ASCII str (one C-level pass): such keys encode as they
    are. False sends the batch to the per-key checks (keybytes.key_error)."""
    try:
        return all(map(str.isascii, keys)) and "" not in keys
    except TypeError:  # a key that is not a str
        return False


def encode_all(keys, idx=None) -> list[bytes]:
    """Bytes of keys (``keys[i] for i in idx``) already accepted by key_error (or plain):
    ``str.encode`` unless a key holds escaped bytes (U+DC80..U+DCFF), which only
    keybytes.encode_key maps back."""
    try:
        return list(map(str.encode, keys if idx is None else [keys[i] for i in idx]))
    except UnicodeEncodeError:
        return [encode_key(k) for k in keys] if idx is None else [encode_key(keys[i]) for i in idx]


class CallChecks:
    """What every batch call of a store (one drive: PageStore; several: drives.MultiDriveStore)
    checks first; a mixin of both, which give it ``readonly``, ``closed``, ``path`` and ``_closed_call``."""

    def _begin_call(self, op: str, keys, buffers=None, depths=None, *, writes: bool = False) -> list[bool] | None:
        """A write on a read-only store and mismatched argument lengths raise; a closed store answers
        once (its ``_closed_call``) and gives None. Otherwise the call's results, all False so far."""
        if writes and self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only; {op} is not allowed")
        n = len(keys)
        if buffers is not None and len(buffers) != n:
            raise ValueError(f"{op} needs one buffer per key: {n} keys, {len(buffers)} buffers")
        if depths is not None and len(depths) != n:
            raise ValueError(f"{op} needs one depth per key: {n} keys, {len(depths)} depths")
        if self.closed:
            self._closed_call(op)
            return None
        return [False] * n
