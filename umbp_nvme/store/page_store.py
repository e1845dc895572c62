"""PageStore: the asyncio key -> object store on local NVMe.

One call = one index pass, one engine submission, one CRC pass off the loop thread, one index
commit. The lifecycle of a put is reserve (slot) -> write -> [fdatasync] -> publish (index
commit) | abort (put_path.py); of a get: look up + pin -> read -> verify -> unpin (get_path.py).
An entry is visible only after its bytes are on the file (publish after write); a slot is reused
only after the delete of its old entry is committed (durable eviction) and no read of it is in
flight here (pins). A reader in another process cannot pin, so it checks the CRC and that the
key still has the generation it looked up once the read is done.

The store's state is declared in state.py (``StoreState`` every store has, ``WriterState`` only a
writer has: ``self.writer is None`` on a read-only opener); the instance holds those two and
nothing else. Opening (opening.py), room for a put (space.py, eviction.py), the row table
(rows.py), caller memory (memory.py) and bounce staging (staging.py) each have their module; this
one holds the public calls that are not puts or gets, and index commits; waits.py the I/O wait.

Reads never wait behind writes: reads and writes go to two engine instances (two rings or two
thread pools), and at most ``opening.WRITE_BATCHES_IN_FLIGHT`` put batches submit at a time, so
the device queue always has room for reads.

Reads: all of it (stats). Changes: state.closed and what close() releases (engines, files, index,
lock, bounce, gds gate), state.memory (register_memory), state.inflight and state.idle (calls),
writer.residency.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from ..config import StoreConfig, parse_roots
from ..errors import ReadOnlyStoreError
from .checks import CallChecks
from .deletes import DeleteSteps
from .flushing import FlushSteps
from .drives import PROBE_INTERVAL_S, MultiDriveStore
from .get_path import GetPath
from .hooks import StoreHooks
from .loading import BackgroundLoad
from .lookups import Lookups
from .mapped import unusable_range
from .opening import OpenSteps
from .put_doubt import PutDoubt
from .put_path import OBJECT_BYTES_END, PutPath
from .put_publish import PutPublish
from .record_steps import RecordSteps
from .segments import max_object_bytes
from .space import SpaceSteps
from .staging import BouncePool
from .state import OpenFacts, StoreState, WriterState
from .waits import IoWaits

log = logging.getLogger("umbp_nvme.store")

LMDB_MAX_KEY_BYTES = 511  # LMDB's compiled-in key limit (py-lmdb's build): max_key_bytes before the index opens


class Extent(NamedTuple):
    segment: int
    offset: int
    length: int
    depth: int  # -1 when put without depths



class PageStore(
    CallChecks, OpenSteps, SpaceSteps, PutPath, PutPublish, PutDoubt, RecordSteps, Lookups, GetPath, IoWaits,
    DeleteSteps, FlushSteps, BackgroundLoad,
):
    """See docs/architecture.md for the contract. Create with ``await PageStore.open(...)``."""

    def __init__(self, state: StoreState, writer: WriterState | None) -> None:
        """The store's state (state.py; ``writer`` None on a read-only opener), filled in by opening.py."""
        self.state = state
        self.writer = writer

    # the public settings, read-only (the state holds them)
    path = property(lambda self: self.state.path, doc="The store directory.")
    config = property(lambda self: self.state.config, doc="The StoreConfig the store runs with.")
    readonly = property(lambda self: self.writer is None, doc="Opened read-only (a follower).")
    strict = property(lambda self: self.state.strict, doc="Strict durability: fdatasync before a put answers.")
    verify_crc = property(lambda self: self.state.verify_crc, doc="Gets check each object's CRC32C.")
    timeout_s = property(lambda self: self.state.timeout_s, doc="io_timeout_s.")
    manifest = property(lambda self: self.state.manifest, doc="MANIFEST.json as read (and updated) at open.")
    segment_bytes = property(lambda self: self.state.segment_bytes, doc="Bytes per segment file.")
    capacity_bytes = property(lambda self: self.state.capacity_bytes, doc="The capacity the store runs with.")
    open_seconds = property(lambda self: self.state.open_seconds, doc="How long the open took; None before it succeeded.")

    @classmethod
    async def open(
        cls,
        path,
        config: StoreConfig | None = None,
        *,
        readonly: bool = False,
        namespace: dict | None = None,
        capacity_from_manifest: bool = False,
        shrink: bool = False,
        engine_factory=None,
        hooks=None,
        clock=None,
        page_of=None,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> "PageStore | MultiDriveStore":
        """Open (a writer creates) the store at ``path``.

        Capacity (writers): the manifest records the ``ssd_capacity_bytes`` the store runs with.
        ``capacity_from_manifest=True`` adopts the recorded capacity and ignores the config's
        (tools that open a store they did not size: the CLI without --capacity). Otherwise the
        config's capacity is used: a larger one grows the store; a smaller one that would take
        segments away raises CapacityShrinkError naming both values, unless ``shrink=True``, which
        evicts everything stored in the removed segments durably (index entries deleted and
        synced first, then the files) and records the new capacity.

        ``path`` may list several roots (a list, a JSON list, a comma-separated string): the
        result is then a ``drives.MultiDriveStore`` with the same calls, one PageStore per drive,
        placing pages by ``page_of(key) -> page hash`` (default ``placement.key_page``) and probing
        degraded drives every ``probe_interval_s``. This is the one place that decides how many
        roots a path names; the drives are opened through ``_open_root``, handed to
        MultiDriveStore so that drives.py does not import this module.

        ``engine_factory``: ``async (backend, queue_depth) -> IoEngine``, called once per engine
        (two for a writer: reads and writes); default ``engine.open_engine``. Tests and fault
        injection wrap engines here. ``hooks``: a ``hooks.StoreHooks`` whose steps (index commit,
        tombstone, staging copy) replace the store's own; every drive of several gets the same one.

        ``clock``: a ``clock.GenerationClock`` shared with other stores (the drives of one
        writer), so that generations order puts across them; default: the store's own.

        ``readonly=True`` opens a follower: it reads what a writer in another process publishes
        and never writes. ``namespace``: a dict (model, layout, dtype, ...) recorded by the first
        writer; a store made for another namespace is refused.

        Raises StoreLockedError (another process writes this directory; names its pid),
        NamespaceMismatchError (names the field and both values), CapacityShrinkError,
        UnsafeStorePathError (a symlink, not a directory, another user's), FileNotFoundError or
        NotAStoreError (read-only open where no store is), IndexDamagedError (read-only open
        of a damaged index; a writer moves it aside instead), TypeError for a config that is not
        a StoreConfig, and OSError when the directory cannot be created or locked.
        """
        kw = dict(readonly=readonly, namespace=namespace, capacity_from_manifest=capacity_from_manifest,
                  shrink=shrink, engine_factory=engine_factory, hooks=hooks)  # fmt: skip
        roots = parse_roots(path)  # a plain path is one root; an empty one is refused
        if len(roots) > 1:
            return await MultiDriveStore.open(roots, config, open_drive=cls._open_root, page_of=page_of,
                                              probe_interval_s=probe_interval_s, **kw)  # fmt: skip
        return await cls._open_root(roots[0], config, clock=clock, **kw)

    @classmethod
    async def _open_root(cls, path, config, *, readonly, namespace, capacity_from_manifest, shrink, engine_factory,
                         hooks=None, clock=None) -> "PageStore":  # fmt: skip
        """Open one root (one drive): PageStore.open's single-directory half."""
        hooks = hooks or StoreHooks()
        state = StoreState(bounce=BouncePool(hooks.memmove), hooks=hooks)
        self = cls(state, None if readonly else WriterState())
        await self._open(path, config or StoreConfig(), namespace, capacity_from_manifest, shrink, engine_factory,
                         OpenFacts(clock_given=clock))  # fmt: skip
        return self

    async def close(self) -> None:
        """Wait for calls in flight, make everything durable (a clean close), release the lock.

        Idempotent; never raises for an I/O problem (logged). Calls after close answer False / 0.
        """
        st, w = self.state, self.writer
        if st.closed:
            return
        st.closed = True
        await self._stop_load()  # loading.py: a background load stops at its next step
        if st.inflight:
            try:
                await asyncio.wait_for(st.idle.wait(), self.timeout_s)
            except asyncio.TimeoutError:
                # every call ends once the kernel gave back its memory (see _await_io); closing
                # the engines before that would let a late completion land in freed memory
                log.warning("%s: close waits for %d calls whose I/O the kernel still holds", self.path, st.inflight)
                await st.idle.wait()
        await self._stop_settles()
        if w is not None and st.index is not None and not self._loading():
            await self._settle_doubts()
            if await self.flush_for_close():
                try:
                    st.index.set_writer_state(b"clean")
                except Exception as e:  # noqa: BLE001 - the next open checks the records instead
                    log.warning("%s: cannot record the clean close: %s", self.path, e)
            if not await w.areas.settle(self.timeout_s):
                log.warning("%s: record block writes outlived io_timeout_s at close", self.path)
        if w is not None and w.index_pool is not None and st.index is not None:
            # close the index after whatever is queued on its thread, and wait for it (bounded):
            # a reopen in this process right after close() must not share the closing handle
            ix, st.index = st.index, None
            fut = asyncio.get_running_loop().run_in_executor(w.index_pool, ix.close)
            try:
                await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
            except asyncio.TimeoutError:
                log.warning("%s: the index closes in the background (a commit is still on its thread)", self.path)
        self._release_resources()

    def _release_resources(self) -> None:
        """Close what the open took (also after a failed open: any field may still be unset)."""
        st, w = self.state, self.writer
        if w is not None and w.clock is not None and st.index is not None:
            w.clock.leave(st.index.set_generation_bound)
        for e in st.engines:
            try:
                e.close()
            except Exception:  # noqa: BLE001
                pass
        st.engines = []
        gate, st.gds_gate = st.gds_gate, None
        if gate is not None:
            if gate.engine is not None and st.files is not None:
                for f in list(st.files.files.values()):  # a precreate() may still be installing one
                    gate.engine.forget_fd(f.fd)
            gate.close()
        if st.files is not None:
            st.files.close()
        if w is not None and w.index_pool is not None:
            # A commit stuck on a slow fsync must not block the loop thread: the index closes on
            # its own thread after whatever is queued there (the env is refcounted per process,
            # so a reopen meanwhile shares it safely).
            if st.index is not None:
                w.index_pool.submit(st.index.close)
                st.index = None
            w.index_pool.shutdown(wait=False)
            w.index_pool = None
        if st.watch is not None:
            st.watch.close()  # a follower's other index handles (follower.py)
        if st.index is not None:
            st.index.close()
            st.index = None
        st.bounce.close()
        if w is not None and w.lock_fd >= 0:
            os.close(w.lock_fd)  # releases the flock
            w.lock_fd = -1
        st.closed = True

    @property
    def closed(self) -> bool:
        """True once ``close()`` has started (or the open failed)."""
        return self.state.closed

    # ----------------------------------------------------------------------------- memory

    def register_memory(self, address: int, nbytes: int) -> bool:
        """Allow (address, nbytes) buffers inside this range; offer it to the engines as fixed buffers.
        A range not mapped readable and writable here is not taken (mapped.py): False, one ERROR line."""
        why = unusable_range(address, nbytes)
        if why is not None:
            log.error("%s: %s; not registered: buffers inside it are refused", self.path, why)
            return False
        ranges = self.state.memory.add(address, nbytes)
        fixed = False
        for e in self.state.engines:
            try:
                fixed = bool(e.register_buffers(ranges)) or fixed
            except Exception as ex:  # noqa: BLE001 - registration is an optimisation
                log.info("engine %s did not take registered buffers: %s", e.capabilities.name, ex)
        return fixed

    def registered_memory(self) -> list[tuple[int, int]]:
        """The registered ranges as (address, nbytes), sorted by address."""
        return [(a, b - a) for a, b in self.state.memory.ranges]

    def keys(self) -> list[str]:
        """Writers: every published key (a snapshot)."""
        if self.writer is None:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only; keys() needs the writer's rows")
        return [] if self._loading() else list(self.writer.keys)

    def any_key(self) -> str | None:
        """Writers: one published key (None when there is none, or on a read-only opener): what a
        drive probe reads back, without a snapshot of every key."""
        if self.writer is None or self.writer.keys is None or self._loading():
            return None
        return self.writer.keys.any_key()

    def locate(self, keys) -> list[Extent | None]:
        """Writers: where each key's object lives (segment, offset, length, depth); None when absent.

        For tools and tests that look at the files themselves (the bench's raw engine comparison,
        corruption tests); the store's calls never need it.
        """
        if self.writer is None:
            raise ReadOnlyStoreError(f"store {self.path} was opened read-only; locate needs the writer's rows")
        t, out = self.writer.rows, []
        for r in ([None] * len(keys) if self._loading() else self._writer_rows(keys)):  # loading: all absent
            out.append(None if r is None else Extent(int(t.seg[r]), int(t.off[r]), int(t.len[r]), int(t.depth[r])))
        return out

    async def _gds_route(self) -> str:
        """'gds' | 'staging'; raises EngineUnavailable (the caller reports per-key False)."""
        from ..engine import gds

        if self.state.gds_gate is None:
            self.state.gds_gate = gds.GdsGate(
                queue_depth=int(self.config.ssd_queue_depth),
                probe_dir=self.path,
                staging=self.config.gds_staging,
            )
        return await self.state.gds_gate.route()

    def object_count(self) -> int:
        """Objects stored: a writer counts its rows, a read-only opener asks the index (-1 when it
        cannot tell; a count it got is kept for ``stats_nowait``)."""
        if self.writer is None:
            try:
                n = self.state.watch.read(lambda ix: ix.count(), -1)
            except Exception:  # noqa: BLE001
                return -1
            if n >= 0:
                self.state.objects_seen = n
            return n
        return 0 if self._loading() else len(self.writer.keys)

    def _tick(self) -> int:
        return self.writer.clock.tick()

    # ----------------------------------------------------------------------------- index commits (deletes.py drops rows)

    async def _commit(self, puts=(), deletes=()) -> bool:
        """One index transaction, not synced: the records in the segments are the durable truth
        (records.py), so it runs inline. Through ``StoreHooks.commit`` when one is given."""
        hook = self.state.hooks.commit
        if hook is not None:
            return await hook(self._commit_now, self, puts, deletes)
        return await self._commit_now(puts, deletes)

    async def _commit_now(self, puts=(), deletes=()) -> bool:
        try:
            self.state.index.commit(puts, deletes, next_generation=self.writer.clock.now + 1)
            return True
        except Exception as e:  # noqa: BLE001 - lmdb.Error (ENOSPC, MapFull) becomes a failed batch
            log.error("%s: index commit of %d puts / %d deletes failed: %s", self.path, len(puts), len(deletes), e)
            return False

    # ----------------------------------------------------------------------------- stats

    def counters(self) -> Mapping[str, int]:
        """The counters (counters.COUNTERS), live and read-only: ``dict(store.counters())`` is a snapshot."""
        return MappingProxyType(self.state.counters)

    @property
    def lock_fd(self) -> int:
        """The fd holding the store directory's flock; -1 on a read-only opener or once closed."""
        return -1 if self.writer is None else self.writer.lock_fd

    @property
    def max_key_bytes(self) -> int:
        """The longest key the index takes, in bytes (LMDB's limit)."""
        return LMDB_MAX_KEY_BYTES if self.state.index is None else self.state.index.max_key_bytes  # None: loading

    @property
    def max_object_bytes(self) -> int:
        """The largest object a put takes, in bytes: one segment less its record block
        (segments.max_object_bytes), under the index's u32 length."""
        a = None if self.writer is None else self.writer.alloc
        return min(max_object_bytes(self.segment_bytes) if a is None else a.max_object_bytes, OBJECT_BYTES_END - 1)

    @property
    def residency(self):
        """The kv_residency.Residency told which keys become visible / invisible; None when none is."""
        return None if self.writer is None else self.writer.residency

    def attach_residency(self, residency) -> None:
        """Tell ``residency`` (kv_residency.Residency; None: nobody) which keys this writer shows and
        hides from now on (KV events). A read-only opener shows nothing: ignored there."""
        if self.writer is not None:
            self.writer.residency = residency

    def detach_residency(self) -> None:
        """Stop telling a residency tracker about keys (``attach_residency(None)``)."""
        self.attach_residency(None)

    @property
    def space_limit_segments(self) -> int | None:
        """Segments with files when the file system refused another (ENOSPC); None while it has room."""
        return None if self.writer is None else self.writer.space_limit_segments

    def stats(self) -> dict:
        """Counters (puts, hits, misses, errors, ...) and state (capacity, objects, engine, ...): plain values."""
        w = self.writer
        s = dict(self.state.counters)
        s.update(
            path=self.path,
            readonly=self.readonly,
            durability="strict" if self.strict else "relaxed",
            capacity_bytes=self.capacity_bytes,
            segment_bytes=self.segment_bytes,
            high_watermark=self.config.ssd_high_watermark,
            low_watermark=self.config.ssd_low_watermark,
            eviction_policy=self.config.eviction_policy,
            verify_crc=self.verify_crc,
            engine=self.state.read_engine.capabilities.name if self.state.engines else None,
            o_direct=self.state.files.any_direct if self.state.files is not None else None,
            open_seconds=None if self.open_seconds is None else round(self.open_seconds, 4),
            index_bytes=self.state.index.file_bytes() if self.state.index is not None else 0,
            stalled_ops=self.state.stalled_ops,
            late_completions=self.state.late_completions,
            stalled_wait_s=round(self.state.stalled_wait_s, 3),
            loading=self.loading_state(), index_loading=int(self._loading()),  # loading.py; a number for metrics.py
            key_set=None if self.state.watch is None else self.state.watch.key_set(),  # a follower's (follower_keys.py)
        )
        if w is not None and w.alloc is not None and not self._loading():  # a writer whose open built its allocator
            s.update(
                objects=len(w.keys),
                bytes_used=w.alloc.used_bytes,
                usable_bytes=w.alloc.capacity_bytes,
                segments=w.alloc.n_segments,
                segments_free=w.alloc.free_segments(),
                segment_files=len(self.state.files.files),
                disk_bytes=self.state.files.disk_bytes(),
                size_classes=w.alloc.class_counts(),
                pinned_slots=w.rows.pinned_count(), late_writes=w.late_writes,
                puts_in_doubt_bytes=self.put_doubt_bytes(),
                effective_capacity_bytes=self._effective_capacity(),
                **_record_block_stats(w.areas),
            )
        else:
            s.update(objects=self.object_count())
        return s

    def stats_nowait(self) -> dict:
        """The counters, ``path``, ``capacity_bytes``, ``objects`` and ``bytes_used`` (what a drive's
        stats row needs), callable from any thread while the loop runs: each value is one read
        (the counters one C-level dict copy, atomic under the GIL), with no lock, no syscall and
        no walk of anything the loop changes, so it answers at once while the loop is busy or
        blocked. A read-only opener's ``objects`` is its last ``object_count()`` (``stats()``
        refreshes it; -1 before the first): counting would read the index on the disk."""
        w = self.writer
        s = dict(self.state.counters)
        s["path"] = self.state.path
        s["capacity_bytes"] = self.state.capacity_bytes
        if w is None:
            s["objects"] = self.state.objects_seen
            return s
        keys, alloc = (None, None) if self._loading() else (w.keys, w.alloc)
        s["objects"] = 0 if keys is None else len(keys)
        if alloc is not None:
            s["bytes_used"] = alloc.used_bytes
        return s

    # ----------------------------------------------------------------------------- in-flight tracking

    def _closed_call(self, op: str) -> None:
        """Calls after close() answer False / 0 without touching files; one line says so."""
        if not self.state.closed_logged:
            self.state.closed_logged = True
            log.warning("%s: %s after close(); every call now answers False / 0 (logged once)", self.path, op)

    def _enter(self) -> None:
        self.state.inflight += 1
        self.state.idle.clear()

    def _leave(self) -> None:
        self.state.inflight -= 1
        if not self.state.inflight:
            self.state.idle.set()

    async def __aenter__(self):
        """``async with await PageStore.open(...) as store:`` closes the store on exit."""
        return self

    async def __aexit__(self, *exc):
        await self.close()


def _record_block_stats(areas) -> dict:
    """The writer's record blocks (4 KiB each): held in memory, and read back after they left it,
    through the read engine or (only when one left again before its change) on the loop thread."""
    if areas is None:
        return dict(record_blocks_in_memory=0, record_blocks_read_back=0, record_blocks_read_on_loop=0)
    return dict(record_blocks_in_memory=areas.blocks_in_memory(), record_blocks_read_back=areas.fetched,
                record_blocks_read_on_loop=areas.read_on_loop)  # fmt: skip
