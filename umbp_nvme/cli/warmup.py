"""Offline cache warm-up: import pages into a store (``umbp-nvme warmup --store DIR SOURCE...``).

Sources, recognised by what they are on disk (``umbp_nvme.cli.sources.detect_source``):

* a directory of SGLang's ``file`` backend (HiCacheFile): ``<page hash><suffix>.bin`` files, one
  per page and rank, holding the page as SGLang's legacy flat data page. Their names and bytes
  map onto our component keys as described in docs/cli.md ("HiCacheFile mapping"); read by
  ``umbp_nvme.cli.hicache_files``;
* another umbp_nvme store directory (has MANIFEST.json): merged, its namespace must match;
* an archive written by ``umbp-nvme export`` (docs/archive.md).

Every source becomes a stream of *units* (``umbp_nvme.cli.sources.Unit``): one blob read from the
source that holds one or more objects (a HiCacheFile MHA page is K then V). Units whose keys are
all in the store already are skipped without reading them (so a second run resumes where an
interrupted one stopped: the store publishes an object only after its bytes are written, so
there is no half-imported key). The rest are read into page-aligned staging memory by a worker
thread, checked against their CRC32C when the source has one, and written with one
``put_many`` per batch while the next batch is read.

This module is the import itself (Importer, import_sources) and the throttle, progress bar and
summary it reports with. Warming a live server by replaying prompts (``--replay``) is
``umbp_nvme.cli.replay``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from .archive import ArchiveReader
from ..buffers import DIO_ALIGN_BYTES, AlignedBuffer
from .hicache_files import FileBackendLayout, dir_bytes, expected_page_bytes, file_backend_units, no_page_files
from ..keybytes import encode_key, key_error, printable_key
from .maintenance import StoreReader
from .sources import SourceError, Summary, Unit, archive_units, detect_source, store_units
from ..store.segments import max_object_bytes as segment_max_object_bytes

log = logging.getLogger(__name__)

BATCH_BYTES = 32 << 20
BATCH_BYTES_MAX = 4 << 30  # the staging buffer is this big (and faulted in at once); objects are < 4 GiB
BATCH_OBJECTS = 256
# --max-gbps bounds. At the floor (1 MB/s) the largest batch (--batch-size 4g) waits about 72 min and
# a 1 GB cache takes 17 min; below it a throttle is a typo (1e-300 GB/s made the import never end).
# Above the cap the rate is not finite in bytes/s arithmetic; no drive is near it.
MIN_GBPS = 1e-3
MAX_GBPS = 1e6


def _align_up(n: int, a: int = DIO_ALIGN_BYTES) -> int:
    return -(-n // a) * a


# --- throttle and progress -------------------------------------------------------------------


class TokenBucket:
    """Bytes per second with a burst of ``burst_s`` seconds; ``rate_bps`` None or <= 0 = unlimited."""

    def __init__(self, rate_bps: float | None, burst_s: float = 0.25, clock=time.monotonic):
        self.rate = float(rate_bps) if rate_bps and rate_bps > 0 else None
        self.capacity = (self.rate or 0) * burst_s
        self.tokens = self.capacity
        self._clock = clock
        self._last = clock()

    def delay_for(self, nbytes: int) -> float:
        """Take nbytes (the balance may go negative) and return how long to wait before using them:
        never longer than nbytes take at the rate (the debt a wait cut short leaves is capped there)."""
        if self.rate is None:
            return 0.0
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self._last) * self.rate)
        self._last = now
        self.tokens = max(self.tokens - nbytes, -float(nbytes))
        return max(0.0, -self.tokens / self.rate)

    async def take(self, nbytes: int, stop: threading.Event | None = None) -> None:
        """Wait until nbytes may be used; a set ``stop`` (Ctrl-C) ends the wait within 0.2 s."""
        d = self.delay_for(nbytes)
        end = self._clock() + d
        while d > 0 and not (stop is not None and stop.is_set()):
            await asyncio.sleep(min(d, 0.2) if stop is not None else d)
            d = end - self._clock()


class Progress:
    """A tqdm bar on stderr when stderr is a terminal (bytes, GB/s, ETA); otherwise silent."""

    def __init__(self, total: int | None, *, unit: str = "B", desc: str = "", enabled: bool | None = None):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is a dependency; a broken install only loses the bar
                tqdm = None
            if tqdm is not None:
                kw = dict(unit="B", unit_scale=True, unit_divisor=1000) if unit == "B" else dict(unit=unit)
                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, smoothing=0.1, **kw)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def add_total(self, n: int) -> None:
        if self._bar is not None and self._bar.total is not None:
            self._bar.total += n
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --- the importer ----------------------------------------------------------------------------


def check_max_gbps(max_gbps) -> None:
    """None (unthrottled) or a rate in [MIN_GBPS, MAX_GBPS] GB/s; else ValueError naming --max-gbps."""
    if max_gbps is None:
        return
    if isinstance(max_gbps, bool) or not isinstance(max_gbps, (int, float)) or not MIN_GBPS <= max_gbps <= MAX_GBPS:
        raise ValueError(f"--max-gbps must be between {MIN_GBPS:g} GB/s (1 MB/s) and {MAX_GBPS:g} GB/s, got "
                         f"{max_gbps!r}; omit it for an unthrottled import")


def max_object_bytes(store) -> int:
    """The largest object ``store`` takes: one segment less the 4 KiB its records keep (a put of a
    larger one is refused), and under 4 GiB (the index's u32 length)."""
    return min(segment_max_object_bytes(int(store.segment_bytes)), (1 << 32) - 1)


class _Staging:
    def __init__(self, nbytes: int):
        self.buf = AlignedBuffer(nbytes)
        self.keys: list[str] = []
        self.views: list = []
        self.lengths: list[int] = []
        self.used = 0

    def reset(self, need: int) -> None:
        if need > self.buf.nbytes:
            self.buf.close()
            self.buf = AlignedBuffer(_align_up(need))
        self.keys, self.views, self.lengths, self.used = [], [], [], 0

    def close(self) -> None:
        self.buf.close()


class Importer:
    """Runs units into an open PageStore (the writer). ``stop`` ends the run after the batch in flight."""

    def __init__(self, store, summary: Summary, *, max_gbps: float | None = None, progress: Progress | None = None,
                 batch_bytes: int = BATCH_BYTES, batch_objects: int = BATCH_OBJECTS, crc32c=None):
        self.store = store
        self.summary = summary
        check_max_gbps(max_gbps)
        self.bucket = TokenBucket(max_gbps * 1e9 if max_gbps else None)
        self.progress = progress or Progress(None, enabled=False)
        self.batch_bytes = batch_bytes
        self.batch_objects = batch_objects
        self.stop = threading.Event()
        if crc32c is None:
            from .._uring import crc32c
        self._crc32c = crc32c
        self._pending: set[str] = set()
        # objects put_many answered False for: counted, and said once with the cause (finish)
        self.not_stored = 0
        self.not_stored_keys: list[str] = []
        self.store_full = False  # the store can hold nothing (no segment fits): the import stopped
        # what the store takes, checked before staging memory is sized for a unit
        self.max_object_bytes = max_object_bytes(store)
        self.max_key_bytes = store.max_key_bytes

    def _refusal(self, u: Unit) -> str | None:
        """Why the store cannot take this unit (checked before anything is allocated or read)."""
        for n in u.lengths:
            if not 0 <= n <= self.max_object_bytes:
                self.summary.add(too_large=sum(1 for m in u.lengths if m > self.max_object_bytes))
                return (f"{u.label}: an object of {n} bytes is over the largest this store takes ({self.max_object_bytes} "
                        f"bytes: its segments of {self.store.segment_bytes} bytes keep their last 4 KiB for records)")
        if not 0 <= u.blob_bytes <= self.max_object_bytes * len(u.keys):
            return f"{u.label}: {u.blob_bytes} bytes is more than its {len(u.keys)} objects can hold"
        for k in u.keys:
            why = key_error(k)
            if why is None and len(encode_key(k)) > self.max_key_bytes:
                why = f"key of {len(encode_key(k))} bytes, over the store's limit of {self.max_key_bytes}"
            if why is not None:
                return f"{u.label}: key {printable_key(k) if isinstance(k, str) else repr(k)} refused: {why}"
        return None

    def _fill(self, units: Iterator[Unit], stg: _Staging, carry: list) -> bool:
        """Worker thread: read units into stg until it is full. False when the source is exhausted."""
        stg.reset(0)
        s = self.summary
        while not self.stop.is_set():
            if carry:
                u = carry.pop()
            else:
                u = next(units, None)
                if u is None:
                    return False
                bad = self._refusal(u)
                if bad is not None:
                    s.add(failed=len(u.keys))
                    s.error(bad)
                    self.progress.update(u.blob_bytes)
                    if u.skip is not None:
                        u.skip()
                    continue
                present = self.store.exists_many_nowait(u.keys)
                missing = [k for k, p in zip(u.keys, present) if not p and k not in self._pending]
                if not missing:
                    s.add(skipped=len(u.keys), bytes_skipped=u.blob_bytes)
                    self.progress.update(u.blob_bytes)
                    if u.skip is not None:
                        u.skip()
                    continue
            if stg.keys and (stg.used + _align_up(u.blob_bytes) > stg.buf.nbytes or len(stg.keys) + len(u.keys) > self.batch_objects):
                carry.append(u)  # the next batch starts with it
                return True
            if not stg.keys:
                stg.reset(u.blob_bytes)
            base = stg.used
            mv = memoryview(stg.buf.array)[base : base + u.blob_bytes]
            err = u.read(mv)
            if err is None and u.crcs:
                for i, (o, n, c) in enumerate(zip(u.offsets, u.lengths, u.crcs)):
                    if c is not None and self._crc32c(mv[o : o + n]) != c:
                        err = f"{u.label}: object {printable_key(u.keys[i])} fails its CRC32C on the way in"
                        break
            self.progress.update(u.blob_bytes)
            if err is not None:
                s.add(failed=len(u.keys))
                s.error(err)
                continue
            present = self.store.exists_many_nowait(u.keys)
            for k, o, n, p in zip(u.keys, u.offsets, u.lengths, present):
                if p or k in self._pending:
                    s.add(skipped=1, bytes_skipped=n)
                    continue
                stg.keys.append(k)
                stg.views.append(stg.buf.array[base + o : base + o + n])
                stg.lengths.append(n)
                self._pending.add(k)
            stg.used = base + _align_up(u.blob_bytes)
        return False

    async def _put(self, stg: _Staging) -> None:
        if not stg.keys:
            return
        await self.bucket.take(sum(stg.lengths), self.stop)
        res = await self.store.put_many(stg.keys, stg.views)
        s = self.summary
        imported = nbytes = 0
        for k, n, ok in zip(stg.keys, stg.lengths, res):
            self._pending.discard(k)
            if ok:
                imported += 1
                nbytes += n
        s.add(imported=imported, bytes_imported=nbytes, failed=len(res) - imported)
        if not all(res):
            bad = [k for k, ok in zip(stg.keys, res) if not ok]
            self.not_stored += len(bad)
            self.not_stored_keys += [printable_key(k) for k in bad[: 3 - len(self.not_stored_keys)]]
            if not imported and getattr(self.store, "space_limit_segments", None) == 0:
                self.store_full = True  # nothing more can be stored: reading on would only fail
                self.stop.set()

    def finish(self) -> None:
        """One line for every object the store did not take, with the cause (not one per batch)."""
        if not self.not_stored:
            return
        shortage = getattr(self.store, "space_shortage", None)
        cause = shortage() if callable(shortage) else None
        self.summary.error(
            f"{self.not_stored} objects were not stored (" + ", ".join(self.not_stored_keys)
            + (", ..." if self.not_stored > len(self.not_stored_keys) else "") + "): "
            + (cause or "the store refused them or an I/O error failed them (its WARNING lines say which)")
            + ("; the import stopped, since nothing more can be stored" if self.store_full else ""))

    async def run(self, units: Iterator[Unit]) -> None:
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="umbp-warmup-read")
        stgs = [_Staging(self.batch_bytes), _Staging(self.batch_bytes)]
        carry: list = []
        put_task = None
        i = 0
        try:
            more = True
            while more and not self.stop.is_set():
                stg = stgs[i % 2]
                i += 1
                more = await loop.run_in_executor(pool, self._fill, units, stg, carry)
                if put_task is not None:
                    await put_task
                put_task = asyncio.ensure_future(self._put(stg))
            if put_task is not None:
                await put_task
                put_task = None
        finally:
            if put_task is not None:
                await asyncio.shield(put_task)
            pool.shutdown(wait=True)
            for s in stgs:
                s.close()


