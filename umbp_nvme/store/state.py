"""A PageStore's state, declared in one place: what every store has (``StoreState``), what only
a writer has (``WriterState``, None on a read-only opener) and what the open steps pass along
(``OpenFacts``, dropped once the store is open).

A store's instance holds exactly ``state`` and ``writer`` (tests/store/test_declared_state.py);
its mixins read and change fields of these by name, and "is this a writer" is
``store.writer is not None``. The dataclasses have slots: a field not declared here cannot be set.
Reads: nothing. Changes: nothing (the open steps, opening.py, fill the fields in).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from .counters import new_counters
from .hooks import StoreHooks
from .memory import Ranges
from .staging import BouncePool


@dataclass(slots=True, eq=False)
class StoreState:
    """What every open store has, writer or read-only opener."""

    # settings, from the config and the manifest (opening.py; public as PageStore properties)
    path: str = ""
    config: Any = None  # StoreConfig
    strict: bool = False  # ssd_durability_mode == "strict"
    verify_crc: bool = True
    timeout_s: float = 0.0  # io_timeout_s
    manifest: dict | None = None
    segment_bytes: int = 0
    capacity_bytes: int = 0
    crc32c: Any = None  # _uring.crc32c
    crc32c_many: Any = None  # _uring.crc32c_many
    # what the open took (opening.py; released by page_store.close)
    index: Any = None  # index.Index (a follower's watch may swap it for the writer's new file)
    files: Any = None  # segments.SegmentFiles
    engines: list = field(default_factory=list)  # every engine, closed at close
    read_engine: Any = None
    arbiter: Any = None  # engine/arbiter.Arbiter the engines share (None: slicing off); put_crc asks it about reads
    watch: Any = None  # read-only openers: follower.IndexWatch (follows a writer's index replacements)
    gds_gate: Any = None  # engine/gds GdsGate, opened on the first CUDA buffer
    bounce: BouncePool = field(default_factory=BouncePool)  # staging.py
    hooks: StoreHooks = field(default_factory=StoreHooks)  # steps fault tests replace (hooks.py), from open
    memory: Ranges = field(default_factory=Ranges)  # ranges given to register_memory
    # calls (page_store.py, waits.py)
    counters: dict = field(default_factory=new_counters)
    inflight: int = 0  # calls in flight; close() waits for them
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while no call is in flight
    closed: bool = False
    closed_logged: bool = False  # the one log line for calls after close()
    stalled_ops: int = 0  # ops that outlived io_timeout_s (the call waited for the kernel)
    late_completions: int = 0  # of those, ended since (== stalled_ops when none is in flight)
    stalled_wait_s: float = 0.0  # longest wait past io_timeout_s
    open_seconds: float | None = None  # how long the open took, once it succeeded
    objects_seen: int = -1  # a reader's object count as of its last object_count() (stats_nowait reports it)
    # a background load (loading.py): lookups miss, writes wait while it runs
    loading: Any = None  # asyncio.Future while the index loads in the background
    load_failed: str | None = None  # why the background load failed (or "stopped by close()")
    load_stop: bool = False  # close() asked the background load to stop

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass(slots=True, eq=False)
class WriterState:
    """What only a writer has. Present from the first open step of a writer on; a field is None
    until the step that makes it has run."""

    lock_fd: int = -1  # the flock on the store directory (layout.take_lock)
    write_engine: Any = None
    index_pool: Any = None  # the index's one thread (commits' syncs, close)
    write_sem: asyncio.Semaphore | None = None  # put batches submitting at a time
    commit_lock: asyncio.Lock | None = None  # one index commit at a time, in call order
    alloc: Any = None  # segments.SegmentAllocator
    rows: Any = None  # rows.RowTable: the published objects
    keys: Any = None  # keymap.KeyMap: key -> row (the row table's)
    clock: Any = None  # clock.GenerationClock (shared by the drives of one writer)
    open_clock: int = 0  # generations up to this one were put before this open (confirmed on disk)
    areas: Any = None  # record_areas.RecordAreas: the record blocks in memory
    high_bytes: int = 0  # watermarks in bytes
    low_bytes: int = 0
    put_doubt: list | None = None  # put_doubt._Doubt per put batch in doubt
    drop_doubt: dict | None = None  # row -> key of drops in doubt (deletes.py)
    space_limit_segments: int | None = None  # segments with files when one could not be created (ENOSPC)
    space_retry_at: float = 0.0  # when to try to grow again (space.py)
    slot_cap: tuple | None = None  # (free segments, bytes the slots hold), space._slot_capacity's cache
    late_writes: int = 0  # write batches that outlived io_timeout_s and still hold slots
    admission: Any = None  # admission.Admission, made at the first put (admit_gate.py); None for "all"
    residency: Any = None  # kv_residency.Residency: told which keys became visible / invisible (KV events)
    # relaxed: per segment, (offsets, lengths, generations) of puts published since its last settle,
    # and the settles running (flushing.py: a full segment's records confirmed while in memory)
    unsettled: dict = field(default_factory=dict)
    settles: dict = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class OpenFacts:
    """What one open step learns and a later one needs (opening.py, record_steps.py)."""

    clock_given: Any = None  # a GenerationClock shared with other drives, else the store makes its own
    shrink_from: tuple | None = None  # (old capacity, old segment count) while a permitted shrink runs
    manifest_created: bool = False  # this open wrote a new manifest (no index records to trust yet)
    scan: tuple | None = None  # (keys, records) the writer read from the index
    scan_next_gen: int = 0
    rebuilt: str | None = None  # why the index was rebuilt from the segments
    unclean: bool = False  # the index was left open by a writer (no clean close)
    migrate: bool = False  # a store made before the records: write them once
    gen_max: int = 0  # the highest generation among the loaded records (the clock starts above it)
    prior_state: bytes | None = None  # the index's writer state before this open marked it (loading.py)
    reader_load: tuple | None = None  # (index path, map size) a read-only opener opens in the background
