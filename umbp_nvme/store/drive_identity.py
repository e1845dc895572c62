"""Which drives of a multi-drive store may serve, judged from each drive's OWN record.

A drive's ``DRIVES.json`` (drive_set.py) carries its identity and its history:

* ``store_id``: the drive set's id (random, made when a set is first stamped), shared by its drives;
* ``drive_id``: this drive's own id (random; a copy of the directory carries it too);
* ``session``: the newest writer session this drive's record was written in (it took part);
* ``seen``: ``{drive_id: session}``, for every drive of the set, the newest session that wrote in
  which that drive took part, as the writer of ``session`` knew it: merged from every record it
  read at its open, and the entries of its own members raised to ``session`` once the session
  writes (drive_sessions.py records that before its first put, delete or clear).

A drive took part in every session that wrote which its own ``seen`` covers. The ``seen`` entries
of all drives' records merged (``top``) are the writing sessions some drive took part in. A drive
is **current** when its own record covers all of them (an entry for the session it took part in
itself is covered: it missed nothing of it). Another drive's record never vouches for a drive; it
only adds sessions the drive missed. The verdicts:

* ``behind``: a writing session of some drive that its own record does not cover: it missed it
  (runs on disjoint subsets of the drives miss each other's sessions, whatever their numbers);
* ``older``: the other drives record it in a writing session newer than its own record: an older
  copy of it (a restored snapshot, an old disk put back);
* ``copy``: two roots carry one drive id: all but the one with the newest record are copies;
* ``unstamped``: no identity (no record, an unreadable one, or one written before identities)
  while the set has identities: its history is unknown;
* ``foreign``: another store's id.

Behind, older, copy and unstamped drives are cleared by a writer before they serve and held out by
a reader until then (drive_sessions.py); a foreign drive is never opened, written or cleared.

Not seen: a copy of a drive taken while a writer ran, put back before any later session (its
record is the one that session wrote); a set whose drives are ALL restored from one older
snapshot (their records agree); writing sessions known only to drives that are absent or
unreadable now. Records without identities (written before this rule) are judged by
``LegacySessions`` (the rule they were written under), then stamped.

Reads: records (dicts). Changes: nothing.
"""

from __future__ import annotations

import os
import time

from ..errors import StoreError

CURRENT, BEHIND, OLDER, COPY, UNSTAMPED, FOREIGN = "current", "behind", "older", "copy", "unstamped", "foreign"


class ForeignDrive(StoreError):
    """A root holds another store's drive: it is not opened (drives.MultiDriveStore.open, the probe)."""


def new_id() -> str:
    return os.urandom(16).hex()


def _id(v) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= 64 else None


def _session(rec: dict) -> int:
    s = rec.get("session")
    return s if type(s) is int and s > 0 else 0


def _seen(rec: dict) -> dict[str, int]:
    v = rec.get("seen")
    if not isinstance(v, dict):
        return {}
    return {k: s for k, s in v.items() if _id(k) and type(s) is int and s > 0}


