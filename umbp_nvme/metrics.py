"""Prometheus metrics for umbp_nvme stores (``prometheus_client`` is optional: ``pip install umbp_nvme[metrics]``).

What a process exposes, all ``umbp_nvme_*`` (the table is ``FAMILIES``):

* the store's own counters and gauges, read from ``store.stats()`` -- never counted twice on the
  data path: puts, gets, hits, misses, evictions, CRC errors, timeouts, objects, bytes used,
  capacity, ...;
* I/O errors per op (``-errno`` results and failed syncs), counted by a thin wrapper around the
  store's engines (one ``count_nonzero`` per engine batch);
* fallbacks: the engine and O_DIRECT asked for vs. what the store really uses;
* a store over several drives: ``umbp_nvme_drive_*`` per drive (label ``drive``): healthy, objects,
  bytes, capacity, bytes read / written, errors, degradations, read / write GB/s, free bytes,
  session unrecorded (and ``umbp_nvme_drives_session_unrecorded``, how many);
* latency histograms per op (``put``, ``get``, ``exists``), per batch call and per object (the
  batch's time over its objects, one observation per call), buckets 10 us .. 10 s.

Labels are bounded: SGLang's rank identity (``model_name``, ``tp_rank``, ``dp_rank``, ``pp_rank``,
``attn_cp_rank``), ``store`` (``main`` or ``sidecar``) and, where a family has one, ``op`` or
``what``. Never a key or a hash.

Two ways out, picked once per process:

* **one process** (no ``PROMETHEUS_MULTIPROC_DIR``): a custom collector reads ``stats()`` of every
  watched store when Prometheus scrapes; the data path pays nothing for it.
* **multiprocess** (SGLang with ``--enable-metrics`` sets ``PROMETHEUS_MULTIPROC_DIR``; its
  ``/metrics`` reads only the files under it): a collector in the scheduler process would never be
  seen, so a daemon thread copies ``stats()`` into multiprocess Counters and Gauges
  (``multiprocess_mode="mostrecent"``) every ``refresh_s`` seconds and once more at detach.

The histograms are counted per call in a small ``Latency`` accumulator (a bisect and a lock, about
1 us) and exported like the rest: built at scrape time in one process, added to multiprocess
``Histogram`` files by the refresh thread.
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
import weakref


log = logging.getLogger(__name__)

LABELS = ("model_name", "tp_rank", "dp_rank", "pp_rank", "attn_cp_rank", "store")
OPS = ("put", "get", "exists")
IO_OPS = ("read", "write", "sync")
# 10 us .. 10 s, roughly 1-2.5-5 per decade: an exists hit is tens of us, a 64 MiB batch on a
# stalled drive seconds.
LATENCY_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
DEFAULT_REFRESH_S = 1.0
_SCRAPE_TIMEOUT_S = 2.0  # a scrape never waits longer than this on a busy store loop

# (family, kind, stats() key, help). Counter families get "_total" in the exposition.
FAMILIES = (
    ("umbp_nvme_puts", "counter", "puts", "Objects stored by put_many (re-puts of a stored key included)."),
    ("umbp_nvme_put_dedup", "counter", "put_dedup", "Puts of a key already stored (kept the first bytes)."),
    ("umbp_nvme_put_failed", "counter", "put_failed", "Objects a put_many did not store (I/O error, no space, bad buffer, timeout)."),
    ("umbp_nvme_put_declined", "counter", "put_declined",
     "New objects the admission policy chose not to write (their put answered True; not failures)."),
    ("umbp_nvme_gets", "counter", "gets", "Objects asked for by get_many."),
    ("umbp_nvme_hits", "counter", "hits", "Objects get_many returned, verified."),
    ("umbp_nvme_misses", "counter", "misses", "Objects get_many did not return (absent, I/O error, CRC error, timeout)."),
    ("umbp_nvme_evictions", "counter", "evictions", "Objects evicted to stay under the high watermark."),
    ("umbp_nvme_deletes", "counter", "deletes", "Objects deleted or dropped (a CRC error drops its entry)."),
    ("umbp_nvme_crc_errors", "counter", "crc_errors", "Objects whose stored copy failed its CRC32C, also on a second read (served as misses, dropped)."),
    ("umbp_nvme_timeouts", "counter", "timeouts", "Engine batches that outlived io_timeout_s."),
    ("umbp_nvme_stalled_ops", "counter", "stalled_ops", "Ops in batches that outlived io_timeout_s."),
    ("umbp_nvme_late_completions", "counter", "late_completions", "Ops the kernel completed after their batch had timed out."),
    ("umbp_nvme_late_writes", "counter", "late_writes", "Write batches that completed after their timeout."),
    ("umbp_nvme_bytes_written", "counter", "bytes_written", "Object bytes written."),
    ("umbp_nvme_bytes_read", "counter", "bytes_read", "Object bytes read and verified."),
    ("umbp_nvme_kv_events_dropped", "counter", "kv_events_dropped", "DISK KV events (pages) dropped because the event queue was full; a re-announcement of what the store holds follows."),
    ("umbp_nvme_loading_misses", "counter", "loading_misses", "Lookups answered as misses while the index loaded in the background."),
    ("umbp_nvme_puts_refused_loading", "counter", "puts_refused_loading", "Objects whose put answered False because the index was still loading after 1 s."),
    ("umbp_nvme_key_set_builds", "counter", "key_set_builds", "Key sets a follower built from its index to answer exists (once per file; again when it fell behind the change log)."),
    ("umbp_nvme_index_loading", "gauge", "index_loading", "1 while the index loads in the background (or its load failed: the store answers misses)."),
    ("umbp_nvme_io_errors", "counter", None, "I/O ops that failed with an errno (read, write) or syncs that raised."),
    ("umbp_nvme_objects", "gauge", "objects", "Objects stored."),
    ("umbp_nvme_bytes_used", "gauge", "bytes_used", "Bytes in allocated slots (what capacity counts)."),
    ("umbp_nvme_capacity_bytes", "gauge", "capacity_bytes", "Configured capacity (ssd_capacity_bytes)."),
    ("umbp_nvme_effective_capacity_bytes", "gauge", "effective_capacity_bytes", "Capacity the store runs with: the configured one, or less while the file system refuses new segment files."),
    ("umbp_nvme_disk_bytes", "gauge", "disk_bytes", "Bytes the segment files occupy on disk."),
    ("umbp_nvme_index_bytes", "gauge", "index_bytes", "Bytes index.lmdb occupies on disk."),
    ("umbp_nvme_segments_free", "gauge", "segments_free", "Segments holding no object."),
    ("umbp_nvme_pinned_slots", "gauge", "pinned_slots", "Slots pinned by reads in flight."),
    ("umbp_nvme_puts_in_doubt_bytes", "gauge", "puts_in_doubt_bytes", "Bytes of put batches whose index commit outlived io_timeout_s, held until a later commit settles them."),
    ("umbp_nvme_high_watermark_ratio", "gauge", "high_watermark", "Fill at which eviction starts."),
    ("umbp_nvme_drives_session_unrecorded", "gauge", "drives_session_unrecorded",
     "Drives of a multi-drive store whose writer session could not be recorded (DRIVES.json not written and fsynced): they take no writes until a probe records it."),
    ("umbp_nvme_fs_free_bytes", "gauge", None, "Free bytes on the store's file system (statvfs, for unprivileged users)."),
    ("umbp_nvme_fallback", "gauge", None, "1 when the store runs on less than it was asked for (what=engine: posix instead of io_uring; what=o_direct: buffered I/O)."),
    ("umbp_nvme_engine_info", "gauge", None, "1, labelled with the engine asked for and the engine in use."),
    ("umbp_nvme_o_direct", "gauge", None, "1 when the data files are opened with O_DIRECT."),
)
# A store over several drives (store/drives.py) adds these, one series per drive (label ``drive``:
# its index in the configured roots; ``umbp_nvme_drive_info`` maps it to the root's path).
# (family, kind, stats()["drives"][i] key, help)
DRIVE_FAMILIES = (
    ("umbp_nvme_drive_healthy", "gauge", None, "1 while the drive serves (healthy), 0 while it is degraded (stalled, I/O errors, gone, full, not open)."),
    ("umbp_nvme_drive_info", "gauge", None, "1, labelled with the drive's root path."),
    ("umbp_nvme_drive_fs_free_bytes", "gauge", None, "Free bytes on the drive's file system (statvfs; not read while it is degraded)."),
    ("umbp_nvme_drive_objects", "gauge", "objects", "Objects stored on the drive."),
    ("umbp_nvme_drive_bytes_used", "gauge", "bytes_used", "Bytes in allocated slots on the drive."),
    ("umbp_nvme_drive_capacity_bytes", "gauge", "capacity_bytes", "The drive's share of ssd_capacity_bytes."),
    ("umbp_nvme_drive_bytes_read", "counter", "bytes_read", "Object bytes read and verified from the drive."),
    ("umbp_nvme_drive_bytes_written", "counter", "bytes_written", "Object bytes written to the drive."),
    ("umbp_nvme_drive_errors", "counter", "errors", "Failed ops on the drive (I/O errors, failed syncs, timeouts)."),
    ("umbp_nvme_drive_degradations", "counter", "degradations", "Times the drive was marked degraded."),
    ("umbp_nvme_drive_session_unrecorded", "gauge", "session_unrecorded", "1 while the drive's session record could not be written: it serves reads and takes no writes."),
    ("umbp_nvme_drive_read_gbps", "gauge", "read_gbps", "The drive's read throughput: bytes read over the time a get was in flight on it (GB/s)."),
    ("umbp_nvme_drive_write_gbps", "gauge", "write_gbps", "The drive's write throughput: bytes written over the time a put was in flight on it (GB/s)."),
)
HISTOGRAMS = (
    ("umbp_nvme_batch_seconds", "Wall time of one batch call (put_many, get_many, exists), by op."),
    ("umbp_nvme_object_seconds", "Wall time of one batch call divided by its objects (one observation per call), by op."),
)


def available() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def multiprocess_mode() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir"))


def labels_from_storage_config(storage_config, store: str = "main") -> dict:
    """The bounded label values of one SGLang rank (empty strings outside SGLang)."""

    def get(name, default=0):
        v = getattr(storage_config, name, default) if storage_config is not None else default
        return str(v if v is not None else default)

    return {
        "model_name": get("model_name", ""),
        "tp_rank": get("tp_rank"),
        "dp_rank": get("dp_rank"),
        "pp_rank": get("pp_rank"),
        "attn_cp_rank": get("attn_cp_rank"),
        "store": store,
    }


# ------------------------------------------------------------------------------ samples


def samples_from_stats(stats: dict, *, asked_engine: str | None = None,
                       asked_o_direct: bool | None = None) -> list[tuple[str, str, dict, float]]:
    """``(family, kind, extra labels, value)`` for every family a stats() dict can fill."""
    out: list[tuple[str, str, dict, float]] = []
    for name, kind, key, _ in FAMILIES:
        if key is not None and isinstance(stats.get(key), (int, float)) and not isinstance(stats.get(key), bool):
            out.append((name, kind, {}, float(stats[key])))
    for op in IO_OPS:  # the store counts them (stats()["io_errors_<op>"])
        v = stats.get(f"io_errors_{op}")
        if isinstance(v, int) and not isinstance(v, bool):
            out.append(("umbp_nvme_io_errors", "counter", {"op": op}, float(v)))
    path = stats.get("path") or stats.get("store")
    if path:
        try:
            sv = os.statvfs(path)
            out.append(("umbp_nvme_fs_free_bytes", "gauge", {}, float(sv.f_bavail * sv.f_frsize)))
        except OSError:
            pass
    out += drive_samples(stats.get("drives"))
    chosen = stats.get("engine")
    if chosen is not None:
        asked = asked_engine or "auto"
        out.append(("umbp_nvme_engine_info", "gauge", {"asked": asked, "chosen": str(chosen)}, 1.0))
        out.append(("umbp_nvme_fallback", "gauge", {"what": "engine"}, float(asked != "posix" and chosen == "posix")))
    if stats.get("o_direct") is not None:
        on = bool(stats["o_direct"])
        out.append(("umbp_nvme_o_direct", "gauge", {}, float(on)))
        if asked_o_direct is not None:
            out.append(("umbp_nvme_fallback", "gauge", {"what": "o_direct"}, float(bool(asked_o_direct) and not on)))
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def drive_samples(rows) -> list[tuple[str, str, dict, float]]:
    """The per-drive series of a store over several drives (``stats()["drives"]``); [] for one."""
    if not isinstance(rows, list) or len(rows) < 2:
        return []
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            continue
        lab = {"drive": str(row.get("drive", i))}
        state = str(row.get("state", ""))
        out.append(("umbp_nvme_drive_healthy", "gauge", lab, float(state == "healthy")))
        out.append(("umbp_nvme_drive_info", "gauge", dict(lab, path=str(row.get("path", ""))), 1.0))
        for name, kind, key, _ in DRIVE_FAMILIES:
            if key is not None and _number(row.get(key)):
                out.append((name, kind, lab, float(row[key])))
        path = row.get("path")
        if path and state == "healthy":  # a stalled drive's statvfs could hang the scrape
            try:
                sv = os.statvfs(path)
                out.append(("umbp_nvme_drive_fs_free_bytes", "gauge", lab, float(sv.f_bavail * sv.f_frsize)))
            except OSError:
                pass
    return out


def _help(name: str) -> str:
    for n, _, _, h in FAMILIES + DRIVE_FAMILIES:
        if n == name:
            return h
    return name


def families(rows: list[tuple[dict, list[tuple[str, str, dict, float]]]]):
    """prometheus_client metric families from ``[(base labels, samples)]`` (one entry per store)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fams: dict = {}
    for base, samples in rows:
        for name, kind, extra, value in samples:
            names = list(base) + list(extra)
            fam = fams.get((name, tuple(names)))
            if fam is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = fams[(name, tuple(names))] = cls(name, _help(name), labels=names)
            fam.add_metric([str(v) for v in list(base.values()) + list(extra.values())], value)
    return list(fams.values())


