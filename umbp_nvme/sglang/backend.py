"""UMBPNvmeStore: SGLang's HiCache L3 storage backend over the local-NVMe PageStore.

Loaded by SGLang's ``dynamic`` storage backend (docs/sglang.md §1)::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "umbp_nvme", "module_path": "umbp_nvme.sglang_backend",
        "class_name": "UMBPNvmeStore", "interface_v1": 1, "ssd_storage_dir": "/mnt/nvme/hicache"}'

The front layer is thin: it turns page hashes into component keys (``keys.KeyScheme``) and host
slots into ``(address, nbytes)`` pairs (the host pool's ``get_page_buffer_meta``), makes **one**
store call per SGLang call, and folds per-object results back into per-page booleans.

Rules it keeps (each has a test):

- Constructing is cheap and touches no disk: the dynamic loader calls ``cls(storage_config, {})``
  and the store is opened at ``register_mem_pool_host``, when layout, dtype and object sizes are
  known. The store namespace records them; a directory made for another model, layout, dtype or
  page geometry is refused with ``NamespaceMismatchError`` instead of serving garbage.
- One store directory per rank (``keys.rank_subdir``: ``tp1``, ``pp0``, ``dp1_tp0``, ...), except
  MLA with TP > 1: the writer rank (``is_storage_writer``, TP 0) owns one shared directory and
  the other ranks open it read-only in their own processes, seeing the writer's new objects
  while running. A follower's own TP-sharded side-pool state (Mamba) goes to a small private
  store of its own, since the shared one has a single writer.
- ``batch_get_v1`` / ``batch_set_v1`` never raise and never return None (either would kill
  SGLang's prefetch or backup thread for good): failures log once and become ``False`` per page.
  v2 calls raise only where UMBP raises (unregistered pool, index-count and buffer-meta
  mismatches).
- Legacy (non ``interface_v1``) calls store whole flat pages under their own keys
  (``KeyScheme.flat_key``), so they can never be confused with v1 per-component objects.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Mapping
from typing import List

from ..config import StoreConfig, config_sources, load_config, parse_bool
from .hits import v2_hits
from . import kv_events, stores
from .keys import KeyScheme, is_mla_follower, rank_subdir
from .seam import BACKEND_KEYS, Seam
from .transfers import legacy_batch_get, legacy_batch_set, v1_io, v2_io

log = logging.getLogger("umbp_nvme.sglang_backend")  # the name SGLang users filter on (the module moved, the logger did not)

# SGLang is optional: subclass its HiCacheStorage when it imports, a local stand-in otherwise.
# UMBP_NVME_NO_SGLANG=1 forces the stand-in (tests of the no-SGLang path).
HAVE_SGLANG = False
if os.environ.get("UMBP_NVME_NO_SGLANG", "") not in ("1", "true", "yes"):
    try:
        from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
            HiCacheStorage,
            HiCacheStorageExtraInfo,
            PoolName,
            PoolTransferResult,
        )

        HAVE_SGLANG = True
    except Exception as _e:  # noqa: BLE001 - any failure inside sglang's import means "not usable"
        log.debug("sglang not importable (%s); using the local HiCacheStorage stand-in", _e)
if not HAVE_SGLANG:
    from ._hicache_standin import (  # noqa: F401 - re-exported for callers without sglang
        HiCacheStorage,
        HiCacheStorageExtraInfo,
        PoolName,
        PoolTransferResult,
    )

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head")
LAYOUT_ERROR = "UMBP store only supports page_first, page_first_direct, or page_head layout"
_METRICS_MAX = 4096  # batch calls kept for the metrics between two get_stats() calls (the oldest go first)



def stores_page_envelope(pool) -> bool:
    """One object per page holding the whole unified page (§3). SGLang 0.5.22+ says so in
    ``stores_page_envelope``; 0.5.21's UnifiedPageEnvelopeHostPool is one and does not say."""
    flag = getattr(pool, "stores_page_envelope", None)
    if flag is not None:
        return bool(flag)
    return type(pool).__name__ == "UnifiedPageEnvelopeHostPool"

