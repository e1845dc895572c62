"""MultiDriveStore: one store over several drives, a failing drive costing only its own pages.

Composition, not surgery: every root is a complete single-directory ``PageStore`` (lock,
manifest, index, segments, rings, eviction, its share of the capacity), so each drive keeps the
single-drive guarantees and the single-drive path pays nothing. This class routes by page hash
(placement.py: all components of a page on one drive; each batch spread evenly, rendezvous
order breaking ties; see _placed), splits a batch per
drive and runs the parts concurrently (one submission per drive, each drive its own rings and
queue depth), and keeps each drive's health (drive_health.py).

Lookups check every readable drive, so a page put while its preferred drive was degraded, or a
store that had fewer drives, is still found; a key found on two drives is served from its
newest copy (drive_clock.py). A drive that missed a writer session is cleared before it serves
(drive_sessions.py). A batch that touched a stalled drive returns only
once that drive's PageStore call has ended (the trust rule: the kernel may still own the
caller's memory until then); the drive is marked degraded when the call outlives io_timeout_s,
so every later batch skips it without waiting. A background probe re-admits a degraded drive
once no call of ours is in flight on it and one of its objects reads back.

Reads: its drive stores through their public calls. Changes: its own fields only (no PageStore's
state).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os

from ..config import StoreConfig, parse_roots
from ..errors import (
    CapacityShrinkError, DriveNotMountedError, NamespaceMismatchError, ReadOnlyStoreError, StoreError,
    StoreLockedError, UnsafeStorePathError,
)  # fmt: skip
from . import placement
from .clock import GenerationClock
from .counters import COUNTERS
from .checks import CallChecks
from .drive_clock import newest
from .drive_health import FOREIGN, FULL, UNMOUNTED, UNRECORDED, DriveHealth
from .drive_probe import DriveProbes
from .drive_residency import DriveResidency
from .drive_identity import ForeignDrive
from .drive_sessions import SessionSteps
from .drive_set import drive_capacities, note_drive_set
from .mapped import unusable_range
from .mounts import unmounted_reason

log = logging.getLogger("umbp_nvme.store")

PROBE_INTERVAL_S = 1.0  # how often degraded drives are probed and healthy ones checked for their directory
_SUMMED = COUNTERS + (
    "objects", "bytes_used", "capacity_bytes", "usable_bytes", "disk_bytes", "index_bytes", "segments",
    "segments_free", "segment_files", "pinned_slots", "late_writes", "stalled_ops", "late_completions",
    "puts_in_doubt_bytes",
    "effective_capacity_bytes",
)  # fmt: skip


# open errors that every drive would give (the configuration's, or another writer): they raise
_CONFIG_ERRORS = (StoreLockedError, NamespaceMismatchError, CapacityShrinkError, ReadOnlyStoreError, UnsafeStorePathError)


def _drive_failure(e: BaseException) -> bool:
    """An open error that is this drive's (I/O, missing, damaged, LMDB), not the configuration's."""
    return isinstance(e, (OSError, StoreError)) and not isinstance(e, _CONFIG_ERRORS)


class MultiDriveStore(CallChecks, DriveProbes, SessionSteps, DriveResidency):
    """PageStore's calls over several roots. Create with ``await PageStore.open(roots, ...)``."""

    _closed_logged = False

    @classmethod
    async def open(
        cls, roots, config: StoreConfig | None = None, *, open_drive, readonly: bool = False,
        namespace: dict | None = None, capacity_from_manifest: bool = False, shrink: bool = False,
        engine_factory=None, hooks=None, page_of=None, probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> "MultiDriveStore":  # fmt: skip
        """Open (a writer creates) one PageStore per root; PageStore.open calls this for several
        roots (see it for the arguments), handing over ``open_drive(root, config, **kw)``, its
        single-root open.

        A root that cannot be opened for a reason of its own (I/O error, missing, damaged) is a
        degraded drive and the others open; so is a root whose drive looks unmounted (mounts.py),
        which is not touched at all. A configuration error (namespace, lock, shrink) raises.
        ``page_of(key) -> page hash`` (default placement.key_page) decides placement.
        """
        self = cls.__new__(cls)
        config = config or StoreConfig()
        self.roots = [os.path.abspath(r) for r in parse_roots(roots)]
        self.config, self.readonly, self._closed = config, readonly, False
        self._page_of = page_of or placement.key_page
        self._open_one = open_drive
        self._ids = [placement.drive_id(r) for r in self.roots]
        self.health = [DriveHealth(i, r) for i, r in enumerate(self.roots)]
        self.probe_interval_s = float(probe_interval_s)
        self._unrouted_gets = 0
        # a root whose drive looks unmounted is not opened, so nothing is created there (mounts.py)
        self._unmounted = [unmounted_reason(i, self.roots, config.ssd_require_mount) for i in range(len(self.roots))]
        self._sized = not (readonly or capacity_from_manifest)
        caps = drive_capacities(self.roots, config, sized=self._sized, skip=self._unmounted)
        self._open_kw = dict(readonly=readonly, namespace=namespace, capacity_from_manifest=capacity_from_manifest,
                             shrink=shrink, engine_factory=engine_factory, hooks=hooks,
                             clock=None if readonly else GenerationClock())  # one clock: generations compare across drives
        self._caps, self._ranges = caps, []
        self._sessions_at_open()  # before any drive opens: another store's drive is not opened at all
        opened = await asyncio.gather(*(self._first_open(i) for i in range(len(self.roots))), return_exceptions=True)
        self.stores: list = []  # one PageStore per root, None while that drive is not open
        fatal = next((e for e in opened if isinstance(e, BaseException) and not _drive_failure(e)), None)
        if fatal is None and all(isinstance(e, BaseException) for e in opened):
            fatal = opened[0]
        if fatal is not None:
            await asyncio.gather(*(s.close() for s in opened if not isinstance(s, BaseException)), return_exceptions=True)
            self._close_records()
            raise fatal
        for i, s in enumerate(opened):
            if isinstance(s, DriveNotMountedError):  # re-checked by the probe (drive_probe._reopen)
                self.stores.append(None)
                self.health[i].degrade(UNMOUNTED, f"not opened: {s}; nothing is created there")
            elif isinstance(s, ForeignDrive):
                self.stores.append(None)
                self.health[i].degrade(FOREIGN, str(s))
            elif isinstance(s, BaseException):
                self.stores.append(None)
                self.health[i].degrade("open", f"open failed: {s!r}")
            else:
                self.stores.append(s)
        first = next(s for s in self.stores if s is not None)
        self.timeout_s, self.segment_bytes, self.strict = first.timeout_s, first.segment_bytes, first.strict
        self.manifest = first.manifest
        self.path = ",".join(self.roots)
        self.removed_drives = note_drive_set(self.roots, self._same_store_records())
        self._order = list(range(len(self.roots)))  # lookup order (a reader looks at a stale drive last)
        self._start_background()
        try:
            await self._reconcile_at_open()  # before any drive serves, and before the owed logs
            await self._settle_owed_at_open()
            if not readonly:  # step 1 of recording the session (drive_sessions.py); step 2 at the first write
                await self._record_at_open()
        except BaseException:
            await self.close()
            raise
        return self

    async def _first_open(self, i: int):
        if self._unmounted[i]:
            raise DriveNotMountedError(self._unmounted[i])
        if self._foreign_at_open(i):
            raise ForeignDrive(f"drive {self.roots[i]} not opened: {self._foreign_at_open(i)}")
        return await self._open_drive(i)

    def _open_drive(self, i: int):
        r = self.roots[i]
        cfg = dataclasses.replace(self.config, ssd_storage_dir=r, ssd_capacity_bytes=self._caps[i])
        return self._open_one(r, cfg, **self._open_kw)

    # ----------------------------------------------------------------------------- routing

    @property
    def capacity_bytes(self) -> int:
        return sum(s.capacity_bytes for s in self.stores if s is not None)

    @property
    def max_key_bytes(self) -> int:
        return min((s.max_key_bytes for s in self.stores if s is not None), default=511)

    @property
    def closed(self) -> bool:
        return self._closed

    def _mask(self, want: str) -> list[bool]:
        ok = "readable" if want == "read" else "writable"
        mask = [s is not None and getattr(h, ok) for s, h in zip(self.stores, self.health)]
        if want == "write" and not any(mask):  # every drive full: each keeps caching within its space
            mask = [s is not None and h.kind == FULL for s, h in zip(self.stores, self.health)]
        return mask

    def _holders(self, keys, usable) -> list[int]:
        """The drive holding each key among ``usable`` ones (-1: none): every drive is asked (index
        lookups are cheap), and a key two drives hold is served from its newest copy."""
        out = [-1] * len(keys)
        more: dict[int, list[int]] = {}  # key index -> every drive holding it, when more than one
        for d in self._order:
            if not usable[d]:
                continue
            found = self.stores[d].exists_many_nowait(keys)
            if True not in found:
                continue
            owed = self.health[d].deletes_owed  # a reader hides what the drive owes
            for j, f in enumerate(found):
                if f and not (owed and keys[j] in owed):
                    if out[j] < 0:
                        out[j] = d
                    else:
                        more.setdefault(j, [out[j]]).append(d)
        for j, drives in more.items():
            out[j] = newest(self.stores, keys[j], drives)
        return out

    def _pages(self, keys) -> list[str]:
        out = []
        for k in keys:
            try:
                out.append(self._page_of(k) if type(k) is str else "")
            except Exception:  # noqa: BLE001 - a key the store refuses anyway
                out.append("")
        return out

    def _placed(self, keys, usable, held=None) -> list[int]:
        """The drive each object goes to (placement.spread: whole pages, each batch spread evenly)."""
        return placement.spread(self._pages(keys), usable, self._ids, held)

    def drive_of(self, keys) -> list[int]:
        """Which drive holds each key (-1 when no readable drive has it); for tools and tests."""
        return self._holders(keys, self._mask("read"))

    def preferred_drive(self, keys) -> list[int]:
        """Where a put of exactly these keys would place each with every drive healthy."""
        return self._placed(keys, [True] * len(self.roots))

    # ----------------------------------------------------------------------------- data calls

    async def put_many(self, keys: list[str], buffers: list, *, depths: list[int] | None = None) -> list[bool]:
        results = self._begin_call("put_many", keys, buffers, depths, writes=True)
        if results is None:
            return [False] * len(keys)
        self._writes += 1
        await self._session_writes()
        writable = self._mask("write")
        if not any(writable):
            return results
        route = self._placed(keys, writable, self._holders(keys, writable))
        # An older copy on a drive that takes no writes would be served again (full drive) or after
        # it rejoins (degraded): it goes before the new copy is written elsewhere; where it could not
        # go (durably), the key is not written (False) and the old copy stands.
        _, kept = await self._drop_elsewhere(keys, writable)
        if kept:
            route = [-1 if type(k) is str and k in kept else d for k, d in zip(keys, route)]

        def call(st, idx):
            sub_depths = None if depths is None else [depths[j] for j in idx]
            return st.put_many([keys[j] for j in idx], [buffers[j] for j in idx], depths=sub_depths)

        await self._fan_out("put", route, results, call)
        return results

    async def get_many(self, keys: list[str], buffers: list) -> list[bool]:
        results = self._begin_call("get_many", keys, buffers)
        if results is None:
            return [False] * len(keys)
        route = self._holders(keys, self._mask("read"))
        self._unrouted_gets += route.count(-1)  # misses no drive saw
        await self._fan_out("get", route, results,
                            lambda st, idx: st.get_many([keys[j] for j in idx], [buffers[j] for j in idx]))  # fmt: skip
        return results

    async def _fan_out(self, op: str, route: list[int], results: list, call) -> None:
        """Run ``call(store, indexes)`` on every drive the batch touches, concurrently."""
        groups: dict[int, list[int]] = {}
        for j, d in enumerate(route):
            if d >= 0:
                groups.setdefault(d, []).append(j)
        if len(groups) == 1:
            (d, idx), = groups.items()
            await self._on_drive(d, op, idx, results, call)
        elif groups:
            # return_exceptions: gather waits for every part (a stalled one holds caller memory)
            await asyncio.gather(*(self._on_drive(d, op, idx, results, call) for d, idx in groups.items()),
                                 return_exceptions=True)  # fmt: skip

    async def _on_drive(self, d: int, op: str, idx: list[int], results: list, call) -> None:
        st, h = self.stores[d], self.health[d]
        before = dict(st.counters())
        full_before = st.space_limit_segments is not None
        h.begin(op)
        timer = asyncio.get_running_loop().call_later(
            st.timeout_s, h.degrade, "stall", f"{op} of {len(idx)} objects had no completion within "
            f"io_timeout_s={st.timeout_s:g} s",
        )  # fmt: skip
        try:
            out = await call(st, idx)
        except Exception as e:  # noqa: BLE001 - PageStore answers False itself; this is a safety net
            log.error("drive %d (%s): %s raised %r", d, self.roots[d], op, e)
            out = [False] * len(idx)
        finally:
            timer.cancel()
            h.end(op)
        if op == "put" and not full_before and st.space_limit_segments is not None:
            h.degrade(FULL, "its file system is full (ENOSPC)")  # its failed writes were the fullness
        else:
            h.check_counters(before, st.counters(), op)
        for j, ok in zip(idx, out):
            results[j] = bool(ok)

    def exists_many_nowait(self, keys: list[str]) -> list[bool]:
        if self._closed:
            self._closed_call("exists_many")
            return [False] * len(keys)
        return [d >= 0 for d in self._holders(keys, self._mask("read"))]

    def exists_prefix_nowait(self, keys: list[str]) -> int:
        found = self.exists_many_nowait(keys)
        return found.index(False) if False in found else len(found)

    async def exists_many(self, keys: list[str]) -> list[bool]:
        return self.exists_many_nowait(keys)

    async def exists_prefix(self, keys: list[str]) -> int:
        return self.exists_prefix_nowait(keys)

    async def delete_many(self, keys: list[str]) -> list[bool]:
        """Delete on every drive; a degraded drive owes the delete and applies it before it rejoins.
        True only when the delete is durable everywhere: deleted, or owed in a log on disk."""
        results = self._begin_call("delete_many", keys, writes=True)
        if results is None:
            return [False] * len(keys)
        self._writes += 1
        await self._session_writes()
        live = [st for st, h in zip(self.stores, self.health) if st is not None and h.healthy]
        healthy = [st is not None and h.healthy for st, h in zip(self.stores, self.health)]
        gone, kept = await self._drop_elsewhere(keys, healthy, deleting=True)
        results = [type(k) is str and k in gone for k in keys]
        for out in await asyncio.gather(*(st.delete_many(keys) for st in live)):
            results = [a or bool(b) for a, b in zip(results, out)]
        for st in live:  # a copy left behind (a failed delete, or one in doubt) is not deleted
            results = [a and not b for a, b in zip(results, st.delete_pending(keys))]
        return [ok and not (type(k) is str and k in kept) for ok, k in zip(results, keys)]

    async def clear(self) -> None:
        if self._begin_call("clear", (), writes=True) is None:
            return
        self._writes += 1
        await self._session_writes()
        live, owed = [], []
        for d, (st, h) in enumerate(zip(self.stores, self.health)):
            if st is not None and h.takes_deletes:  # healthy, or full: it still clears
                live.append(st.clear())
            else:
                owed.append(d)
        durable = await self._owe_clear(owed) if owed else True
        await asyncio.gather(*live)
        if not durable:
            raise OSError(f"clear: the clear owed by degraded drive(s) {', '.join(self.roots[d] for d in owed)} is "
                          "recorded on no drive; their pages come back after a restart")  # fmt: skip

    async def flush(self) -> bool:
        """fdatasync every healthy drive (a degraded drive's pages are not served)."""
        if self._closed:
            self._closed_call("flush")
            return False
        if self.readonly:
            return True
        live = [st.flush() for st, h in zip(self.stores, self.health) if st is not None and h.healthy]
        return all(await asyncio.gather(*live))

    # ----------------------------------------------------------------------------- management

    def register_memory(self, address: int, nbytes: int) -> bool:
        why = unusable_range(address, nbytes)
        if why is not None:  # not kept for a drive that opens later either (mapped.py)
            log.error("%s: %s; not registered: buffers inside it are refused", self.path, why)
            return False
        self._ranges.append((address, nbytes))  # also for a drive that opens later
        fixed = False
        for st in self.stores:
            if st is not None:
                fixed = st.register_memory(address, nbytes) or fixed
        return fixed

    def registered_memory(self) -> list[tuple[int, int]]:
        return next(s for s in self.stores if s is not None).registered_memory()

    def keys(self) -> list[str]:
        """Writers: every published key on every drive that has its store open (a snapshot)."""
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only; keys() needs the writer's rows")
        out: dict[str, None] = {}
        for st in self.stores:
            if st is not None:
                out.update(dict.fromkeys(st.keys()))
        return list(out)

    def locate(self, keys) -> list:
        """Writers: (drive, Extent) per key on the drive that holds it; None when absent."""
        holders = self.drive_of(keys)
        out = []
        for k, d in zip(keys, holders):
            out.append(None if d < 0 else (d, self.stores[d].locate([k])[0]))
        return out

    def stats(self) -> dict:
        """The drives' counters summed, the first drive's settings, and one row per drive."""
        per = [st.stats() if st is not None else {} for st in self.stores]
        out = merged_stats(per, self._unrouted_gets)
        out.update(
            path=self.path, drives=[drive_row(d, h, s, r) for d, (s, h, r) in enumerate(zip(per, self.health, self.roots))],
            drives_total=len(per), drives_degraded=sum(1 for h in self.health if not h.healthy),
            drives_session_unrecorded=sum(1 for h in self.health if h.kind == UNRECORDED),
            removed_drives=self.removed_drives,
        )  # fmt: skip
        return out

    def drive_rows_nowait(self) -> list[dict]:
        """``stats()["drives"]`` from any thread, without the loop: each drive's
        ``PageStore.stats_nowait`` and its health, plain reads (no lock, no syscall), so it answers
        at once while the loop is busy, blocked, or waiting on a hung drive. Each value is current
        when read; a row is not one transaction (its bytes may be a call ahead of its objects).
        The lists are copied first: a drive added or removed meanwhile is in or out, whole."""
        stores, health, roots = list(self.stores), list(self.health), list(self.roots)
        return [drive_row(d, h, st.stats_nowait() if st is not None else {}, r)
                for d, (st, h, r) in enumerate(zip(stores, health, roots))]  # fmt: skip

    def refresh_object_counts(self) -> None:
        """On the loop: a reader's drives count their objects again (what ``drive_rows_nowait``
        reports for a reader; a writer's counts are always current)."""
        for st in list(self.stores):
            if st is not None and st.readonly and not st.closed:
                st.object_count()

    # ----------------------------------------------------------------------------- close

    def _closed_call(self, op: str) -> None:
        if not self._closed_logged:
            self._closed_logged = True
            log.warning("%s: %s after close(); every call now answers False / 0 (logged once)", self.path, op)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._stop_background()
        if not self.readonly:
            self._health_rec = [h.record(r) for h, r in zip(self.health, self.stats()["drives"])]
            for d, e in (await self._record(self._recordable())).items():
                if e is not None:
                    log.warning("drive %s: could not record the drive set at close: %r", self.roots[d], e)
        self._close_records()
        await asyncio.gather(*(st.close() for st in self.stores if st is not None), return_exceptions=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


def drive_row(d: int, health: DriveHealth, stats: dict, root: str) -> dict:
    """Drive ``d``'s line in stats()["drives"] (drive_health.DriveHealth.row, numbered, at its root)."""
    row = health.row(stats)
    row["drive"], row["path"] = d, root
    return row


def merged_stats(per: list[dict], unrouted_gets: int) -> dict:
    """Counters and sizes summed over the drives; settings (path, engine, ...) from the first open one."""
    out = {k: v for k, v in next(s for s in per if s).items() if k not in _SUMMED}
    for k in _SUMMED:
        vals = [s[k] for s in per if isinstance(s.get(k), (int, float))]
        if vals:
            out[k] = sum(vals)
    out["gets"] = out.get("gets", 0) + unrouted_gets  # keys no drive had: misses nobody counted
    out["misses"] = out.get("misses", 0) + unrouted_gets
    return out
