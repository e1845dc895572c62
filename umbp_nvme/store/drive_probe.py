"""The background side of MultiDriveStore: probes, re-admission, and deletes owed durably.

A mixin of ``drives.MultiDriveStore`` (it uses its roots, stores and health): every
``probe_interval_s`` a healthy drive is checked for its directory and a degraded one probed (its
directory, one object read back, its owed deletes applied) before it serves again; a drive that
could not open is opened once its store is back. Deletes a degraded drive owes are recorded in
owed_deletes.py's log on the healthy drives before they are acknowledged, and applied at the next
open when the process ended first.

Reads: the drive stores through their public calls (lock_fd, stats, delete_pending, ...). Changes:
the MultiDriveStore's own fields (stores, health, probes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import time

from . import owed_deletes
from .drive_health import FOREIGN, FULL, UNMOUNTED, UNRECORDED, DriveHealth, reads_back, settle_deletes
from .drive_identity import ForeignDrive
from .drive_set import capacity_share, read_set, sized_share
from .layout import LOCK_FILE, MANIFEST_FILE
from .mounts import unmounted_reason

log = logging.getLogger("umbp_nvme.store")

LOG_THREADS = 4  # per drive: owed-log appends that may hang at once before its log refuses at once


def retrieved(fut: asyncio.Future) -> asyncio.Future:
    """``fut`` whose exception counts as seen: a thread call given up on at io_timeout_s that fails
    later is no "Future exception was never retrieved" error (its caller already logged it)."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