def merge(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    for k, s in more.items():
        if s > into.get(k, 0):
            into[k] = s
    return into


def _store_of(recs: list[dict]) -> str | None:
    """The set's store id: the one most records carry (a record without one votes for None: a set
    last written before identities), a tie going to a real id, then to the first root's."""
    votes: dict[str | None, list[int]] = {}
    for i, rec in enumerate(recs):
        if rec:
            votes.setdefault(_id(rec.get("store_id")), []).append(i)
    if not votes:
        return None
    return min(votes, key=lambda k: (-len(votes[k]), k is None, votes[k][0]))


class History:
    """The verdict on each configured root from the records ``recs`` (drive_set.read_set of each)."""

    def __init__(self, roots: list[str], recs: list[dict]):
        self.roots, self.recs = roots, recs
        self.store_id = _store_of(recs)
        theirs = [_id(rec.get("store_id")) for rec in recs]
        foreign = [t is not None and t != self.store_id for t in theirs]
        self.top: dict[str, int] = {}
        for rec, t in zip(recs, theirs):
            if t is not None and t == self.store_id:
                merge(self.top, _seen(rec))
        self.ids = [_id(rec.get("drive_id")) if t is not None and not f else None
                    for rec, t, f in zip(recs, theirs, foreign)]  # fmt: skip
        legacy = LegacySessions(roots, [{} if f else rec for rec, f in zip(recs, foreign)])
        self.wrote = legacy.wrote  # the newest session that wrote, by the records' ``wrote`` (kept for them)
        self.verdicts: list[tuple[str, str]] = []
        for i, rec in enumerate(recs):
            if foreign[i]:
                self.verdicts.append((FOREIGN, self._foreign_why(i)))
            elif self.store_id is None:  # a set written before identities: the rule it was written under
                self.verdicts.append((BEHIND, "it missed a writer session (removed from the roots or not open)")
                                     if legacy.behind[i] else (CURRENT, ""))  # fmt: skip
            elif rec and theirs[i] is None and _session(rec):  # written before identities, in a stamped set
                self.verdicts.append(self._legacy(rec))
            else:
                self.verdicts.append(self.judge(rec, self.top, self._copy_of(i)))
        sessions = [_session(r) for r, f in zip(recs, foreign) if not f] + list(self.top.values()) + [legacy.top]
        self.newest = max([0, *sessions])

    def _copy_of(self, i: int) -> str | None:
        """The root whose drive ``i`` is a copy of (same drive id, a newer or earlier-listed record)."""
        me = self.ids[i]
        if me is None:
            return None
        for j, other in enumerate(self.ids):
            if j != i and other == me:
                a, b = _session(self.recs[i]), _session(self.recs[j])
                if b > a or (b == a and j < i):
                    return self.roots[j]
        return None

    def _legacy(self, rec: dict) -> tuple[str, str]:
        """A drive last recorded before identities, in a set that has them: current only when its
        own session is not older than the newest that wrote (no other record vouches for it)."""
        if _session(rec) >= self.wrote:
            return CURRENT, ""
        return BEHIND, (f"it was last recorded before drive identities, in session {_session(rec)}, and missed "
                        f"writer session {self.wrote}")  # fmt: skip

    def _foreign_why(self, i: int) -> str:
        theirs = _id(self.recs[i].get("store_id"))
        ours = self.store_id or "not stamped yet (written before drive identities)"
        return (f"it belongs to another store (store id {theirs}; this drive set's is {ours}); "
                "it is not opened, written or cleared: point the root at this store's drive, or remove "
                "the directory to reuse the drive")  # fmt: skip

    @staticmethod
    def judge(rec: dict, top: dict[str, int], copy_of: str | None = None) -> tuple[str, str]:
        """The verdict on one drive whose record ``rec`` belongs to this store, against ``top``
        (the writing sessions the set knows)."""
        me = _id(rec.get("drive_id"))
        if not rec or me is None:
            return UNSTAMPED, ("it has no drive identity (its DRIVES.json is missing or unreadable, or was "
                               "written before drive identities) while the other drives have one")  # fmt: skip
        if copy_of is not None:
            return COPY, f"it is a copy of the drive at {copy_of} (the same drive id {me})"
        own, seen = _session(rec), _seen(rec)
        if top.get(me, 0) > own:
            return OLDER, (f"it is an older copy of drive {me}: its record shows session {own}, the other "
                           f"drives record it in session {top[me]}")  # fmt: skip
        missed = [(s, d) for d, s in top.items() if s > seen.get(d, 0) and s != own]
        if missed:
            s, d = max(missed)
            return BEHIND, f"it missed writer session {s} (of drive {d}): removed from the roots or not open then"
        return CURRENT, ""

    seen_of = staticmethod(_seen)

    def next_session(self) -> int:
        """A number above every session recorded (``time_ns`` when larger: readable in a record)."""
        return max(time.time_ns(), self.newest + 1)


def _names(rec: dict, field: str) -> list[str]:
    v = rec.get(field)
    return [r for r in v if isinstance(r, str)] if isinstance(v, list) else []


class LegacySessions:
    """The rule of records written before identities (``session``, ``members`` by root, ``wrote``):
    a drive whose session is older than the newest that wrote is behind; with no session anywhere,
    one that another drive's recorded roots omit while its own name that drive was removed."""

    def __init__(self, roots: list[str], recs: list[dict]):
        took: dict[str, int] = {}
        for rec in recs:
            s = _session(rec)
            for m in _names(rec, "members") if s else ():
                took[m] = max(took.get(m, 0), s)
        last = [max(_session(rec), took.get(r, 0)) for r, rec in zip(roots, recs)]
        self.top = max([0, *last, *took.values()])
        self.wrote = max([0, *(_wrote(rec) for rec in recs)])
        if self.top:
            self.behind = [s < self.wrote for s in last]
        else:
            named = [set(_names(rec, "roots")) for rec in recs]
            self.behind = [
                any(j != i and roots[j] in named[i] and named[j] and roots[i] not in named[j] for j in range(len(roots)))
                for i in range(len(roots))
            ]  # fmt: skip


def _wrote(rec: dict) -> int:
    s = _session(rec)
    w = rec.get("wrote")
    return min(w, s) if s and type(w) is int and w >= 0 else s