class UMBPNvmeStore(HiCacheStorage):
    """HiCacheStorage on local NVMe. See the module docstring for the rules it keeps."""

    def __init__(self, storage_config=None, mem_pool_host=None, *, engine_factory=None, **kwargs):
        # engine_factory: PageStore.open's hook (tests and fault injection wrap the engines there)
        # The dynamic loader passes its kwargs dict as the second positional argument; only a
        # real host pool (something with a layout) is registered here, as UMBP's own form does.
        self.storage_config = storage_config
        extra = getattr(storage_config, "extra_config", None) or {}
        if not isinstance(extra, Mapping):
            raise ValueError(f"extra_config must be a JSON object (a dict of settings), got {type(extra).__name__}: "
                             f"{extra!r:.80}")  # fmt: skip
        extra = dict(extra)
        # our own switches (not StoreConfig fields): Prometheus export and a doctor report at open
        prometheus = extra.pop("prometheus", None)
        doctor_at_start = _switch(extra.pop("doctor_at_start", False), "doctor_at_start")
        events_cfg = kv_events.pop_config(extra, storage_config)  # None: no DISK events (default)
        self.config: StoreConfig = load_config(extra, known=(*BACKEND_KEYS, *kv_events.KEYS))
        self.interface_v1 = _switch(extra.get("interface_v1", 0), "interface_v1")
        self.scheme = KeyScheme.from_storage_config(storage_config)
        self.is_mla = self.scheme.is_mla
        self.is_mla_follower = is_mla_follower(storage_config)
        self.enable_storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.model_name = getattr(storage_config, "model_name", None) or ""
        # several roots (one per drive): every root holds this rank's directory (drives.py)
        self.root_dirs = [os.path.abspath(r) for r in self.config.storage_roots]
        self.root_dir = self.root_dirs[0]
        sub = rank_subdir(storage_config)
        cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
        if cp_size > 1:
            # Attention-CP ranks hold disjoint slices of each page under the same key: one
            # directory (one writer) each.
            sub = "_".join(p for p in (sub, f"cp{int(getattr(storage_config, 'attn_cp_rank', 0) or 0)}") if p)
        self.store_dirs = [os.path.join(r, sub) if sub else r for r in self.root_dirs]
        tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        side = "_".join(p for p in (sub, f"tp{tp_rank}_sidecar") if p)
        self.private_dirs = [os.path.join(r, side) for r in self.root_dirs]
        self.store_dir, self.private_dir = ",".join(self.store_dirs), ",".join(self.private_dirs)  # for messages
        # everything the helpers (stores.py, transfers.py) read or change
        self._seam = Seam(
            config=self.config, storage_config=storage_config, scheme=self.scheme, interface_v1=self.interface_v1,
            follower=self.is_mla_follower, store_dirs=self.store_dirs, private_dirs=self.private_dirs,
            model_name=self.model_name, engine_factory=engine_factory, doctor_at_start=doctor_at_start,
            prometheus=self.enable_storage_metrics if prometheus is None else _switch(prometheus, "prometheus"),
            events_cfg=events_cfg, settings_from=config_sources(extra),
        )  # fmt: skip
        self.registry = self._seam.registry
        self.registered_pools: dict = {}  # HiCacheStorage's attribute, kept for callers that read it
        # (is_set, pages, GB/s) per batch call: appended by SGLang's I/O threads, drained by
        # get_stats() on its scheduler thread; deque appends and pops are atomic, so neither locks
        self._batches: deque = deque(maxlen=_METRICS_MAX)
        # SGLang calls get_stats() only with storage metrics on: find its StorageMetrics now, at
        # startup, not in the first scheduler pass (importing it cost that pass 65-220 ms here)
        self._metrics_cls = storage_metrics_class() if self.enable_storage_metrics else None
        if not self.config.ssd_enabled:
            log.warning("umbp_nvme: ssd_enabled is false; this backend stores nothing and every lookup misses")
        if mem_pool_host is not None and hasattr(mem_pool_host, "layout"):
            self.register_mem_pool_host(mem_pool_host)

    # What registration set, read from the seam (its one owner).
    @property
    def mem_pool_host(self):
        return self._seam.anchor

    @property
    def page_size(self) -> int:
        return self._seam.page_size

    @property
    def kv_anchor_is_logical(self) -> bool:
        return self._seam.logical_anchor

    # Read-only views for the benchmarks, tools and tests that watch the DISK KV events.
    @property
    def publisher(self):
        """The KV-event publisher (kv_events.Publisher) while DISK events are published, else None."""
        return self._seam.publisher

    @property
    def residency(self):
        """The residency tracker (kv_residency.Residency) hooked into this rank's store, else None."""
        return self._seam.residency

    @property
    def v1_suffixes(self) -> tuple[str, ...]:
        """The KV anchor's per-page object suffixes: a page's objects are ``page_hash + suffix``."""
        return self._seam.v1_sfx

    def set_kv_events(self, on: bool) -> bool:
        """Start (as configured by ``kv_events_*``) or stop publishing DISK KV events for this
        rank's open store; True when publishing afterwards. For benchmarks that compare both."""
        store = self._seam.main
        if on and self._seam.publisher is None and store is not None:
            stores.start_events(self._seam, store)
        elif not on and self._seam.publisher is not None:
            stores.stop_events(self._seam, store)
        return self._seam.publisher is not None

    # ------------------------------------------------------------------------- registration

    def register_mem_pool_host(self, mem_pool_host) -> None:
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(f"{LAYOUT_ERROR}; got layout={layout!r}")
        seam = self._seam
        seam.anchor = mem_pool_host
        seam.page_size = int(getattr(mem_pool_host, "page_size", 1) or 1)
        seam.logical_anchor = getattr(mem_pool_host, "kv_buffer", None) is None
        seam.envelope = stores_page_envelope(mem_pool_host)
        seam.v1_sfx = self.scheme.v1_suffixes(envelope=seam.envelope)
        seam.namespace = stores.make_namespace(seam, mem_pool_host)
        stores.add_ranges(seam, mem_pool_host)
        with seam.lock:
            stores.open_main(seam, raise_errors=True)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        if not self.registry.register(host_pool_name, host_pool):
            return  # the KV anchor is never a side pool (docs/sglang.md §4)
        self.registered_pools[host_pool_name] = host_pool
        stores.add_ranges(self._seam, host_pool)

    def on_host_pools_registered(self) -> None:
        log.info(
            "umbp_nvme: %s store %s ready; side pools: %s",
            "follower (read-only)" if self.is_mla_follower else "writer",
            self.store_dir,
            ", ".join(self.registry.names()) or "none",
        )

    # ------------------------------------------------------------------------- v1 (KV anchor)

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        try:
            keys = _key_list(keys)
            store = stores.main_store(self._seam)
            if store is None or not keys:
                return 0
            if not self.interface_v1:
                return store.exists_prefix_nowait([self.scheme.flat_key(h) for h in keys])
            sfx = self._seam.v1_sfx
            if len(sfx) == 1:
                s0 = sfx[0]
                return store.exists_prefix_nowait([h + s0 for h in keys])
            return store.exists_prefix_nowait([h + s for h in keys for s in sfx]) // len(sfx)
        except Exception as e:  # noqa: BLE001 - a hit query never kills the prefetch thread
            self._seam.log_once("batch_exists", "batch_exists failed: %r; reporting a miss", e)
            return 0

    def batch_get_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        return self._v1_batch("batch_get_v1", keys, host_indices, extra_info, is_set=False)

    def batch_set_v1(self, keys: List[str], host_indices, extra_info=None) -> List[bool]:
        return self._v1_batch("batch_set_v1", keys, host_indices, extra_info, is_set=True)

    def _v1_batch(self, op: str, keys, host_indices, extra_info, *, is_set: bool) -> List[bool]:
        """batch_get_v1 / batch_set_v1: timed I/O recorded in the stats; any failure is a list
        of False (misses for a get, failures for a set), never an exception."""
        n = 0
        try:
            keys = _key_list(keys)
            n = len(keys)
            if is_set and self.is_mla_follower:
                return [True] * (len(host_indices) // self.page_size if host_indices is not None else n)
            if self.kv_anchor_is_logical:
                return [True] * n
            t0 = time.perf_counter()
            results, nbytes = v1_io(self._seam, keys, host_indices, is_set=is_set,
                                                     extra_info=extra_info)  # fmt: skip
            self._record(is_set, results, nbytes, t0)
            return results
        except Exception as e:  # noqa: BLE001 - see module docstring
            what = "failures" if is_set else "misses"
            self._seam.log_once(op, "%s of %d pages failed: %r; reporting %s", op, n, e, what)
            return [False] * n

    # ------------------------------------------------------------------------- v2 (hybrid pools)

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        kv = len(keys) if self.kv_anchor_is_logical else self.batch_exists(keys, extra_info)
        current: dict = {}

        def component_keys(page_keys, transfer):
            pool = self.registry.get(transfer.name)  # raises "Unregistered UMBP hybrid pool: ..."
            ck, m = self.scheme.side_pool_keys(page_keys, transfer.name, pool)
            current["store"] = stores.store_for_pool(self._seam, transfer.name, pool, for_write=False)
            return ck, m

        def exists(component_keys_list):
            store = current.get("store")
            if store is None:
                return [False] * len(component_keys_list)
            return store.exists_many_nowait(component_keys_list)

        r = v2_hits(keys, kv, pool_transfers, exists, component_keys, kv_name=PoolName.KV)
        result = PoolTransferResult(r.kv_hit_pages, r.extra_pool_hit_pages)
        if hasattr(result, "restorable_prefix_pages"):
            result.restorable_prefix_pages = r.restorable_prefix_pages
        return result

    def batch_get_v2(self, transfers, extra_info=None) -> dict:
        return v2_io(self._seam, transfers, is_set=False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return v2_io(self._seam, transfers, is_set=True)

    # ------------------------------------------------------------------------- legacy (flat pages)

    def get(self, key, target_location=None, target_sizes=None):
        sizes = None if target_sizes is None else [target_sizes]
        return self.batch_get([key], [target_location], sizes)[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return legacy_batch_get(self._seam, keys, target_locations, target_sizes)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set(
            [key],
            None if value is None else [value],
            None if target_location is None else [target_location],
            None if target_sizes is None else [target_sizes],
        )

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return legacy_batch_set(self._seam, keys, values, target_locations, target_sizes)

    def exists(self, key) -> bool:
        store = stores.main_store(self._seam)
        if store is None:
            return False
        if not self.interface_v1:
            return store.exists_prefix_nowait([self.scheme.flat_key(key)]) == 1
        objkeys = [key + s for s in self._seam.v1_sfx]
        return store.exists_prefix_nowait(objkeys) == len(objkeys)

    # ------------------------------------------------------------------------- management

    def clear(self) -> None:
        stores.clear_stores(self._seam)

    def flush(self) -> bool:
        return stores.flush_stores(self._seam)

    def close(self) -> None:
        stores.close_stores(self._seam)

    def get_stats(self):
        """Pages and GB/s of each prefetch (batch_get_v1) and backup (batch_set_v1) since the last
        call, each batch once; with several drives, their rows too. SGLang calls this on its
        scheduler thread in every pass (docs/sglang.md §2): no lock, no hop onto the store's loop,
        no syscall, so it never waits on the store, a busy loop or a hung drive."""
        if self._metrics_cls is None:
            self._metrics_cls = storage_metrics_class()
        metrics = self._metrics_cls()
        batches = self._batches
        for _ in range(len(batches)):  # what is there now; later appends wait for the next call
            try:
                is_set, pages, gbps = batches.popleft()
            except IndexError:
                break
            if is_set:
                metrics.backup_pgs.append(pages)
                metrics.backup_bandwidth.append(gbps)
            else:
                metrics.prefetch_pgs.append(pages)
                metrics.prefetch_bandwidth.append(gbps)
        drives = stores.drive_rows(self._seam)
        if drives:  # several drives: each one's state, objects, bytes, GB/s, errors
            try:
                metrics.drives = drives
            except AttributeError:  # a StorageMetrics with __slots__ takes only its own fields
                pass
        return metrics

    def store_stats(self) -> dict:
        """The underlying store's counters (objects, bytes, hits, evictions, ...)."""
        return stores.store_stats(self._seam)

    # ------------------------------------------------------------------------- internals

    @property
    def store(self):
        """This rank's SyncPageStore (the shared one, read-only, on an MLA follower); None until opened."""
        return self._seam.main

    def _record(self, is_set: bool, results: list, nbytes: int, t0: float) -> None:
        if not results:
            return
        dt = time.perf_counter() - t0
        self._batches.append((is_set, sum(1 for r in results if r), nbytes / dt / 1e9 if dt > 0 else 0.0))


# ---------------------------------------------------------------------------------------------


def _key_list(keys) -> list:
    """The keys of a call as a sized sequence: a list or tuple as given, any other iterable read
    once (a generator); None is no keys. Raises TypeError for a non-iterable (the caller's
    never-raise wrapper answers no pages)."""
    if keys is None:
        return []
    if isinstance(keys, (list, tuple)):
        return keys
    return list(keys)


def _switch(value, key: str) -> bool:
    """One of the backend's own boolean settings, parsed like every other (config.parse_bool)."""
    return parse_bool(value, f"extra_config[{key!r}]")


_METRICS_CLS: list = []  # the StorageMetrics class, found once per process


def storage_metrics_class():
    """SGLang's StorageMetrics when SGLang imports (its collector asserts that class), else the
    stand-in's; imported once per process."""
    if not _METRICS_CLS:
        cls = None
        if HAVE_SGLANG:
            try:
                from sglang.srt.observability.metrics_collector import StorageMetrics as cls  # type: ignore[import-not-found]
            except Exception:  # noqa: BLE001 - any failure inside sglang's import: the stand-in's
                cls = None
        if cls is None:
            from ._hicache_standin import StorageMetrics as cls
        _METRICS_CLS.append(cls)
    return _METRICS_CLS[0]