def _install_stop(importer_stop: threading.Event, summary: Summary):
    """First Ctrl-C (SIGINT/SIGTERM): finish the batch in flight, close the store, report. Second: abort."""
    loop = asyncio.get_running_loop()

    def on_signal():
        if importer_stop.is_set():
            loop.remove_signal_handler(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            return
        summary.interrupted = True
        importer_stop.set()
        print("\ninterrupted: finishing the batch in flight (Ctrl-C again to abort)", file=sys.stderr)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass


async def import_sources(
    store_path: str,
    sources: list[str],
    config,
    *,
    layout: FileBackendLayout | None = None,
    page_bytes: int | None = None,
    namespace: dict | None = None,
    keys: list[str] | None = None,
    max_gbps: float | None = None,
    progress: bool | None = None,
    handle_signals: bool = True,
    batch_bytes: int = BATCH_BYTES,
    capacity_from_manifest: bool = False,
) -> Summary:
    """Open store_path as writer and import every source into it (see module docstring).

    ``capacity_from_manifest``: an existing store keeps the capacity it records (a tool that was
    not told the server's capacity must not shrink the store).

    ``store_path`` may list several roots (one per drive); a SOURCE that lists several (a
    multi-drive store, D0,D1,...) imports each drive's store."""
    from ..config import parse_roots
    from ..sglang.keys import page_of
    from ..store import PageStore

    # checked before anything is opened or allocated: a clear error, not a traceback from deep inside
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or not 1 <= batch_bytes <= BATCH_BYTES_MAX:
        raise ValueError(f"batch bytes (--batch-size) must be 1..{BATCH_BYTES_MAX} bytes (4g), got {batch_bytes!r}")
    check_max_gbps(max_gbps)
    if namespace is not None and not isinstance(namespace, dict):
        raise ValueError(f"the namespace (--namespace) must be a JSON object, got {type(namespace).__name__}: "
                         f"{namespace!r:.80}")  # fmt: skip
    sources = [r for src in sources for r in (parse_roots(src) if src != "-" and not os.path.exists(src)
                                              and "," in src else [src])]  # fmt: skip
    summary = Summary()
    layout = (layout or FileBackendLayout()).validate()
    opened: list = []
    plan: list[tuple[str, str, object]] = []
    ns = namespace
    try:
        targets = {os.path.realpath(r) for r in parse_roots(store_path)}
        for src in sources:
            kind = detect_source(src)
            if kind == "store" and os.path.realpath(src) in targets:  # the writer could not open beside our reader
                raise SourceError(f"SOURCE {src} is the store being filled (--store); it holds every key already")
            if kind == "store":
                r = StoreReader(src)
                opened.append(r)
                plan.append((src, kind, r))
                ns = _merge_namespace(ns, r.namespace, src)
            elif kind == "archive":
                try:
                    a = ArchiveReader.open(src)
                except OSError as e:
                    raise SourceError(f"cannot open archive {src}: {e.strerror or e}") from None
                opened.append(a)
                plan.append((src, kind, a))
                ns = _merge_namespace(ns, a.namespace, src)
            else:
                why = no_page_files(src, layout)
                if why is not None:
                    raise SourceError(why)
                plan.append((src, kind, None))
        # several roots: each page's objects on one drive, by SGLang's key formats (the keys we import)
        store = await PageStore.open(store_path, config, namespace=ns or None,
                                     capacity_from_manifest=capacity_from_manifest, page_of=page_of)
        try:
            if hasattr(store, "wait_loaded"):  # a large index loads after open returns (store/loading.py)
                await store.wait_loaded()
            target_ns = store.manifest.get("namespace") or {}
            expected = page_bytes or expected_page_bytes(target_ns, layout)
            max_obj = max_object_bytes(store)
            for _src, kind, obj in plan:
                if kind == "archive":
                    obj.max_object_bytes = max_obj  # a larger record fails alone, before any allocation
            total = 0
            for src, kind, obj in plan:
                if kind == "store":
                    total += int(obj.scan()[1]["length"].sum()) if keys is None else 0
                elif kind == "archive":
                    total += obj.bytes_left or 0
                elif kind == "files":
                    total += dir_bytes(src, layout)
            bar = Progress(total or None, desc="warmup", enabled=progress)
            imp = Importer(store, summary, max_gbps=max_gbps, progress=bar, batch_bytes=batch_bytes)
            evictions0 = store.stats()["evictions"]
            if handle_signals:
                _install_stop(imp.stop, summary)
            try:
                for src, kind, obj in plan:
                    if imp.stop.is_set():
                        break
                    summary.sources.append({"source": src, "kind": kind})
                    if kind == "files":
                        units = file_backend_units(src, layout, expected, summary, max_page_bytes=max_obj * layout.divisor())
                    elif kind == "store":
                        units = store_units(obj, summary, keys)
                    else:
                        units = archive_units(obj, summary)
                    if keys is not None and kind != "store":
                        wanted = set(keys)
                        units = _only_keys(units, wanted, summary)
                    await imp.run(units)
                imp.finish()
            finally:
                # "imported" counts what was stored; an import larger than the store evicts some of it again
                summary.evicted = store.stats()["evictions"] - evictions0
                if summary.evicted:
                    log.warning("the store evicted %d objects during the import to make room: it holds less than was "
                                "imported (capacity %d bytes)", summary.evicted, store.capacity_bytes)
                bar.close()
                if handle_signals:
                    loop = asyncio.get_running_loop()
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        try:
                            loop.remove_signal_handler(sig)
                        except (NotImplementedError, RuntimeError):
                            pass
        finally:
            await store.close()
    finally:
        for o in opened:
            o.close()
    return summary.finish()


def _only_keys(units: Iterator[Unit], wanted: set, summary: Summary) -> Iterator[Unit]:
    for u in units:
        if any(k in wanted for k in u.keys):
            yield u
        elif u.skip is not None:
            u.skip()


def _merge_namespace(ns: dict | None, other: dict, src: str) -> dict | None:
    if not other:
        return ns
    if ns and json.dumps(ns, sort_keys=True) != json.dumps(other, sort_keys=True):
        from ..errors import NamespaceMismatchError

        fields = sorted(k for k in set(ns) | set(other) if ns.get(k) != other.get(k))
        raise NamespaceMismatchError(
            f"source {src} has namespace {other!r}, which differs from another source's {ns!r} "
            f"(fields {', '.join(fields)}); import them into separate stores"
        )
    return dict(other)
