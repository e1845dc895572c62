"""Replacing index.lmdb so that a crash at any moment leaves a file an open can judge.

An open trusts an index that carries a writer state (index.py): a clean close, or a writer of this
boot whose commits a process kill cannot lose. A new index is therefore built under a temporary
name beside the path (``TEMP_SUFFIX``), filled, committed, synced and marked with its writer state,
and only then put at the path; the directory is synced last. At every moment the path names the
old file (the next open decides again what this one decided), nothing (a writer rebuilds a missing
index; a follower misses), or the finished new file; never a half-built or empty one.

The old file is moved aside (``index.aside_name``) and its LMDB lock file removed while the path
names nothing, so no process can open the new data file with the old environment's lock file
(it holds the old file's transaction ids). What a killed build left is settled by the next writer
or ``verify --rebuild-index`` (both hold the store's lock) before they look at the index: a
finished file whose rename was all that was left is put in place, anything else removed.

``step(name)``, when given, is called after each step (``STEPS``, in order, the fill's own steps
after "created"; rebuild.py lists a whole rebuild's): the seam crash tests kill the process at
(StoreHooks.rebuild_step; cli/maintenance.rebuild_index_dir's ``step``).

State: none (files in the store directory).
"""

from __future__ import annotations

import logging
import os

from .index import Index, aside_name, detach

log = logging.getLogger("umbp_nvme.store")

TEMP_SUFFIX = ".rebuilding"  # index.lmdb.rebuilding (and its -lock): a build not yet in place
# after each: the temporary file exists | (the fill's own steps) | it is synced and marked | the old
# file is aside (the path names nothing) | the new file is at the path | the directory is synced
STEPS = ("created", "marked", "set_aside", "renamed", "dir_synced")


def temp_path(ipath: str) -> str:
    return ipath + TEMP_SUFFIX


def remove_leftovers(ipath: str) -> list[str]:
    """Remove the temporary files of a build (the caller holds the store's lock); the paths removed."""
    gone = []
    for p in (temp_path(ipath), temp_path(ipath) + "-lock"):
        try:
            os.unlink(p)  # never follows a symlink planted there
        except FileNotFoundError:
            continue
        gone.append(p)
    return gone


def settle_leftovers(ipath: str, map_size: int) -> str | None:
    """What an interrupted build left, settled by the next writer (it holds the store's lock)
    before it opens the index: a finished temporary file while the path names nothing (the build
    was stopped between moving the old file aside and the rename) is put in place, so the work
    is not lost (for a store without records it cannot be redone); anything else is removed.
    Returns a sentence for the log, None when there was nothing."""
    tmp = temp_path(ipath)
    if not os.path.lexists(tmp):
        return "removed " + ", ".join(remove_leftovers(ipath)) if os.path.lexists(tmp + "-lock") else None
    if not os.path.lexists(ipath):
        try:
            ix = Index(tmp, readonly=False, map_size=map_size, durable=False)  # checks every page first
            try:
                marked = ix.writer_state() is not None
            finally:
                ix.close()
        except Exception as e:  # noqa: BLE001 - a file that cannot tell is not finished
            log.info("%s: not a finished index (%s)", tmp, e)
            marked = False
        if marked:
            detach(tmp)
            for p in (tmp + "-lock", ipath + "-lock"):  # no environment of the old file may meet the new one
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            os.rename(tmp, ipath)
            sync_dir(os.path.dirname(ipath) or ".")
            return f"put the finished {tmp} in place"
    return "removed " + ", ".join(remove_leftovers(ipath))


def sync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _no_step(name: str) -> None:
    return None


def replace_index(ipath: str, map_size: int, fill, *, state: bytes, aside: str | None = None, step=None) -> str | None:
    """Build a new index with ``fill(ix, step)`` (it commits on the writer ``Index`` it is given and
    may call ``step`` after steps of its own),
    mark it ``state`` (commit and sync), and put it at ``ipath``; returns where the old file was
    moved (``aside``, or a free ``index.aside_name``), None when there was none.

    An exception (KeyboardInterrupt included) before the old file is moved aside removes the
    temporary files and leaves the path as it was; one after it still renames the new file (it
    is complete) into place, then propagates. Raises OSError when a file cannot be made, moved or
    synced: the path then names the old file, or nothing (the next writer rebuilds).
    """
    step = step or _no_step
    tmp = temp_path(ipath)
    remove_leftovers(ipath)
    try:
        ix = Index(tmp, readonly=False, map_size=map_size, durable=False)
        try:
            step("created")
            fill(ix, step)
            ix.set_writer_state(state)  # one commit, then the data file synced: records and mark durable
        finally:
            ix.close()
        os.unlink(tmp + "-lock")  # no process opens the temporary file again: its lock file is done
        step("marked")
    except BaseException:
        remove_leftovers(ipath)
        raise
    dest = None
    if os.path.lexists(ipath):
        dest = aside if aside is not None and not os.path.lexists(aside) else aside_name(ipath)
        try:
            os.rename(ipath, dest)
        except BaseException:
            remove_leftovers(ipath)
            raise
    try:  # the path names nothing until the rename below, which an interruption does not skip
        detach(ipath)
        try:
            os.unlink(ipath + "-lock")  # the old environment's: the next opener makes a fresh one
        except FileNotFoundError:
            pass
        step("set_aside")
    finally:
        os.rename(tmp, ipath)
    step("renamed")
    sync_dir(os.path.dirname(ipath) or ".")
    step("dir_synced")
    return dest
