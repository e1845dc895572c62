"""Drive membership with memory: the writer sessions each drive of a multi-drive store took part in.

A drive that was not open during a writer's session (removed from the roots, or it could not
open) missed that session's puts, re-puts, deletes and clears, and nothing can say which of its
pages they replaced: the owed log (owed_deletes.py) names the deletes and clears of a drive the
writer knew, but a key re-put on another drive and evicted there since, or re-put on a drive
that is absent now, leaves no trace, and a writer never hears of a drive removed from its roots.
So a drive that missed a writer session is cleared by the writer before it serves again, and a
reader does not serve it until a writer has: losing its cache is acceptable, serving a replaced
or deleted page is not.

The memory is each drive's DRIVES.json: ``session``, the newest writer session the drive took
part in, ``members``, the drives that took part in it, and ``wrote``, the newest session known
to have written (put, deleted or cleared). A writer numbers its session at open
(``max(time_ns, newest recorded + 1)``, so two runs over disjoint subsets of the drives never
share a number) and records it, as a session that wrote, before its first put, delete or clear,
on each drive that is open and reconciled (``joined``); a drive that joins later (the probe
opened it) is recorded once it is healthy. A clean close of a session that made no write call
records ``wrote`` as it was before (an absent drive missed nothing then). At the next open a
drive whose session is older than the newest that wrote missed writes. A drive whose own record
is unreadable took part in the newest session whose ``members`` name it. A set where no drive records a session (written before this rule) falls
back on the recorded roots: a drive is behind when another drive's record omits it while its own
record names that drive (it was removed and that drive went on without it).

What it cannot see: a session run only on drives that are all absent or unreadable now.

Reads: the drive stores through their public calls. Changes: the MultiDriveStore's own fields
(sessions, DRIVES.json).
"""

from __future__ import annotations

import logging
import time

from . import owed_deletes
from .drive_set import read_set

log = logging.getLogger("umbp_nvme.store")

BEHIND = "behind"  # a reader's kind for a drive that missed a writer session (the writer clears it)


def _session(rec: dict) -> int | None:
    s = rec.get("session")
    return s if type(s) is int and s > 0 else None


def _wrote(rec: dict) -> int:
    s = _session(rec)
    w = rec.get("wrote")
    return min(w, s) if s and type(w) is int and w >= 0 else s or 0


def _names(rec: dict, field: str) -> list[str]:
    v = rec.get(field)
    return [r for r in v if isinstance(r, str)] if isinstance(v, list) else []


class Sessions:
    """What the drives' records say: the newest session any drive took part in (``top``) and the
    newest that wrote (``wrote``), the one each drive last took part in (``last``), and the drives
    that missed a session that wrote (``behind``)."""

    def __init__(self, roots: list[str], recs: list[dict]):
        took: dict[str, int] = {}
        for rec in recs:
            s = _session(rec)
            for m in _names(rec, "members") if s else ():
                took[m] = max(took.get(m, 0), s)
        self.last = [max(_session(rec) or 0, took.get(r, 0)) for r, rec in zip(roots, recs)]
        self.top = max([0, *self.last, *took.values()])
        self.wrote = max([0, *(_wrote(rec) for rec in recs)])
        if self.top:
            self.behind = [s < self.wrote for s in self.last]
        else:  # no session recorded anywhere: only the recorded roots can tell
            named = [set(_names(rec, "roots")) for rec in recs]
            self.behind = [
                any(j != i and roots[j] in named[i] and named[j] and roots[i] not in named[j] for j in range(len(roots)))
                for i in range(len(roots))
            ]  # fmt: skip

    def next_session(self) -> int:
        return max(time.time_ns(), self.top + 1)


class SessionSteps:
    """Drive membership for MultiDriveStore (a mixin: it uses its roots, stores, health, readonly)."""

    def _sessions_at_open(self) -> None:
        """Read the drives' records (every configured root: one that did not open may still tell)."""
        self._recs = [read_set(r) for r in self.roots]
        self._sessions = Sessions(self.roots, self._recs)
        self.session = self._sessions.next_session()
        self._joined = [False] * len(self.roots)
        self._writes = 0  # puts, deletes and clears since open: a drive that joins later missed them

    def _recordable(self) -> list[bool]:
        """The drives whose DRIVES.json is written now: open, healthy and joined in this session."""
        return [st is not None and h.healthy and j for st, h, j in zip(self.stores, self.health, self._joined)]

    def session_record(self, closing: bool = False) -> dict:
        """The fields DRIVES.json keeps for the session (drive_set.write_drive_set). ``closing``:
        no call can start any more, so a session that made no write call can say so."""
        members = [r for r, st, j in zip(self.roots, self.stores, self._joined) if st is not None and j]
        wrote = self._sessions.wrote if closing and not self._writes else self.session
        return {"session": self.session, "members": members, "wrote": wrote}

    async def _reconcile_at_open(self) -> None:
        """Before any drive serves: a writer clears every open drive that missed a session, a reader
        holds it out (it looks again at each probe: the writer may clear it meanwhile)."""
        for d, st in enumerate(self.stores):
            if st is None:
                continue
            if not self._sessions.behind[d]:
                self._joined[d] = True
            elif self.readonly:
                self._hold_out(d)
            else:
                self._joined[d] = await self._clear_behind(d, st)

    def _hold_out(self, d: int) -> None:
        h = self.health[d]
        h.behind = True
        h.degrade(BEHIND, "it missed a writer session (removed from the roots or not open); its pages "
                  "are not served until a writer has cleared it")  # fmt: skip

    async def _clear_behind(self, d: int, st) -> bool:
        """Clear drive ``d`` (open, missed a session); False: it could not, so it is degraded and
        owes the clear (the probe applies it before re-admitting it)."""
        try:
            await self._clear_missed(d, st)
        except Exception as e:  # noqa: BLE001 - the drive stays out, the others serve
            h = self.health[d]
            h.clear_owed = True
            h.degrade("io_error", f"it missed a writer session and clearing it failed: {e!r}")
            return False
        return True

    async def _clear_missed(self, d: int, st) -> None:
        n = st.object_count()
        await st.clear()
        if n > 0:
            log.warning("drive %s missed a writer session (removed from the roots or not open) or writes made "
                        "since this one opened: its %d objects may be replaced or deleted pages, so it was "
                        "cleared", self.roots[d], n)  # fmt: skip

    async def _reconcile_joiner(self, d: int, st) -> None:
        """A writer's drive the probe opened after the open: it missed every put, delete and clear
        made since, and any session its record says it missed: cleared then; else only the copies
        another drive holds go (owed_deletes.apply). Raises when that fails (the probe tries again)."""
        rec = await self._in_thread(d, read_set, self.roots[d])
        last = max(_session(rec) or 0, self._sessions.last[d])
        writes = self._writes
        if last >= self._sessions.wrote and not writes:
            others = [s for s in self.stores if s is not None]
            self.health[d].deletes_owed |= await owed_deletes.apply(st, set(), True, others)
            if self._writes == writes:  # none came in while its copies were looked at
                self._joined[d] = True
                return
        await self._clear_missed(d, st)  # raises: not joined, the probe closes it and tries again
        self._joined[d] = True

    async def _caught_up(self, d: int) -> bool:
        """A reader: whether drive ``d`` (held out as behind) took part in the newest session now."""
        recs = await self._in_thread(d, lambda: [read_set(r) for r in self.roots])
        if Sessions(self.roots, recs).behind[d]:
            return False
        self.health[d].behind = False
        return True