def exposition(rows) -> bytes:
    """The text exposition of ``families(rows)`` (``umbp-nvme stats --prometheus``)."""
    from prometheus_client import CollectorRegistry, generate_latest

    class _Once:
        def collect(self):
            return families(rows)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Once())
    return generate_latest(reg)


def store_on_disk_exposition(stats: dict, counters: dict | None = None) -> bytes:
    """``umbp-nvme stats --prometheus``: the gauges of a store on disk (maintenance.store_stats),
    plus the counters a running store published, if any."""
    merged = dict(stats)
    if counters:
        merged.update({k: v for k, v in counters.items() if k not in merged})
    base = {k: "" for k in LABELS}
    return exposition([(base, samples_from_stats(merged))])


# ------------------------------------------------------------------------------ engines


# ------------------------------------------------------------------------------ latency


class Latency:
    """Bucket counts of one op's calls: per batch and per object (the batch's time over its objects).

    A bisect and four adds under a lock (about 1 us), instead of two prometheus_client observes
    (about 2 us each): the histograms are built from these at scrape time (one process) or copied
    into multiprocess Histograms by the refresh thread.
    """

    __slots__ = ("lock", "batch", "obj", "batch_sum", "obj_sum")

    def __init__(self):
        n = len(LATENCY_BUCKETS_S) + 1  # the last is +Inf
        self.lock = threading.Lock()
        self.batch, self.obj = [0] * n, [0] * n
        self.batch_sum = self.obj_sum = 0.0

    def add(self, seconds: float, n: int) -> None:
        i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)  # le: a value on a bound counts in it
        if n:
            per = seconds / n
            j = bisect.bisect_left(LATENCY_BUCKETS_S, per)
        with self.lock:
            self.batch[i] += 1
            self.batch_sum += seconds
            if n:
                self.obj[j] += 1
                self.obj_sum += per

    def snapshot(self) -> tuple[list, float, list, float]:
        with self.lock:
            return list(self.batch), self.batch_sum, list(self.obj), self.obj_sum


