"""Replacing index.lmdb so that a crash at any moment leaves a file an open can judge.

An open trusts an index that carries a writer state (index.py): a clean close, or a writer of this
boot whose commits a process kill cannot lose. A new index is therefore built under a temporary
name beside the path (``TEMP_SUFFIX``), filled, committed, synced and marked with its writer state,
and only then put at the path; the directory is synced last. At every moment the path names the
old file (the next open decides again what this one decided), nothing (a writer rebuilds a missing
index; a follower misses), or the finished new file; never a half-built or empty one.

The old file is moved aside and its LMDB lock file removed while the path names nothing, so no
process can open the new data file with the old environment's lock file (it holds the old file's
transaction ids). Where it goes depends on what it was (each can be as large as the index, hundreds
of MB at millions of objects, so none piles up):

* damaged (the caller says so): kept for diagnosis as ``index.lmdb.corrupt-<time>[.n]``
  (``damaged_copy_name``); before a build that will add one, the older copies beyond the newest
  ``DAMAGED_COPIES_KEPT - 1`` are removed (each logged), so at most ``DAMAGED_COPIES_KEPT`` exist
  at any moment, a kill at any step included;
* sound (``verify --rebuild-index`` on a healthy index, one that may be behind its segments after a
  power loss): moved to ``index.lmdb.replaced`` (one name: at most one such file) and removed once
  the new file is at the path and the directory synced. The segments' records are the truth such
  a rebuild works from, so the old file has nothing the new one lacks.

What a killed build left is settled by the next writer or ``verify --rebuild-index`` (both hold the
store's lock) before they look at the index: a finished file whose rename was all that was left is
put in place, anything else removed; a replaced file is removed once the path names an index. The
live index and a build in progress (``TEMP_SUFFIX``) are never among what is pruned or removed.

``step(name)``, when given, is called after each step (``STEPS``, in order, the fill's own steps
after "created"; rebuild.py lists a whole rebuild's): the seam crash tests kill the process at
(StoreHooks.rebuild_step; cli/maintenance.rebuild_index_dir's ``step``).

State: none (files in the store directory).
"""

from __future__ import annotations

import logging
import os
import re
import time

from ..errors import IndexDamagedError
from .index import Index, detach

log = logging.getLogger("umbp_nvme.store")

TEMP_SUFFIX = ".rebuilding"  # index.lmdb.rebuilding (and its -lock): a build not yet in place
REPLACED_SUFFIX = ".replaced"  # index.lmdb.replaced: a sound index being replaced, removed at the end
DAMAGED_COPIES_KEPT = 2  # index.lmdb.corrupt-<time> copies kept for diagnosis, the newest ones
# after each: older damaged copies pruned | the temporary file exists | (the fill's own steps) | it
# is synced and marked | the old file is aside (the path names nothing) | the new file is at the
# path | the directory is synced | a replaced sound file is removed
STEPS = ("pruned", "created", "marked", "set_aside", "renamed", "dir_synced", "old_removed")


def temp_path(ipath: str) -> str:
    return ipath + TEMP_SUFFIX


def _copies(ipath: str) -> list[tuple[tuple[str, int], str]]:
    d, base = os.path.split(ipath)
    pat = re.compile(re.escape(base) + r"\.corrupt-(\d{8}-\d{6})(?:\.(\d+))?")
    found = []
    with os.scandir(d or ".") as it:
        for e in it:
            m = pat.fullmatch(e.name)
            if m and not e.is_dir(follow_symlinks=False):  # a directory of that name is not a copy of ours
                found.append(((m.group(1), int(m.group(2) or 0)), os.path.join(d, e.name)))
    return sorted(found)


def damaged_copies(ipath: str) -> list[str]:
    """The ``<ipath>.corrupt-<YYYYmmdd-HHMMSS>[.n]`` copies beside ``ipath``, oldest first (by the
    time and number in the name: a rename keeps the file's own times). Other names are not ours."""
    return [p for _, p in _copies(ipath)]


