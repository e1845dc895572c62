"""Drive membership with memory: the writer sessions each drive of a multi-drive store took part in.

A drive that was not open during a writer's session (removed from the roots, or it could not
open) missed that session's puts, re-puts, deletes and clears, and nothing can say which of its
pages they replaced: the owed log (owed_deletes.py) names the deletes and clears of a drive the
writer knew, but a key re-put on another drive and evicted there since, or re-put on a drive
that is absent now, leaves no trace, and a writer never hears of a drive removed from its roots.
So a drive that missed a writing session is cleared by the writer before it serves again, and a
reader does not serve it until a writer has: losing its cache is acceptable, serving a replaced
or deleted page is not. Which drives missed one, are older copies, copies or another store's is
judged from each drive's own record (drive_identity.py), before any drive is opened.

Recording, in two steps so that a kill between two drives' records loses nothing:

1. at open, once the drives are reconciled: on every drive that is open, the record of this
   session (``session``: its number, ``max(time_ns, newest recorded + 1)``) with the ``seen`` the
   drives' records hold, unchanged: a drive that took part in a session is never behind it;
2. before the session's first put, delete or clear: the members' ``seen`` entries raised to this
   session, on every drive that takes writes. A drive absent from it is then behind, whichever
   other drives it returns with.

Every record is written and fsynced (file and directory) on the drive's own record thread, in
call order, bounded by io_timeout_s. **A drive whose record could not be written takes no
writes** (drive_health.UNRECORDED: it still serves reads; puts go to the other drives, its deletes
are owed in the log on the drives that recorded the session, and with none of them the put or
delete answers False); the probe records it later. A drive the probe opens (or re-admits after it
could not be recorded) is recorded before it takes writes. A session that made no write call never
raised anything: a drive that missed only such sessions keeps its pages.

Reads: the drive stores through their public calls. Changes: the MultiDriveStore's own fields
(sessions, identities, DRIVES.json).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os

from . import owed_deletes
from .drive_health import UNRECORDED
from .drive_identity import COPY, CURRENT, FOREIGN, UNSTAMPED, ForeignDrive, History, merge, new_id
from .drive_probe import retrieved
from .drive_set import DRIVES_FILE, read_set, set_fields, write_record

log = logging.getLogger("umbp_nvme.store")

BEHIND = "behind"  # a reader's kind for a drive that missed a writer session (the writer clears it)


class SessionSteps:
    """Drive membership for MultiDriveStore (a mixin: it uses its roots, stores, health, readonly)."""

    def _sessions_at_open(self) -> None:
        """Read the drives' records (every configured root: one that will not open may still tell)
        and judge each drive, before any is opened."""
        n = len(self.roots)
        self._recs = [read_set(r) for r in self.roots]
        self._history = h = History(self.roots, self._recs)
        self.session = h.next_session()
        self._store_id = h.store_id or new_id()
        # a drive keeps its id (cleared if behind or an older copy); a copy or one without an id gets a new one
        self._drive_ids = [None if v == FOREIGN else i if i and v not in (COPY, UNSTAMPED) else new_id()
                           for (v, _), i in zip(h.verdicts, h.ids)]  # fmt: skip
        self._seen_open = dict(h.top)  # the writing sessions the set knows (raised for members once writing)
        self._extra_seen = [{} for _ in range(n)]  # a joiner's knowledge the other drives lack (its record only)
        self._joined = [False] * n
        self._recorded = [False] * n  # this session's record (as it stands now) is on the drive
        self._writing = False  # a put, delete or clear was called: records raise the members' entries
        self._writing_task = None
        self._health_rec = None  # the drives' states for DRIVES.json (umbp-nvme stats in another process)
        self._writes = 0  # puts, deletes and clears since open: a drive that joins later missed them
        self._record_pools = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="umbp-drive-record")
                              for _ in range(n)]  # fmt: skip
        self._record_hung = [False] * n
        self._records_closed = False

    def _same_store_records(self) -> list[dict]:
        return [{} if v == FOREIGN else rec for rec, (v, _) in zip(self._recs, self._history.verdicts)]

    def _foreign_at_open(self, d: int) -> str | None:
        v, why = self._history.verdicts[d]
        return why if v == FOREIGN else None

    # ------------------------------------------------------------------ records

    def _recordable(self) -> list[int]:
        """The drives whose DRIVES.json is written now: open, healthy, joined and recorded."""
        return [d for d, (st, h) in enumerate(zip(self.stores, self.health))
                if st is not None and h.healthy and self._joined[d] and self._recorded[d]]  # fmt: skip

    def session_seen(self, d: int | None = None) -> dict[str, int]:
        """The ``seen`` this session records (on drive ``d``: with what only that drive knew)."""
        seen = dict(self._seen_open)
        if d is not None:
            merge(seen, self._extra_seen[d])
        if self._writing:
            for x, i in enumerate(self._drive_ids):
                if i and (self._recorded[x] or x == d):
                    seen[i] = self.session
        return seen

    def session_record(self, d: int) -> dict:
        """The fields DRIVES.json keeps for this session on drive ``d`` (``members``, ``wrote``: for
        tools, and for code from before identities, which judges by them)."""
        members = [r for x, r in enumerate(self.roots) if self._recorded[x] or x == d]
        wrote = max(self._history.wrote, self.session if self._writing else 0)
        return {"store_id": self._store_id, "drive_id": self._drive_ids[d], "session": self.session,
                "seen": self.session_seen(d), "members": members, "wrote": wrote}  # fmt: skip

    def _write_record_now(self, d: int) -> None:
        """Write drive ``d``'s DRIVES.json (its record thread: fields read when it runs, in order)."""
        if self._records_closed:  # queued before close() and run after it: the next writer's record is not ours
            raise OSError(f"store {self.path} closed")
        health = dict(zip(self.roots, self._health_rec)) if self._health_rec else None
        rec = {**set_fields(self.roots, self.stores, health), **self.session_record(d)}
        path = os.path.join(self.roots[d], DRIVES_FILE)
        hook = getattr(self._open_kw.get("hooks"), "drive_record", None)
        if hook is None:
            write_record(path, rec)
        else:
            hook(write_record, path, rec)

    def _submit_record(self, d: int) -> asyncio.Future | None:
        if self._record_hung[d]:
            return None
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._record_pools[d], self._write_record_now, d)
        except RuntimeError:  # its pool is shut down: closed
            return None
        return retrieved(fut)

    async def _record(self, drives: list[int]) -> dict[int, BaseException | None]:
        """Write this session's record on each of ``drives`` at once; per drive the error when it
        was not written and fsynced within io_timeout_s (None: recorded). A write that hangs is given
        up on and keeps its thread; the drive's later records fail at once until it returns."""

        def unhung(d, _f):
            self._record_hung[d] = False

        async def one(d):
            fut = self._submit_record(d)
            if fut is None:
                return TimeoutError(f"an earlier write of its {DRIVES_FILE} has not returned")
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            except asyncio.TimeoutError:
                self._record_hung[d] = True
                fut.add_done_callback(lambda f, d=d: unhung(d, f))
                return TimeoutError(f"writing its {DRIVES_FILE} outlived io_timeout_s={self.timeout_s:g} s")
            except Exception as e:  # noqa: BLE001 - OSError (ENOSPC, EDQUOT, EIO, ...) or a hook's
                return e
            return None

        return dict(zip(drives, await asyncio.gather(*(one(d) for d in drives))))

    def _record_in_background(self) -> None:
        """Refresh DRIVES.json (states for the CLI) on the recorded drives, not waited for."""
        for d in self._recordable():
            fut = self._submit_record(d)
            if fut is not None:
                fut.add_done_callback(lambda f, d=d: f.cancelled() or f.exception() is None or log.warning(
                    "drive %s: could not record the drive set: %r", self.roots[d], f.exception()))

    def _unrecorded(self, d: int, e: BaseException) -> None:
        self._recorded[d] = False
        why = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}" if isinstance(e, OSError) and e.errno else repr(e)
        self.health[d].mark(UNRECORDED, f"its session record ({DRIVES_FILE}) could not be written and fsynced "
                            f"({why}): it serves reads, takes no writes and owes the deletes of its pages")  # fmt: skip

    async def _record_at_open(self) -> None:
        """Step 1: this session on every open, reconciled drive, ``seen`` unchanged."""
        drives = [d for d, st in enumerate(self.stores) if st is not None and self._joined[d]]
        for d, e in (await self._record(drives)).items():
            if e is None:
                self._recorded[d] = True
            else:
                self._unrecorded(d, e)

    async def _session_writes(self) -> None:
        """Step 2, before the session's first put, delete or clear (once; later calls pay one check)."""
        if self._writing_task is None:
            self._writing_task = asyncio.ensure_future(self._record_writing())
        if not self._writing_task.done():
            await asyncio.shield(self._writing_task)

    async def _record_writing(self) -> None:
        self._writing = True
        drives = self._recordable()
        for d in range(len(self.roots)):
            if d not in drives:  # out now: recorded again (raised) before it takes writes
                self._recorded[d] = False
        for d, e in (await self._record(drives)).items():
            if e is not None:
                self._unrecorded(d, e)

    async def _record_joiner(self, d: int) -> bool:
        """Record drive ``d`` (reconciled, about to take writes); False: it could not (UNRECORDED)."""
        e = (await self._record([d]))[d]
        if e is not None:
            self._unrecorded(d, e)
            return False
        self._recorded[d] = True
        return True

    # ------------------------------------------------------------------ reconciling

    async def _reconcile_at_open(self) -> None:
        """Before any drive serves: a writer clears every open drive whose record is not current,
        a reader holds it out (it looks again at each probe: the writer may clear it meanwhile)."""
        for d, st in enumerate(self.stores):
            if st is None:
                continue
            verdict, why = self._history.verdicts[d]
            if verdict == CURRENT:
                self._joined[d] = True
            elif self.readonly:
                self._hold_out(d, why)
            else:
                self._joined[d] = await self._clear_behind(d, st, why)

    def _hold_out(self, d: int, why: str) -> None:
        h = self.health[d]
        h.behind = True
        h.degrade(BEHIND, f"{why}; its pages are not served until a writer has cleared it")

    async def _clear_behind(self, d: int, st, why: str) -> bool:
        """Clear drive ``d`` (open, not current); False: it could not, so it is degraded and owes
        the clear (the probe applies it before re-admitting it)."""
        try:
            await self._clear_missed(d, st, why)
        except Exception as e:  # noqa: BLE001 - the drive stays out, the others serve
            h = self.health[d]
            h.clear_owed = True
            h.degrade("io_error", f"{why}, and clearing it failed: {e!r}")
            return False
        return True

    async def _clear_missed(self, d: int, st, why: str) -> None:
        n = st.object_count()
        await st.clear()
        if n > 0:
            log.warning("drive %s: %s; its %d objects may be replaced or deleted pages, so it was cleared",
                        self.roots[d], why, n)  # fmt: skip

    def _judge_joiner(self, d: int, rec: dict) -> tuple[str, str]:
        """The verdict on a drive the probe opened (its record read now) against this session."""
        if rec.get("store_id") not in (None, self._store_id):
            return FOREIGN, "it belongs to another store"
        twin = next((self.roots[x] for x, (st, i) in enumerate(zip(self.stores, self._drive_ids))
                     if x != d and st is not None and i and i == rec.get("drive_id")), None)  # fmt: skip
        if rec.get("store_id") is None:
            return UNSTAMPED, "it has no drive identity (its DRIVES.json is missing, unreadable or from before identities)"
        return History.judge(rec, self.session_seen(), twin)

    async def _reconcile_joiner(self, d: int, st) -> None:
        """A writer's drive the probe opened after the open: it missed every put, delete and clear
        made since, and any session its record says it missed: cleared then; else only the copies
        another drive holds go (owed_deletes.apply). Raises when that fails (the probe tries again)."""
        rec = await self._in_thread(d, read_set, self.roots[d])
        verdict, why = self._judge_joiner(d, rec)
        if verdict == FOREIGN:
            raise ForeignDrive(f"drive {self.roots[d]}: {why}")
        self._drive_ids[d] = rec["drive_id"] if verdict not in (COPY, UNSTAMPED) else new_id()
        known = self.session_seen()
        revealed = {i: s for i, s in History.seen_of(rec).items() if s > known.get(i, 0)}
        if revealed:  # sessions the open drives missed: they are found behind at the next open
            self._extra_seen[d] = revealed
            log.warning("drive %s records writer sessions the other drives missed (%s); it is cleared now, and the "
                        "others at the next open", self.roots[d], ", ".join(map(str, sorted(revealed.values()))))  # fmt: skip
            verdict, why = BEHIND, "it records sessions the others missed"
        writes = self._writes
        if verdict == CURRENT and not writes:
            others = [s for s in self.stores if s is not None]
            self.health[d].deletes_owed |= await owed_deletes.apply(st, set(), True, others)
            if self._writes == writes:  # none came in while its copies were looked at
                self._joined[d] = True
                return
        if verdict == CURRENT:
            why = "it missed the puts, deletes or clears made since this writer opened"
        await self._clear_missed(d, st, why)
        self._joined[d] = True

    async def _caught_up(self, d: int) -> bool:
        """A reader: whether drive ``d`` (held out) is current now (a writer cleared and recorded it)."""
        recs = await self._in_thread(d, lambda: [read_set(r) for r in self.roots])
        if History(self.roots, recs).verdicts[d][0] != CURRENT:
            return False
        self.health[d].behind = False
        return True

    def _close_records(self) -> None:
        self._records_closed = True
        for p in self._record_pools:
            p.shutdown(wait=False, cancel_futures=True)