def _histogram_family(name: str, rows):
    """A HistogramMetricFamily from ``[(label values, per-bucket counts, sum)]``."""
    from prometheus_client.core import HistogramMetricFamily

    help_ = dict(HISTOGRAMS)[name]
    fam = HistogramMetricFamily(name, help_, labels=LABELS + ("op",))
    for lv, counts, total in rows:
        cum, buckets = 0, []
        for bound, c in zip(LATENCY_BUCKETS_S + (float("inf"),), counts):
            cum += c
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cum))
        fam.add_metric(lv, buckets, total)
    return fam


# ------------------------------------------------------------------------------ per store


class StoreWatch:
    """One watched SyncPageStore: its labels, I/O error counts and latency histogram children."""

    def __init__(self, owner: "Metrics", sync_store, labels: dict, extra=None):
        self.owner = owner
        self.sync_store = sync_store
        self.labels = dict(labels)
        self.extra = extra  # () -> {stats key: value} kept outside the store (the KV events' counters)
        cfg = getattr(sync_store.store, "config", None)
        self.asked_engine = getattr(cfg, "ssd_io_backend", None)
        self.asked_o_direct = getattr(cfg, "o_direct", None)
        self._pushed: dict = {}
        self.latency = {op: Latency() for op in OPS}
        self._lat_pushed = {op: ([0] * (len(LATENCY_BUCKETS_S) + 1), 0.0, [0] * (len(LATENCY_BUCKETS_S) + 1), 0.0)
                            for op in OPS}

    def observe(self, op: str, t0: float, n: int) -> None:
        """One batch call of ``n`` objects that started at ``perf_counter() == t0``."""
        self.latency[op].add(time.perf_counter() - t0, n)

    def sample(self) -> list[tuple[str, str, dict, float]]:
        try:
            stats = self.sync_store.stats(timeout_s=_SCRAPE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a scrape never fails for one busy or closed store
            log.debug("umbp_nvme metrics: stats of %s unavailable: %r", getattr(self.sync_store, "path", "?"), e)
            return []
        if self.extra is not None:
            try:
                stats = {**stats, **self.extra()}
            except Exception as e:  # noqa: BLE001 - the store's own samples still go out
                log.debug("umbp_nvme metrics: extra counters unavailable: %r", e)
        return samples_from_stats(stats, asked_engine=self.asked_engine, asked_o_direct=self.asked_o_direct)


class Metrics:
    """The umbp_nvme metrics of one registry (``default()`` is the process's, on REGISTRY)."""

    def __init__(self, registry=None, *, multiprocess: bool | None = None, refresh_s: float = DEFAULT_REFRESH_S):
        from prometheus_client import REGISTRY, Histogram

        self.registry = REGISTRY if registry is None else registry
        self.multiprocess = multiprocess_mode() if multiprocess is None else multiprocess
        self.refresh_s = float(refresh_s)
        self._lock = threading.Lock()
        self._watches: list[StoreWatch] = []
        self.batch_hist = self.object_hist = None
        if self.multiprocess:  # files-backed Histograms the refresh thread adds to
            self.batch_hist, self.object_hist = (
                Histogram(n, h, labelnames=LABELS + ("op",), buckets=LATENCY_BUCKETS_S, registry=self.registry)
                for n, h in HISTOGRAMS
            )
        self._push_lock = threading.Lock()  # the refresh thread and unwatch() never add the same delta twice
        self._mp: dict = {}  # multiprocess Counters / Gauges by (family, label names)
        self._thread = None
        self._wake = threading.Event()
        self.refreshes = 0  # refresh rounds the pusher thread has finished
        self._refreshed = threading.Condition()
        if not self.multiprocess:
            self.registry.register(_Collector(self))

    def watch(self, sync_store, labels: dict | None = None, extra=None) -> StoreWatch:
        """Start exporting ``sync_store`` (and timing its calls: ``sync_store.metrics`` is set);
        ``extra() -> {stats key: value}``: counters its owner keeps outside the store, exported
        with its stats (the SGLang backend's KV-event counters)."""
        lab = {k: "" for k in LABELS}
        lab.update({k: str(v) for k, v in (labels or {}).items() if k in LABELS})
        w = StoreWatch(self, sync_store, lab, extra)
        with self._lock:
            self._watches.append(w)
        sync_store.metrics = w
        if self.multiprocess:
            self.push(w)
            self._start_pusher()
        return w

    def unwatch(self, sync_store) -> None:
        """Stop exporting it; in multiprocess mode its last values are written first."""
        with self._lock:
            gone = [w for w in self._watches if w.sync_store is sync_store]
            self._watches = [w for w in self._watches if w.sync_store is not sync_store]
        for w in gone:
            if self.multiprocess:
                self.push(w)
            sync_store.metrics = None

    def watches(self) -> list[StoreWatch]:
        with self._lock:
            return list(self._watches)

    # --- multiprocess: copy stats() into files-backed metric objects ---

    def push(self, w: StoreWatch) -> None:
        with self._push_lock:
            self._push(w)

    def _push(self, w: StoreWatch) -> None:
        from prometheus_client import Counter, Gauge

        for name, kind, extra, value in w.sample():
            names = LABELS + tuple(extra)
            key = (name, names)
            m = self._mp.get(key)
            if m is None:
                if kind == "counter":
                    m = Counter(name, _help(name), labelnames=names, registry=self.registry)
                else:
                    m = Gauge(name, _help(name), labelnames=names, registry=self.registry, multiprocess_mode="mostrecent")
                self._mp[key] = m
            child = m.labels(*[w.labels[k] for k in LABELS], *extra.values())
            if kind == "counter":
                sk = (name, tuple(extra.items()))
                last = w._pushed.get(sk, 0.0)
                delta = value - last if value >= last else value  # a reopened store counts from 0
                if delta > 0:
                    child.inc(delta)
                w._pushed[sk] = value
            else:
                child.set(value)
        self._push_latency(w)

    def _push_latency(self, w: StoreWatch) -> None:
        lv = [w.labels[k] for k in LABELS]
        for op in OPS:
            b, bs, o, os_ = w.latency[op].snapshot()
            pb, pbs, po, pos = w._lat_pushed[op]
            for hist, counts, prev, total, ptotal in ((self.batch_hist, b, pb, bs, pbs), (self.object_hist, o, po, os_, pos)):
                if counts == prev:
                    continue
                _add_to_histogram(hist.labels(*lv, op), [c - p for c, p in zip(counts, prev)], total - ptotal)
            w._lat_pushed[op] = (b, bs, o, os_)

    def _start_pusher(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._push_loop, name="umbp-metrics", daemon=True)
            self._thread.start()

    def _push_loop(self) -> None:
        while not self._wake.wait(self.refresh_s):
            for w in self.watches():
                try:
                    self.push(w)
                except Exception as e:  # noqa: BLE001 - metrics never take the server down
                    log.debug("umbp_nvme metrics: refresh failed: %r", e)
            with self._refreshed:
                self.refreshes += 1
                self._refreshed.notify_all()

    def wait_refreshes(self, n: int, timeout_s: float) -> bool:
        """Block until ``n`` more refresh rounds have finished; False if ``timeout_s`` passed first.
        A round that began before the call may count: ask for 2 to see a value set just before."""
        with self._refreshed:
            target = self.refreshes + n
            return self._refreshed.wait_for(lambda: self.refreshes >= target, timeout_s)

    def close(self) -> None:
        self._wake.set()


def _add_to_histogram(child, deltas: list, dsum: float) -> None:
    """Add per-bucket counts to a prometheus_client Histogram child (multiprocess files included)."""
    buckets, total = getattr(child, "_buckets", None), getattr(child, "_sum", None)
    if buckets is not None and total is not None and len(buckets) == len(deltas):
        for b, d in zip(buckets, deltas):
            if d:
                b.inc(d)
        total.inc(dsum)
        return
    # another prometheus_client layout: replay at the bucket bounds (sum approximate)
    for bound, d in zip(LATENCY_BUCKETS_S + (LATENCY_BUCKETS_S[-1] * 2,), deltas):
        for _ in range(d):
            child.observe(bound)


class _Collector:
    """Reads every watched store's stats() at scrape time (one-process mode)."""

    def __init__(self, metrics: Metrics):
        self._metrics = weakref.ref(metrics)

    def describe(self):
        return []  # families depend on the stores watched: never pre-registered names

    def collect(self):
        m = self._metrics()
        if m is None:
            return []
        watches = m.watches()
        out = families([({k: w.labels[k] for k in LABELS}, w.sample()) for w in watches])
        batch, obj = [], []
        for w in watches:
            lv = [w.labels[k] for k in LABELS]
            for op in OPS:
                b, bs, o, os_ = w.latency[op].snapshot()
                batch.append((lv + [op], b, bs))
                obj.append((lv + [op], o, os_))
        if watches:
            out += [_histogram_family(HISTOGRAMS[0][0], batch), _histogram_family(HISTOGRAMS[1][0], obj)]
        return out


_default: Metrics | None = None
_default_lock = threading.Lock()
_warned = False


def default() -> Metrics | None:
    """The process's Metrics on prometheus_client's REGISTRY; None (logged once) without prometheus_client."""
    global _default, _warned
    with _default_lock:
        if _default is None:
            if not available():
                if not _warned:
                    _warned = True
                    log.warning("umbp_nvme: metrics asked for but prometheus_client is not installed "
                                "(pip install 'umbp_nvme[metrics]'); running without them")
                return None
            _default = Metrics()
        return _default