def damaged_copy_name(ipath: str) -> str:
    """A free name for the next damaged copy that sorts after every copy there (``file_ident.aside_name``
    would reuse a pruned name of this second, which sorts before its ``.n`` siblings)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    same = [n for (s, n), _ in _copies(ipath) if s == stamp]
    return f"{ipath}.corrupt-{stamp}" + (f".{max(same) + 1}" if same else "")


def prune_damaged(ipath: str, keep: int) -> list[str]:
    """Remove all but the newest ``keep`` damaged copies of ``ipath`` (the caller holds the store's
    lock); each removal is logged. The paths removed."""
    gone, copies = [], damaged_copies(ipath)
    for p in copies[: max(0, len(copies) - keep)]:
        try:
            os.unlink(p)  # a symlink planted there is removed, never followed
        except FileNotFoundError:
            continue
        except OSError as e:  # a copy that stays costs space, not data: the rebuild goes on
            log.warning("%s: cannot remove the older damaged copy %s (%s); remove it by hand",
                        os.path.dirname(ipath) or ".", p, e.strerror or e)  # fmt: skip
            continue
        log.warning("%s: removed an older damaged copy of %s, %s (at most %d are kept)",
                    os.path.dirname(ipath) or ".", os.path.basename(ipath), p, keep)  # fmt: skip
        gone.append(p)
    return gone


def index_damage(ipath: str, map_size: int) -> str | None:
    """Why the index at ``ipath`` is damaged (it cannot be opened, or its scan found damaged
    nodes), None when it opens and scans clean or there is none: whether a rebuild keeps it."""
    if not os.path.lexists(ipath):
        return None
    try:
        ix = Index(ipath, readonly=True, map_size=map_size, durable=False, wait_s=0.0)
    except IndexDamagedError as e:
        return str(e).split("; its writer")[0]  # a reader's advice, not for this caller
    except (FileNotFoundError, OSError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - lmdb's own errors, wrapped or not: it cannot be read
        return f"{type(e).__name__}: {e}"
    try:
        ix.scan()
        return ix.scan_damage
    except Exception as e:  # noqa: BLE001 - a scan that fails is damage too
        return f"{type(e).__name__}: {e}"
    finally:
        ix.close()


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
    A replaced sound index (``REPLACED_SUFFIX``) is removed once the path names an index again.
    Returns a sentence for the log, None when there was nothing."""
    done = _settle_temp(ipath, map_size)
    old = ipath + REPLACED_SUFFIX
    if os.path.lexists(old) and os.path.lexists(ipath) and _remove_replaced(old):
        done = f"{done}; removed {old}" if done else f"removed {old} (the index it was replaced by is in place)"
    return done


def _remove_replaced(old: str) -> bool:
    """Remove a replaced sound index; one that cannot be removed is logged and left for the next try."""
    try:
        os.unlink(old)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("%s: cannot remove %s, a replaced index (%s); the next writer tries again, or remove it",
                    os.path.dirname(old) or ".", old, e.strerror or e)  # fmt: skip
        return False


def _settle_temp(ipath: str, map_size: int) -> str | None:
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


def replace_index(ipath: str, map_size: int, fill, *, state: bytes, old_damaged: bool, aside: str | None = None,
                  step=None) -> str | None:  # fmt: skip
    """Build a new index with ``fill(ix, step)`` (it commits on the writer ``Index`` it is given and
    may call ``step`` after steps of its own),
    mark it ``state`` (commit and sync), and put it at ``ipath``. The old file, if any, is kept
    when ``old_damaged`` (returns where: ``aside``, or a free ``damaged_copy_name``; older damaged
    copies are pruned first), else removed once the new one is in place (returns None, as when
    there was none).

    An exception (KeyboardInterrupt included) before the old file is moved aside removes the
    temporary files and leaves the path as it was; one after it still renames the new file (it
    is complete) into place, then propagates. Raises OSError when a file cannot be made, moved or
    synced: the path then names the old file, or nothing (the next writer rebuilds).
    """
    step = step or _no_step
    tmp = temp_path(ipath)
    remove_leftovers(ipath)
    keep_old = old_damaged and os.path.lexists(ipath)
    prune_damaged(ipath, DAMAGED_COPIES_KEPT - 1 if keep_old else DAMAGED_COPIES_KEPT)
    step("pruned")
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
        if not keep_old:
            dest = ipath + REPLACED_SUFFIX  # one name: a stale one a kill left is replaced by the rename
        else:
            dest = aside if aside is not None and not os.path.lexists(aside) else damaged_copy_name(ipath)
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
    if dest is not None and not keep_old:
        _remove_replaced(dest)  # the new file is at the path and the rename durable: the sound old one is not needed
        dest = None
    step("old_removed")
    return dest