def _holds_lock_at(root: str, lock_fd: int) -> bool:
    """Whether the LOCK at ``root`` is the file a writer's ``lock_fd`` holds (True for a reader: -1).
    FileNotFoundError when it is gone."""
    if lock_fd < 0:
        return True
    a, b = os.stat(os.path.join(root, LOCK_FILE)), os.fstat(lock_fd)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class DriveProbes:
    """Probing and owed deletes for MultiDriveStore (which sets the attributes used here)."""

    _owes_unlogged_said = False  # the WARNING that owed deletes were recorded on no drive was logged

    def _start_background(self) -> None:
        n = len(self.roots)
        self._probe_pool = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="umbp-drive-probe")
        # LOG_THREADS per drive for the owed-deletes log: an append that hangs (a stalled fsync) holds
        # one of them, not the later owes; its lines are ordered by the ``at`` stamped here at submission
        pool = concurrent.futures.ThreadPoolExecutor
        self._log_pools = [pool(LOG_THREADS, thread_name_prefix="umbp-owed-log") for _ in range(n)]
        self._log_busy = [0] * n  # appends not returned yet per drive (never more than its threads)
        self._log_at = 0
        self._thread_calls: dict[int, asyncio.Future] = {}  # drive -> its probe thread's call
        self._probes: set[asyncio.Task] = set()  # probes under way: close() cancels and awaits them
        self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _stop_background(self) -> None:
        """Cancel the probe loop and every probe, and wait for them: none outlives the store (a
        probe's read ends only once the kernel let go of its buffer; a store it opened is closed)."""
        tasks = [self._probe_task, *self._probes]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probe_pool.shutdown(wait=False)
        for p in self._log_pools:
            p.shutdown(wait=False)

    # ------------------------------------------------------------------ owed deletes

    @property
    def owed_log_appends_running(self) -> list[int]:
        """Per drive, owed-deletes log appends not returned yet (a hung fsync holds one)."""
        return list(self._log_busy)

    async def _settle_owed_at_open(self) -> None:
        """Apply what the drives owe (the logs of the drives that opened) before any of them serves.
        A reader cannot delete: it hides the owed keys and looks at a stale drive last."""
        opened = [r for r, s in zip(self.roots, self.stores) if s is not None]
        state = await asyncio.to_thread(owed_deletes.load, opened)
        changed = False
        for d, (r, st) in enumerate(zip(self.roots, self.stores)):
            h = self.health[d]
            if st is None:
                h.deletes_owed.update(state.keys.get(r, ()))  # applied when it opens in this run
                h.clear_owed = r in state.cleared
                if not self.readonly and r not in state.out:
                    state.out.add(r)  # it misses this run's writes: its copies are stale where others hold one
                    changed = True
                continue
            if not state.owes(r):
                continue
            if self.readonly:
                h.deletes_owed = set(state.keys.get(r, ()))
                if r in state.out:
                    self._order = [i for i in self._order if i != d] + [d]
                if r in state.cleared:  # its pages were cleared: none is served until the writer clears it
                    h.clear_owed = True
                    h.degrade("cleared", "the writer cleared the store while this drive was degraded")
                continue
            others = [s for s in self.stores if s is not None and s is not st]
            left = await owed_deletes.apply(st, state.keys.get(r, set()), r in state.out, others, r in state.cleared)
            state.settle(r)
            changed = True
            if left:
                state.keys[r] = h.deletes_owed = left
                h.degrade("io_error", f"{len(left)} deletes it owed from before the restart failed")
        if changed and not self.readonly:
            for r in opened:
                try:
                    await asyncio.to_thread(owed_deletes.rewrite, r, state, self.roots)
                except OSError as e:
                    log.warning("drive %s: could not rewrite %s: %s", r, owed_deletes.OWED_FILE, e)

    async def _drop_elsewhere(self, keys: list[str], skip: list[bool], *, deleting: bool = False):
        """Delete ``keys`` on every drive not in ``skip``: at once where the drive still serves reads
        (full), else owed until it rejoins (recorded durably before this returns: _owe).
        Returns (gone, kept): keys a drive held and no longer serves (deleted, or owed durably), and
        keys a drive may still serve after a restart (a failed delete, an owe no log recorded)."""
        gone: set[str] = set()
        kept: set[str] = set()
        owed: dict[int, list[str]] = {}
        held_owed: set[str] = set()
        for d, (st, h, sk) in enumerate(zip(self.stores, self.health, skip)):
            if sk:
                continue
            if st is None:  # its index is not open: a deleted key may be there (a re-put one is stale anyway)
                if deleting and h.kind != FOREIGN and _unrecorded(h, keys):
                    owed[d] = _unrecorded(h, keys)
                continue
            held = [k for k, f in zip(keys, st.exists_many_nowait(keys)) if f]
            if not held:
                continue
            if h.takes_deletes:
                for k, ok in zip(held, await st.delete_many(held)):
                    (gone if ok else kept).add(k)
                continue
            held_owed.update(held)
            if _unrecorded(h, held):
                owed[d] = _unrecorded(h, held)
        durable = await self._owe(owed) if owed else True
        if not durable:
            kept.update(k for ks in owed.values() for k in ks)
        gone.update(held_owed - kept)
        return gone, kept

    async def _owe_clear(self, drives: list[int]) -> bool:
        """The store was cleared while ``drives`` were degraded: each clears itself before it serves.
        False when no log recorded it (kept in memory only: a restart would serve their pages)."""
        for d in drives:
            self.health[d].clear_owed = True
            self.health[d].deletes_owed.clear()
            self.health[d].owed_unlogged.clear()
        if await self._log([{"drive": self.roots[d], "clear": True} for d in drives]):
            return True
        log.warning("the clear owed by drive(s) %s is recorded on no drive: kept in memory only",
                    ", ".join(self.roots[d] for d in drives))  # fmt: skip
        return False

    async def _owe(self, owed: dict[int, list[str]]) -> bool:
        """Drive ``d`` owes the deletes of ``owed[d]``: kept in memory and, before this returns, in
        the log on every healthy drive (so a restart still applies them). False when no drive
        recorded them: the caller must not acknowledge them (a restart would serve the keys)."""
        for d, keys in owed.items():
            self.health[d].deletes_owed.update(keys)
        if await self._log([{"drive": self.roots[d], "keys": sorted(k)} for d, k in owed.items()]):
            for d, keys in owed.items():
                self.health[d].owed_unlogged.difference_update(keys)
            self._owes_unlogged_said = False
            return True
        for d, keys in owed.items():
            self.health[d].owed_unlogged.update(keys)
        # once until an owe is recorded again (no drive may take them for a while: every call would log)
        (log.debug if self._owes_unlogged_said else log.warning)(
            "owed deletes of drive(s) %s recorded on no drive: kept in memory only, not acknowledged",
            ", ".join(self.roots[d] for d in owed))  # fmt: skip
        self._owes_unlogged_said = True
        return False

    async def _log(self, entries: list[dict], also: int | None = None) -> int:
        """Append ``entries`` to the owed-deletes log of every healthy drive (and drive ``also``); how
        many recorded them (fsynced within io_timeout_s). An append that outlives it is given up (its
        thread is left to it; it is not counted) and later appends use the drive's other threads; with
        all LOG_THREADS hung the drive's log answers "not recorded" at once until one returns."""
        loop = asyncio.get_running_loop()
        live = [d for d, (st, h) in enumerate(zip(self.stores, self.health))
                if st is not None and (h.healthy or d == also)]  # fmt: skip
        # stamped here, in call order: lines appended by several threads still merge in that order
        # (a settled line cancels only the owes made before it)
        self._log_at = at = max(time.time_ns(), self._log_at + 1)
        entries = [dict(e, at=at) for e in entries]

        def done(d, _f):
            self._log_busy[d] -= 1

        async def one(d):
            if self._log_busy[d] >= LOG_THREADS:
                log.warning("drive %s: could not record owed deletes: %d appends to its log hang", self.roots[d],
                            self._log_busy[d])  # fmt: skip
                return 0
            try:
                fut = retrieved(loop.run_in_executor(self._log_pools[d], owed_deletes.append, self.roots[d], entries))
            except RuntimeError as e:  # the pool is shut down: close() is under way
                log.warning("drive %s: could not record owed deletes: %r", self.roots[d], e)
                return 0
            self._log_busy[d] += 1
            fut.add_done_callback(functools.partial(done, d))
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
                return 1
            except Exception as e:  # noqa: BLE001 - OSError, a hung drive, or a close() under way: never raise
                log.warning("drive %s: could not record owed deletes: %r", self.roots[d], e)
                return 0

        return sum(await asyncio.gather(*(one(d) for d in live)))

    # ------------------------------------------------------------------ probes

    async def _probe_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.probe_interval_s)
            if any(h.changed for h in self.health) and not self.readonly:
                for h in self.health:
                    h.changed = False
                self._record_set()
            now = time.monotonic()
            for d, h in enumerate(self.health):
                if not h.probing and not self._closed and now >= h.probe_after:
                    h.probing = True
                    t = asyncio.get_running_loop().create_task(self._probe(d))
                    self._probes.add(t)
                    t.add_done_callback(self._probes.discard)

    def _record_set(self) -> None:
        """DRIVES.json on the recorded drives with their states, written off the loop (it fsyncs)."""
        self._health_rec = [h.record(r) for h, r in zip(self.health, self.stats()["drives"])]
        self._record_in_background()

    async def _in_thread(self, d: int, fn, *args):
        """``fn(*args)`` on a probe thread, bounded by io_timeout_s. A call that hung is given up on
        but keeps its thread: no second one for that drive until it ends (threads stay free)."""
        prev = self._thread_calls.get(d)
        if prev is not None and not prev.done():
            raise asyncio.TimeoutError
        fut = retrieved(asyncio.get_running_loop().run_in_executor(self._probe_pool, fn, *args))
        self._thread_calls[d] = fut
        return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)

    async def _probe(self, d: int) -> None:
        h, st = self.health[d], self.stores[d]
        try:
            if st is None:
                await self._reopen(d)
                return
            if h.pending:  # a call of ours is still in flight there (stalled): not yet
                return
            try:
                await self._in_thread(d, os.stat, os.path.join(self.roots[d], MANIFEST_FILE))
                same = await self._in_thread(d, _holds_lock_at, self.roots[d], st.lock_fd)
            except (FileNotFoundError, NotADirectoryError):  # removed, or replaced by a file
                h.degrade("gone", f"its directory {self.roots[d]} is gone (no {MANIFEST_FILE})")
                return
            except (OSError, asyncio.TimeoutError):
                return
            if not same:  # our files now lie elsewhere: new pages written there would be lost at restart
                h.degrade("gone", f"its directory {self.roots[d]} was replaced (its {LOCK_FILE} is not the one held)")
                return
            if h.healthy:
                return
            if h.kind == FULL:
                vfs = await self._in_thread(d, os.statvfs, self.roots[d])
                if vfs.f_bavail * vfs.f_frsize >= self.segment_bytes and await self._recorded_now(d):
                    h.readmit()
                return
            await self._settle_and_readmit(d)
        except Exception as e:  # noqa: BLE001 - a probe never takes the store down
            log.debug("drive %d probe failed: %r", d, e)
        finally:
            h.probing = False

    async def _reopen(self, d: int) -> None:
        """A drive that could not open at first: opened again once its store is back (never created here:
        an unmounted drive's empty mount point must not get a new store on the wrong file system). A
        drive held out as unmounted (mounts.py) opens, creating its store, once the mount rule passes."""
        try:
            if self.health[d].kind == FOREIGN:  # opened once its directory no longer holds another store's drive
                rec = await self._in_thread(d, read_set, self.roots[d])
                if rec.get("store_id") not in (None, self._store_id):
                    return
            if self.health[d].kind == UNMOUNTED:
                why = await self._in_thread(d, unmounted_reason, d, self.roots, self.config.ssd_require_mount)
                if why:
                    return
                if self._sized:  # its share was not sized on the file system that was missing
                    cfg, root = self.config, self.roots[d]
                    share = capacity_share(cfg, len(self.roots))
                    self._caps[d] = await self._in_thread(d, sized_share, root, share, int(cfg.ssd_segment_size_bytes))
            else:
                await self._in_thread(d, os.stat, os.path.join(self.roots[d], MANIFEST_FILE))
            st = await self._open_drive(d)  # a cancelled open releases what it took (opening.py)
        except Exception as e:  # noqa: BLE001 - still out; the next probe tries again
            log.debug("drive %d still cannot open: %r", d, e)
            return
        try:
            ok = await self._join_opened(d, st)
        except BaseException:  # cancelled by close(): the store (its lock) must not outlive us
            await asyncio.shield(st.close())
            raise
        if not ok:
            await st.close()
            return
        self.stores[d] = st
        await self._settle_and_readmit(d)

    async def _join_opened(self, d: int, st) -> bool:
        """Ready a drive the probe opened to take its place; False: close it (store closed, or its
        stale copies could not be dropped: the next probe tries again)."""
        if self._closed:
            return False
        for a, n in self._ranges:
            st.register_memory(a, n)
        # it missed the writes made while it was out (drive_sessions.py)
        if self.readonly:  # a reader cannot delete them: it looks at this drive last
            self._order = [i for i in self._order if i != d] + [d]
            if not await self._caught_up(d):
                self.health[d].behind = True  # not served until a writer has cleared it
        else:
            try:
                await self._reconcile_joiner(d, st)
            except ForeignDrive as e:  # not ours after all: closed, and never written
                self.health[d].mark(FOREIGN, str(e))
                return False
            except Exception as e:  # noqa: BLE001 - not yet: closed (its lock freed) for the next probe
                log.debug("drive %d: reconciling it failed: %r", d, e)
                return False
        return not self._closed  # closed while it was reconciled

    async def _settle_and_readmit(self, d: int) -> None:
        """Re-admit a degraded drive once an object reads back and its owed deletes are applied; the
        log then records it settled (owes that arrived meanwhile are recorded again, and wait)."""
        h, st = self.health[d], self.stores[d]
        if h.kind == UNRECORDED and not await self._recorded_now(d):  # not yet: nothing else is tried
            return
        if not await reads_back(st, h):
            return
        if self.readonly:  # it hides what the drive owes; the writer applies it
            if not h.clear_owed and not (h.behind and not await self._caught_up(d)):
                h.readmit()
            return
        if not await settle_deletes(st, h):
            return
        h.owed_unlogged.clear()  # all applied
        # owes made while this append runs are appended after it (one log thread per drive, tasks in
        # order), so the settled line cancels only what was applied; in its own log too (no other
        # drive may be healthy)
        if not await self._log([{"drive": self.roots[d], "settled": True}], also=d):
            return  # recorded settled nowhere: not yet (a restart would apply the old owes over later puts)
        if h.deletes_owed:  # owed meanwhile (recorded after the settled line): the next probe applies them
            return
        self._joined[d] = True  # everything it owed is applied (a drive that missed a session: its clear)
        if await self._recorded_now(d):  # no write before its record shows this session
            h.readmit()

    async def _recorded_now(self, d: int) -> bool:
        """A writer's drive about to take writes again: this session recorded on it first."""
        return self.readonly or self._recorded[d] or await self._record_joiner(d)


def _unrecorded(h: DriveHealth, keys) -> list[str]:
    """Keys whose delete ``h``'s drive does not owe yet, or owes without a log recording it."""
    return [k for k in keys if type(k) is str and (k not in h.deletes_owed or k in h.owed_unlogged)]
