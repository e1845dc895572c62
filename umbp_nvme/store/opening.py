"""Opening a store: directory and lock, manifest and capacity, index, the writer's rows, engines.

The steps run in that order (``_open``); any failure releases what was taken. The on-disk rules
they apply live in layout.py; this module applies them to one store and logs what it repaired.

Reads: what it set. Changes: every field of StoreState and WriterState it builds (settings, lock,
manifest, index, segment files, rows, allocator, clock, record areas, engines), through OpenFacts
between steps.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np

from ..config import StoreConfig
from ..engine import apply_io_policy, open_engine
from ..engine.base import errno_name
from ..errors import IndexDamagedError, ManifestDamagedError, StoreError, UnsafeStorePathError
from ..keybytes import encode_key
from . import layout, segments
from .index import INDEX_FILE, REC_BYTES, Index, wrap_lmdb_error
from .index_check import trim_heap
from .index_swap import DAMAGED_COPIES_KEPT, damaged_copy_name, prune_damaged, replace_index, settle_leftovers
from .follower import IndexWatch
from .rebuild import boot_id
from .layout import GENERATION_MAX, MANIFEST_FILE, SLOT_ALIGN_BYTES
from .mounts import check_mounted
from .clock import GenerationClock
from .fs_room import warn_if_short
from .keymap import PackedKeys
from .walked_keys import HashedKeys, scan_capture
from .rows import RowTable
from .state import OpenFacts
from .segments import SegmentAllocator, SegmentFiles, segment_name

log = logging.getLogger("umbp_nvme.store")

WRITE_BATCHES_IN_FLIGHT = 2  # put batches submitting at a time: the device queue keeps room for reads


def _set_aside(mpath: str, damage: str) -> str:
    """A damaged manifest moved aside (its newest copies kept: one damaged at every open must not fill the disk)."""
    dest = damaged_copy_name(mpath)  # sorts after every copy there, so pruning keeps the newest
    try:
        os.rename(mpath, dest)
    except OSError as e:
        raise StoreError(f"{damage}, and it cannot be moved aside ({e.strerror or e}); remove it") from None
    prune_damaged(mpath, DAMAGED_COPIES_KEPT)
    return dest


def _crc32c_fn():
    try:
        from .._uring import crc32c, crc32c_many
    except ImportError as e:
        raise ImportError(
            f"umbp_nvme._uring (the native extension) is required for CRC32C: {e}; build it with "
            "`pip install -e .` (needs a C compiler)"
        ) from None
    return crc32c, crc32c_many


def _on_disk(segs, offs, lens, keep, n_segments: int, size_of) -> list[int]:
    """Drop from ``keep`` (in place) the kept records whose extent ends past their segment file's
    end (``size_of(s)``: its size, None when it is gone); the segments the rest name. A chunk of
    records at a time: temporaries reused, where whole arrays of 10 M records (their selections,
    sums, gathers) would each be fresh pages (issue 36's reopen)."""
    step = segments.REBUILD_CHUNK
    chunks = [slice(lo, lo + step) for lo in range(0, len(segs), step)]
    used = np.zeros(n_segments, bool)  # the segments kept records name (the allocator keeps s < n_segments)
    for c in chunks:
        used[segs[c][keep[c]]] = True
    sizes = np.full(n_segments, -1, np.int64)  # -1: the file is gone
    for s in np.flatnonzero(used).tolist():
        size = size_of(s)
        sizes[s] = -1 if size is None else size
    used[:] = False
    for c in chunks:
        k = keep[c]  # a view: the check drops in place; records not kept are False already
        k &= offs[c] + lens[c] <= sizes[np.minimum(segs[c], n_segments - 1)]
        used[segs[c][k]] = True
    return np.flatnonzero(used).tolist()


class OpenSteps:
    """PageStore's open path (a mixin): these steps fill in the store's state (state.py)."""

    async def _open(
        self, path, cfg: StoreConfig, namespace: dict | None, capacity_from_manifest: bool, shrink: bool,
        engine_factory, o: OpenFacts,
    ) -> None:  # fmt: skip
        t0 = time.perf_counter()
        st, w = self.state, self.writer
        readonly = w is None
        self._check_config(cfg)
        try:
            check_mounted(path, cfg.ssd_require_mount)  # before anything is created there
            st.path = layout.prepare_dir(path, readonly=readonly)
            if w is not None:
                w.lock_fd = layout.take_lock(st.path)
            self._open_manifest(cfg, namespace, capacity_from_manifest, shrink, o)
            if w is not None:
                warn_if_short([st.path], st.capacity_bytes)
            background = self._background_index(o)  # loading.py: a large index loads after open returns
            if not background:
                self._open_index(o)
            elif readonly:
                self._reader_standin(o)
            st.files = SegmentFiles(
                st.path,
                st.segment_bytes,
                readonly=readonly,
                o_direct=bool(cfg.o_direct),
                n_segments=max(1, st.capacity_bytes // st.segment_bytes),
            )
            if w is not None:
                if not background:
                    self._load_writer_state(o)
                    self._start_clock(o.gen_max, o)
                w.index_pool = ThreadPoolExecutor(1, thread_name_prefix="umbp-index")
                w.write_sem = asyncio.Semaphore(WRITE_BATCHES_IN_FLIGHT)
                w.commit_lock = asyncio.Lock()
            await self._open_engines(engine_factory or open_engine)
        except BaseException:
            self._release_resources()
            raise
        st.open_seconds = time.perf_counter() - t0
        if background:
            self._start_load(o)  # and says so
            return
        log.info(
            "opened store %s (%s, %s, %d objects, %.3f s, engine %s)",
            st.path,
            "read-only" if readonly else "writer",
            "strict" if st.strict else "relaxed",
            self.object_count(),
            st.open_seconds,
            st.read_engine.capabilities.name,
        )

    def _check_config(self, cfg: StoreConfig) -> None:
        # a StoreConfig was checked when it was made (config.py): nothing to check again here
        if not isinstance(cfg, StoreConfig):
            raise TypeError(f"config must be a StoreConfig (config.load_config makes one), got {type(cfg).__name__}")
        st = self.state
        st.config = cfg
        st.strict = cfg.ssd_durability_mode == "strict"  # aliases were mapped by StoreConfig
        st.verify_crc = bool(cfg.verify_crc)
        st.timeout_s = float(cfg.io_timeout_s)
        st.crc32c, st.crc32c_many = _crc32c_fn()

    async def _open_engines(self, factory) -> None:
        """Two engines for a writer (reads never queue behind writes), one for a reader."""
        st, cfg = self.state, self.config
        qd = int(cfg.ssd_queue_depth)
        st.read_engine = await factory(cfg.ssd_io_backend, qd)
        st.engines.append(st.read_engine)
        if self.writer is not None:
            self.writer.write_engine = await factory(cfg.ssd_io_backend, qd)
            st.engines.append(self.writer.write_engine)
        # reads first: ioprio per direction, one write slice in flight while reads run
        st.arbiter = apply_io_policy(st.engines, read_priority=cfg.ssd_read_priority, write_slice_bytes=cfg.ssd_write_slice_bytes)

    def _open_manifest(self, cfg: StoreConfig, namespace: dict | None, capacity_from_manifest: bool, shrink: bool,
                       o: OpenFacts) -> None:  # fmt: skip
        if namespace is not None and not isinstance(namespace, dict):
            raise TypeError(f"namespace must be a dict of JSON values, got {type(namespace).__name__}")
        layout.check_namespace_fits(namespace)
        readonly = self.writer is None
        mpath = os.path.join(self.path, MANIFEST_FILE)
        damage = None
        try:
            m = layout.read_manifest_or_none(self.path)
        except ManifestDamagedError as e:
            if readonly:
                raise
            m, damage = None, str(e)
        if m is None and damage is None and not readonly and (
            layout.segment_files_extent(self.path) or os.path.lexists(os.path.join(self.path, INDEX_FILE))
        ):
            damage = f"{mpath} is missing but the directory holds store files"
        if m is None:
            if readonly:
                raise FileNotFoundError(f"{self.path} has no {MANIFEST_FILE}; it is not a store (open it for writing first)")
            m = layout.new_manifest(cfg.ssd_capacity_bytes, cfg.ssd_segment_size_bytes, namespace)
            if damage is not None:
                m = self._recover_manifest(mpath, m, damage)
                shrink = True  # the files' extent is a guess: fit it to the capacity asked for, never refuse
            else:
                o.manifest_created = True
            layout.write_manifest(mpath, m)
        else:
            stored = m.get("namespace") or {}
            layout.check_namespace(self.path, stored, namespace)
            if not stored and namespace and not readonly:
                m["namespace"] = namespace  # first declaration on a store created without one
                layout.write_manifest(mpath, m)
        self.state.manifest = m
        self.state.segment_bytes = int(m["layout"]["segment_bytes"])
        if self.segment_bytes != cfg.ssd_segment_size_bytes and not readonly:
            log.info("%s keeps its segment size of %d bytes (config asks %d)", self.path, self.segment_bytes, cfg.ssd_segment_size_bytes)
        if readonly:
            self.state.capacity_bytes = layout.recorded_capacity_bytes(m) or int(cfg.ssd_capacity_bytes)
            return
        self.state.capacity_bytes, o.shrink_from = layout.writer_capacity(
            self.path, m, self.segment_bytes, int(cfg.ssd_capacity_bytes), capacity_from_manifest, shrink
        )

    def _recover_manifest(self, mpath: str, fresh: dict, damage: str) -> dict:
        """A writer's manifest after damage: the damaged file moved aside, its facts re-derived.

        ``segment_bytes`` comes from the segment files when they all have one valid size (they
        are preallocated to it), else from the config (``fresh``); the namespace is the one this
        open declares; the capacity is re-recorded from the files' extent and the config by
        ``layout.writer_capacity``. Index records that do not fit the derived layout are dropped at load.
        """
        dest = _set_aside(mpath, damage) if os.path.lexists(mpath) else None
        seg, source = fresh["layout"]["segment_bytes"], "the config"
        on_disk = layout.segment_bytes_on_disk(self.path)
        if on_disk is not None:
            seg, source = on_disk, "the segment files"
        m = dict(fresh, layout={"segment_bytes": seg, "slot_align_bytes": SLOT_ALIGN_BYTES})
        del m["ssd_capacity_bytes"]  # re-derived: the files' extent, fitted to the capacity asked for
        log.error(
            "%s: the store manifest is damaged (%s); %s and re-derived it (segment_bytes=%d from %s, namespace "
            "from this open); keeping the index records that fit it",
            self.path, damage, f"moved it to {dest}" if dest else "writing a new one", seg, source,
        )  # fmt: skip
        return m
    def _open_index(self, o: OpenFacts) -> None:
        """Open index.lmdb; a writer also reads every record (``o.scan``).

        The index is a cache of the records in the segments (records.py): a writer that finds it
        missing, damaged, or possibly behind rebuilds it from the segments (rebuild.py). Behind:
        the machine restarted while a writer had it open (its commits are not synced), or it has
        no writer state at all (every writer marks the index it opens, and a rebuild marks its
        file before it is put in place, so an unmarked one was left by an interrupted creation
        or by a rebuild of an older version killed mid-way: it may miss any record). A store made
        before the records existed keeps its index as the truth: a damaged one is moved aside
        and the writer starts empty, and the writer migrates it once (``_migrate``). A read-only
        opener raises IndexDamagedError naming the file.
        """
        ipath = os.path.join(self.path, INDEX_FILE)
        map_size = layout.map_size_bytes(self.capacity_bytes)
        readonly = self.writer is None
        records = layout.has_records(self.manifest)
        o.migrate = not readonly and not records
        why = None
        damaged = False  # the old file is kept as a damaged copy only when it is one (index_swap.py)
        if not readonly:
            done = settle_leftovers(ipath, map_size)
            if done is not None:
                log.warning("%s: an index rebuild was interrupted: %s", self.path, done)
        if not readonly and not o.manifest_created and not os.path.lexists(ipath):
            why = f"the store index {ipath} is missing"
            if not records:
                log.error("%s: %s; starting with an empty index (the objects it listed are lost; their space is "
                          "reused)", self.path, why)  # fmt: skip
                why = None
        if why is not None:  # records in the segments, no index: rebuild without making an empty one first
            lock = ipath + "-lock"
            if os.path.lexists(lock):
                os.unlink(lock)
            self._rebuild_from_segments(ipath, map_size, why, o, damaged=False)
            return
        try:
            self.state.index = Index(ipath, readonly=readonly, map_size=map_size, durable=False, writemap=not readonly)
            if readonly:
                self.state.watch = IndexWatch(self.state, map_size)  # every lookup follows the writer's replacements
                return
            o.scan = self.state.index.scan_walked(scan_capture)  # keys hashed, from the page walk of this open
            o.scan_next_gen = self.state.index.next_generation()
            state = self.state.index.writer_state()
            if self.state.index.scan_damage is not None:
                why = why or f"the store index {ipath} is damaged ({self.state.index.scan_damage})"
                damaged = True
                if not records:
                    self._rebuild_index(ipath, map_size, o)
                    why = None
            elif records and state is None and not o.manifest_created:
                why = f"the store index {ipath} has no writer state (its creation or an earlier rebuild was " \
                      "interrupted): it may be behind its segments"
            elif records and state is not None and state != b"clean":
                o.unclean = True
                if state != b"open:" + boot_id():
                    why = why or f"the store index {ipath} may be behind its segments (the machine restarted " \
                                 "while a writer had it open)"
            if why is None:
                o.prior_state = state
                self.state.index.set_writer_state(b"open:" + boot_id())
                return
        except IndexDamagedError as e:
            if readonly:
                raise
            if self.state.index is not None:
                self.state.index.close()
                self.state.index = None
            why = f"the store index {ipath} is damaged ({e})"
            damaged = True
            if not records:
                self._reset_index(ipath, map_size, e, o)
                return
        self._rebuild_from_segments(ipath, map_size, why, o, damaged=damaged)

    def _reset_index(self, ipath: str, map_size: int, reason, o: OpenFacts) -> None:
        """A store without records: a damaged index is replaced by an empty one and the writer starts empty."""
        dest = self._replace_index(ipath, map_size, reason, lambda ix, step: None)
        log.error(
            "%s: %s; moved it to %s and starting with an empty index (the objects it listed are lost; their "
            "space is reused)",
            self.path, reason, dest,
        )  # fmt: skip
        o.scan = self.state.index.scan()
        # generations keep growing across the reset: a follower still reading the old index
        # can never match a new record's generation to an old one
        o.scan_next_gen = time.time_ns() // 1000

    def _rebuild_index(self, ipath: str, map_size: int, o: OpenFacts) -> None:
        """The scan found damaged nodes (and left their keys out): a new index holding every
        record that scanned clean replaces the file, so nothing intact is lost and no damaged
        node stays where a later lookup or delete could land on it."""
        reason = self.state.index.scan_damage
        keys, recs = o.scan
        self.state.index.close()
        self.state.index = None
        blob = recs.tobytes()
        puts = [(k if type(k) is bytes else encode_key(k), blob[i * REC_BYTES : (i + 1) * REC_BYTES])
                for i, k in enumerate(keys)]  # fmt: skip
        dest = self._replace_index(ipath, map_size, reason,
                                   lambda ix, step: ix.commit(puts=puts, next_generation=o.scan_next_gen))  # fmt: skip
        log.error(
            "%s: the store index %s is damaged (%s); moved it to %s and rebuilt it from its %d intact records",
            self.path, ipath, reason, dest, len(keys),
        )  # fmt: skip

    def _replace_index(self, ipath: str, map_size: int, reason, fill) -> str | None:
        """A store without records: put a new index that ``fill`` writes at the path, marked as this
        writer's, atomically (index_swap.py), and open it; where the damaged file went."""
        try:
            dest = replace_index(ipath, map_size, fill, state=b"open:" + boot_id(), old_damaged=True,
                                 step=self.state.hooks.rebuild_step)  # fmt: skip
            self.state.index = Index(ipath, readonly=False, map_size=map_size, durable=False, writemap=True)
        except OSError as e:
            raise StoreError(
                f"store index {ipath} is damaged ({reason}) and cannot be replaced ({e.strerror or e}); remove it"
            ) from None
        except lmdb.Error as e:
            raise wrap_lmdb_error(ipath, e, "replacing it") from None
        return dest

    def _load_writer_state(self, o: OpenFacts) -> None:
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a million fresh dict entries and strs would trigger useless full collections
        try:
            self._load_writer_state_nogc(o)
        finally:
            if gc_was_enabled:
                gc.enable()
        trim_heap()  # the scan's millions of short-lived objects leave free heap pages resident


    def _load_writer_state_nogc(self, o: OpenFacts) -> None:
        n_segments = self.capacity_bytes // self.segment_bytes
        if n_segments == 0:
            raise ValueError(
                f"ssd_capacity_bytes={self.capacity_bytes} is smaller than this store's segment size "
                f"({self.segment_bytes} bytes)"
            )
        self.writer.alloc = SegmentAllocator(n_segments, self.segment_bytes, records=True)
        self.writer.high_bytes = int(self.writer.alloc.capacity_bytes * self.config.ssd_high_watermark)
        self.writer.low_bytes = int(self.writer.alloc.capacity_bytes * self.config.ssd_low_watermark)
        keys, recs = o.scan
        o.scan = None
        if isinstance(keys, HashedKeys) and (o.migrate or o.rebuilt or o.unclean):
            keys = keys.packed()  # every record area is written from every key, after commits (_load_records)
        if len(keys):
            keys, recs = self._drop_unreadable(keys, recs, n_segments, o)
        if o.shrink_from is not None:
            # durable order: index entries gone (and synced) first, then the files, then the record
            self.state.index.sync()
            self.state.files.unlink_beyond(n_segments)
            self.manifest["ssd_capacity_bytes"] = self.capacity_bytes
            layout.write_manifest(os.path.join(self.path, MANIFEST_FILE), self.manifest)
            log.warning(
                "%s: shrunk to ssd_capacity_bytes=%d (%d segments)", self.path, self.capacity_bytes, n_segments
            )
            o.shrink_from = None
        # room for a row per 4 KiB slot (the most objects the segments hold): filling never grows a column
        slots = n_segments * self.writer.alloc.slots(SLOT_ALIGN_BYTES)
        self.writer.rows = RowTable(keys, recs, self.writer.alloc.free, slots)
        self.writer.keys = self.writer.rows.index  # key -> row (the same dict)
        if isinstance(keys, HashedKeys):
            keys.release()  # the walk's map of the file goes
        self._load_records(keys, recs, o)
        o.gen_max = int(recs["generation"].max()) if len(keys) else 0  # the clock starts above it (_start_clock)

    def _start_clock(self, gen_max: int, o: OpenFacts) -> None:
        """Join the generation clock (clock.py) above everything this store may hold: the index's
        next generation, the bound persisted before the last session used its values, its records."""
        bound = self.state.index.generation_bound()
        for what, v in (("next generation", o.scan_next_gen), ("generation bound", bound)):
            if v >= GENERATION_MAX:
                log.error("%s: the index's %s %d is damaged; continuing after its records' highest", self.path,
                          what, v)  # fmt: skip
        floor = max(v for v in (o.scan_next_gen, bound, gen_max + 1, time.time_ns() // 1000) if v < GENERATION_MAX)
        self.writer.clock = o.clock_given or GenerationClock()
        self.writer.clock.join(floor, self.state.index.set_generation_bound)
        self.writer.open_clock = self.writer.clock.now  # records of objects put before this open are confirmed on disk

    def _drop_unreadable(self, keys: list, recs: np.ndarray, n_segments: int, o: OpenFacts):
        """(keys, records) the allocator accepts and whose bytes are on disk; the rest deleted from the index.

        A record whose segment file is gone (ENOENT) or too short for its extent cannot be read
        back: drop it. Any other failure (EMFILE, EACCES, EIO...) may be transient: refuse to open
        rather than destroy the index over it.
        """
        segs, offs, lens = (recs[f].astype(np.int64) for f in ("segment", "offset", "length"))  # strided: once each
        shrunk = int((segs >= n_segments).sum()) if o.shrink_from is not None else 0
        keep = self.writer.alloc.rebuild(segs, offs, lens, recs["generation"])
        # generations count puts: one near 2**64 is damage and would overflow the clock
        keep &= recs["generation"] < GENERATION_MAX
        for s in _on_disk(segs, offs, lens, keep, n_segments, self._segment_size):
            self._open_segment_for_load(s)
        if keep.all():
            return keys, recs
        packed = isinstance(keys, (PackedKeys, HashedKeys))  # a fast scan's keys are bytes already
        gone = np.flatnonzero(~keep)
        drop = keys.key_bytes(gone) if packed else [encode_key(keys[i]) for i in gone.tolist()]
        idx = np.flatnonzero(keep)
        if isinstance(keys, HashedKeys):  # read before the commit below may free their pages
            keys = keys.take(idx)
            keys.release()
        if shrunk:
            log.warning(
                "%s: shrinking from ssd_capacity_bytes=%d to %d (%d -> %d segments): evicting %d objects "
                "stored in the removed segments",
                self.path, o.shrink_from[0], self.capacity_bytes, o.shrink_from[1], n_segments, shrunk,
            )  # fmt: skip
        if len(drop) > shrunk:
            log.warning(
                "%s: dropping %d index records whose data is gone (segment file missing or short) or that are damaged "
                "(outside their segment, misaligned, overlapping another)",
                self.path, len(drop) - shrunk,
            )  # fmt: skip
        try:
            self.state.index.commit(deletes=drop)
        except lmdb.Error as e:
            raise wrap_lmdb_error(self.state.index.path, e, f"deleting {len(drop)} records at open") from None
        if not isinstance(keys, HashedKeys):
            keys = keys.take(idx) if packed else [keys[i] for i in idx.tolist()]
        recs = recs[idx]
        self.writer.alloc.rebuild(recs["segment"], recs["offset"], recs["length"], recs["generation"])
        return keys, recs
    def _segment_size(self, s: int) -> int | None:
        """Size of segment file s; None when it is gone. Raises StoreError for any other failure."""
        p = os.path.join(self.path, segment_name(s))
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(
                f"cannot stat segment file {p} ({e.strerror or e}); refusing to open the store rather than drop "
                "the index records of that segment: fix the cause and open it again"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeStorePathError(
                f"segment file {p} is not a regular file (a symlink or special file); remove it and open the store again"
            )
        return st.st_size

    def _open_segment_for_load(self, s: int) -> None:
        """Open segment s, which holds records; any failure refuses the open (nothing is dropped)."""
        try:
            self.state.files.open_existing(s)
        except OSError as e:
            p = os.path.join(self.path, segment_name(s))
            raise StoreError(
                f"cannot open segment file {p} ({errno_name(-e.errno) if e.errno else ''} {e.strerror or e}); the "
                "store was not opened and its index was left as it is: fix the cause (open-file limit, "
                "permissions, disk) and open it again"
            ) from None
