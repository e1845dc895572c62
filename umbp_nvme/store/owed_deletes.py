"""Deletes a degraded drive owes, kept durably until the drive has applied them.

A drive that is degraded (stalled, EIO, gone, or not open) cannot delete: a key deleted or
written anew elsewhere meanwhile would come back from it after a restart. The owing is recorded
in ``OWED_DELETES.jsonl`` on every healthy drive (appended and fsynced before the delete returns
or the new copy is written), not on the owing drive itself (it may be the one that hangs) and not
in memory only. Lines (``at`` in ns orders them across the drives' files):

* ``{"drive": root, "at": t, "keys": [...]}`` -- the drive owes these deletes;
* ``{"drive": root, "at": t, "out": true}`` -- its store was not open: every key another drive
  holds is newer than its copy (puts never go to it), so the copy is stale;
* ``{"drive": root, "at": t, "clear": true}`` -- the store was cleared while it was degraded;
* ``{"drive": root, "at": t, "settled": true}`` -- it applied everything owed before ``t``.

The log grows while drives are degraded (one line per batch that owes) and is compacted at each
open of the writer.

Why a log on the other drives rather than tombstones on the owing one: the owing drive is the one
that cannot be written. A torn last line (a crash while appending) is ignored; the delete it
recorded had not returned.

State: its own (the owed-deletes log of a drive); the MultiDriveStore keeps one per drive.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time

from ..engine.files import open_regular
from .layout import fsync_dir, write_file_atomic

log = logging.getLogger("umbp_nvme.store")

OWED_FILE = "OWED_DELETES.jsonl"


class Owed:
    """The merged state of the logs: per drive root, keys owed and whether it was out."""

    def __init__(self):
        self.keys: dict[str, set[str]] = {}
        self.out: set[str] = set()
        self.cleared: set[str] = set()

    def owes(self, root: str) -> bool:
        return bool(self.keys.get(root)) or root in self.out or root in self.cleared

    def settle(self, root: str) -> None:
        self.keys.pop(root, None)
        self.out.discard(root)
        self.cleared.discard(root)


def _lines(root: str) -> list[dict]:
    try:  # a FIFO planted there is no log (and never blocks the open)
        with os.fdopen(open_regular(os.path.join(root, OWED_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC),
                       encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            e = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a torn append, or damage nested too deep to parse
        if isinstance(e, dict) and isinstance(e.get("drive"), str) and isinstance(e.get("at"), int):
            out.append(e)
    return out


def load(roots: list[str]) -> Owed:
    """Merge the logs found on ``roots`` (the drives that opened): a drive's ``settled`` line
    in any file cancels what any file recorded for it before."""
    entries = sorted((e for r in roots for e in _lines(r)), key=lambda e: e["at"])
    state = Owed()
    for e in entries:
        d = e["drive"]
        if e.get("settled"):
            state.settle(d)
        elif e.get("clear"):
            state.settle(d)  # everything it held goes
            state.cleared.add(d)
        elif e.get("out"):
            state.out.add(d)
        elif isinstance(e.get("keys"), list):
            state.keys.setdefault(d, set()).update(k for k in e["keys"] if isinstance(k, str))
    return state


def append(root: str, entries: list[dict]) -> None:
    """Append ``entries`` to the log on ``root`` and fsync (blocking: run it off the loop). An entry's
    ``at`` is kept when given (the caller orders appends that run on several threads), else now.

    Appends may run concurrently (drive_probe: one may hang while later ones proceed): each is one
    O_APPEND write that starts with a newline, so it is never glued to a torn line or to a
    fragment of another append; a short write raises (not recorded) rather than finishing the
    line with a second write another append could split."""
    now = time.time_ns()
    data = ("\n" + "".join(json.dumps(dict(e, at=e.get("at", now)), sort_keys=True) + "\n" for e in entries)).encode()
    path = os.path.join(root, OWED_FILE)
    new = not os.path.exists(path)
    fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)  # not a FIFO
    try:
        n = os.write(fd, data)
        if n != len(data):
            raise OSError(errno.EIO, f"short write appending {OWED_FILE} ({n} of {len(data)} bytes)")
        os.fsync(fd)
    finally:
        os.close(fd)
    if new:
        fsync_dir(root)


def rewrite(root: str, state: Owed, roots: list[str]) -> None:
    """Replace the log on ``root`` with ``state`` alone (after the owed deletes were applied at
    open); a drive of ``roots`` that owes nothing gets a ``settled`` line, so that older lines in
    the log of a drive that did not open this time cannot bring its owes back."""
    path = os.path.join(root, OWED_FILE)
    now = time.time_ns()
    lines = [{"drive": d, "at": now, "settled": True} for d in sorted(roots) if not state.owes(d)]
    lines += [{"drive": d, "at": now + 1, "clear": True} for d in sorted(state.cleared)]
    lines += [{"drive": d, "at": now + 2, "out": True} for d in sorted(state.out)]
    lines += [{"drive": d, "at": now + 2, "keys": sorted(k)} for d, k in sorted(state.keys.items()) if k]
    write_file_atomic(path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in lines).encode())


def stale_copies(st, others: list) -> list[str]:
    """Keys of ``st`` (a drive that was out) that another open drive holds: its copies are older."""
    keys = st.keys()
    stale = [False] * len(keys)
    for o in others:
        stale = [a or b for a, b in zip(stale, o.exists_many_nowait(keys))]
    return [k for k, s in zip(keys, stale) if s]


async def apply(st, owed_keys: set[str], out: bool, others: list, cleared: bool = False) -> set[str]:
    """Apply what a drive owes on its open store ``st``: a clear, the owed keys, and (``out``) its
    stale copies. Returns the keys whose delete is not durable (it failed or is in doubt)."""
    if cleared:
        await st.clear()
    keys = set(owed_keys)
    if out:
        keys.update(stale_copies(st, others))
    if not keys:
        return set()
    keys_l = list(keys)
    await st.delete_many(keys_l)
    # still held, or hidden by a delete whose commit outlived io_timeout_s (it may not have landed)
    return {k for k, f in zip(keys_l, st.delete_pending(keys_l)) if f}
