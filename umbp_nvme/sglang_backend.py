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
- Legacy (non ``interface_v1``) calls store whole flat pages under their own ``flat_`` keys, so
  they can never be confused with v1 per-component objects.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import List, Optional

from .config import StoreConfig, load_config, parse_bool
from .hits import v2_hits
from . import kv_events, sglang_stores, sglang_transfers
from .keys import KeyScheme, PoolRegistry, is_mla_follower, rank_subdir
from .sglang_stores import NAMESPACE_KIND
from .sglang_stores import FOLLOWER_RETRY_S as _FOLLOWER_RETRY_S  # noqa: F401 - kept for callers
from .sglang_stores import MANIFEST as _MANIFEST  # noqa: F401 - kept for callers
from .sglang_stores import normalise_sizes as _normalise_sizes  # noqa: F401 - kept for callers
from .sglang_stores import pool_ranges as _pool_ranges  # noqa: F401 - kept for callers
from .sglang_transfers import FLAT_KEY_PREFIX
from .store.placement import page_of
from .sglang_transfers import fold as _fold  # noqa: F401 - kept for callers
from .sglang_transfers import legacy_buffer as _legacy_buffer  # noqa: F401 - kept for callers

log = logging.getLogger(__name__)

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
_METRICS_MAX = 4096  # entries kept per metrics list between two get_stats() calls


class UMBPNvmeStore(HiCacheStorage):
    """HiCacheStorage on local NVMe. See the module docstring for the rules it keeps."""

    def __init__(self, storage_config=None, mem_pool_host=None, *, engine_factory=None, **kwargs):
        # engine_factory: PageStore.open's hook (tests and fault injection wrap the engines there)
        self._engine_factory = engine_factory
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
        self._doctor_at_start = _switch(extra.pop("doctor_at_start", False), "doctor_at_start")
        self._events_cfg = kv_events.pop_config(extra, storage_config)  # None: no DISK events (default)
        self._publisher = None  # kv_events.Publisher once this rank's store is open
        self._residency = None  # kv_residency.Residency hooked into that store
        self.config: StoreConfig = load_config(extra, known=("prometheus", "doctor_at_start", *kv_events.KEYS))
        self.interface_v1 = _switch(extra.get("interface_v1", 0), "interface_v1")
        self.scheme = KeyScheme.from_storage_config(storage_config)
        self.is_mla = self.scheme.is_mla
        self.is_mla_follower = is_mla_follower(storage_config)
        self.enable_storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.model_name = getattr(storage_config, "model_name", None) or ""
        self._prometheus = self.enable_storage_metrics if prometheus is None else _switch(prometheus, "prometheus")
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
        self._page_of = functools.partial(page_of, config_prefix=self.scheme.config_prefix)

        self.registry = PoolRegistry()
        self.registered_pools: dict = {}  # HiCacheStorage's attribute, kept for callers that read it
        self.mem_pool_host = None
        self.page_size = 1
        self.kv_anchor_is_logical = False
        self._envelope = False
        self._v1_sfx: tuple[str, ...] = self.scheme.v1_suffixes()
        self._flat_sfx = f"_{self.scheme.mla_suffix}" if self.is_mla else f"_{self.scheme.rank_suffix}"
        self._namespace: Optional[dict] = None

        self._lock = threading.RLock()
        self._store = None  # SyncPageStore: this rank's store, or the shared one (read-only on a follower)
        self._private = None  # SyncPageStore: a follower's own TP-sharded side-pool state
        self._next_follower_try = 0.0
        self._ranges: list[tuple[int, int]] = []
        self._closed = False
        self._logged: set[str] = set()
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: deque = deque(maxlen=_METRICS_MAX)
        self._backup_pgs: deque = deque(maxlen=_METRICS_MAX)
        self._prefetch_bw: deque = deque(maxlen=_METRICS_MAX)
        self._backup_bw: deque = deque(maxlen=_METRICS_MAX)
        if not self.config.ssd_enabled:
            log.warning("umbp_nvme: ssd_enabled is false; this backend stores nothing and every lookup misses")
        if mem_pool_host is not None and hasattr(mem_pool_host, "layout"):
            self.register_mem_pool_host(mem_pool_host)

    # ------------------------------------------------------------------------- registration

    def register_mem_pool_host(self, mem_pool_host) -> None:
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(f"{LAYOUT_ERROR}; got layout={layout!r}")
        self.mem_pool_host = mem_pool_host
        self.page_size = int(getattr(mem_pool_host, "page_size", 1) or 1)
        self.kv_anchor_is_logical = getattr(mem_pool_host, "kv_buffer", None) is None
        self._envelope = bool(getattr(mem_pool_host, "stores_page_envelope", False))
        self._v1_sfx = self.scheme.v1_suffixes(envelope=self._envelope)
        self._namespace = self._make_namespace(mem_pool_host)
        self._add_ranges(mem_pool_host)
        with self._lock:
            self._open_main(raise_errors=True)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        if not self.registry.register(host_pool_name, host_pool):
            return  # the KV anchor is never a side pool (docs/sglang.md §4)
        self.registered_pools[host_pool_name] = host_pool
        self._add_ranges(host_pool)

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
            store = self._main()
            if store is None or not keys:
                return 0
            if not self.interface_v1:
                return store.exists_prefix_nowait([f"{FLAT_KEY_PREFIX}{h}{self._flat_sfx}" for h in keys])
            sfx = self._v1_sfx
            if len(sfx) == 1:
                s0 = sfx[0]
                return store.exists_prefix_nowait([h + s0 for h in keys])
            return store.exists_prefix_nowait([h + s for h in keys for s in sfx]) // len(sfx)
        except Exception as e:  # noqa: BLE001 - a hit query never kills the prefetch thread
            self._log_once("batch_exists", "batch_exists failed: %r; reporting a miss", e)
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
            results, nbytes = self._v1_io(keys, host_indices, is_set=is_set, extra_info=extra_info)
            if is_set:
                self._record(self._backup_pgs, self._backup_bw, results, nbytes, t0)
            else:
                self._record(self._prefetch_pgs, self._prefetch_bw, results, nbytes, t0)
            return results
        except Exception as e:  # noqa: BLE001 - see module docstring
            what = "failures" if is_set else "misses"
            self._log_once(op, "%s of %d pages failed: %r; reporting %s", op, n, e, what)
            return [False] * n

    def _v1_io(self, keys, host_indices, *, is_set: bool, extra_info) -> tuple[list[bool], int]:
        return sglang_transfers.v1_io(self, keys, host_indices, is_set=is_set, extra_info=extra_info)

    # ------------------------------------------------------------------------- v2 (hybrid pools)

    def batch_exists_v2(self, keys: List[str], pool_transfers=None, extra_info=None):
        kv = len(keys) if self.kv_anchor_is_logical else self.batch_exists(keys, extra_info)
        current: dict = {}

        def component_keys(page_keys, transfer):
            pool = self.registry.get(transfer.name)  # raises "Unregistered UMBP hybrid pool: ..."
            ck, m = self.scheme.side_pool_keys(page_keys, transfer.name, pool)
            current["store"] = self._store_for_pool(transfer.name, pool, for_write=False)
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
        return self._batch_io_v2(transfers, is_set=False)

    def batch_set_v2(self, transfers, extra_info=None) -> dict:
        return self._batch_io_v2(transfers, is_set=True)

    def _batch_io_v2(self, transfers, *, is_set: bool) -> dict:
        return sglang_transfers.v2_io(self, transfers, is_set=is_set)

    # ------------------------------------------------------------------------- legacy (flat pages)

    def _flat_key(self, key: str) -> str:
        return sglang_transfers.flat_key(self, key)

    def get(self, key, target_location=None, target_sizes=None):
        sizes = None if target_sizes is None else [target_sizes]
        return self.batch_get([key], [target_location], sizes)[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return sglang_transfers.legacy_batch_get(self, keys, target_locations, target_sizes)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set(
            [key],
            None if value is None else [value],
            None if target_location is None else [target_location],
            None if target_sizes is None else [target_sizes],
        )

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return sglang_transfers.legacy_batch_set(self, keys, values, target_locations, target_sizes)

    def exists(self, key) -> bool:
        store = self._main()
        if store is None:
            return False
        if not self.interface_v1:
            return store.exists_prefix_nowait([self._flat_key(key)]) == 1
        objkeys = [key + s for s in self._v1_sfx]
        return store.exists_prefix_nowait(objkeys) == len(objkeys)

    # ------------------------------------------------------------------------- management

    def clear(self) -> None:
        sglang_stores.clear_stores(self)

    def flush(self) -> bool:
        return sglang_stores.flush_stores(self)

    def close(self) -> None:
        sglang_stores.close_stores(self)

    def get_stats(self):
        """Pages and GB/s of each prefetch (batch_get_v1) and backup (batch_set_v1) since the last call."""
        metrics = _storage_metrics()
        with self._metrics_lock:
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_bw)
            metrics.backup_bandwidth.extend(self._backup_bw)
            for d in (self._prefetch_pgs, self._backup_pgs, self._prefetch_bw, self._backup_bw):
                d.clear()
        drives = sglang_stores.drive_rows(self)
        if drives:  # several drives: each one's state, objects, bytes, GB/s, errors
            try:
                metrics.drives = drives
            except AttributeError:  # a StorageMetrics with __slots__ takes only its own fields
                pass
        return metrics

    def store_stats(self) -> dict:
        """The underlying store's counters (objects, bytes, hits, evictions, ...)."""
        return sglang_stores.store_stats(self)

    # ------------------------------------------------------------------------- internals

    def _make_namespace(self, pool) -> dict:
        """What the objects in this store mean: a directory made for another one is refused."""
        return sglang_stores.make_namespace(self, pool)

    @property
    def store(self):
        """This rank's SyncPageStore (the shared one, read-only, on an MLA follower); None until opened."""
        return self._store

    def _open_main(self, *, raise_errors: bool):
        """Open this rank's store if it is not open; None while a follower waits for its leader."""
        return sglang_stores.open_main(self, raise_errors=raise_errors)

    def _main(self):
        return sglang_stores.main_store(self)

    def _store_for_pool(self, name, pool, *, for_write: bool):
        """The store that holds this side pool on this rank; "skip" for a follower's shared pools."""
        return sglang_stores.store_for_pool(self, name, pool, for_write=for_write)

    def _add_ranges(self, pool) -> None:
        sglang_stores.add_ranges(self, pool)

    @staticmethod
    def _register_ranges(store, ranges) -> None:
        sglang_stores.register_ranges(store, ranges)

    def _record(self, pgs: deque, bws: deque, results: list, nbytes: int, t0: float) -> None:
        if not results:
            return
        dt = time.perf_counter() - t0
        with self._metrics_lock:
            pgs.append(sum(1 for r in results if r))
            bws.append(nbytes / dt / 1e9 if dt > 0 else 0.0)

    def _watch(self, store, role: str) -> None:
        """Export the store's metrics (and log a doctor report) when asked; never fails an open."""
        sglang_stores.watch(self, store, role)

    def _log_once(self, kind: str, msg: str, *args, level: int = logging.ERROR) -> None:
        if kind in self._logged:
            log.debug("umbp_nvme: " + msg, *args)
            return
        self._logged.add(kind)
        log.log(level, "umbp_nvme: " + msg + " (logged once)", *args)


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


def _storage_metrics():
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics  # type: ignore[import-not-found]

        if HAVE_SGLANG:
            return StorageMetrics()
    except Exception:  # noqa: BLE001
        pass
    from ._hicache_standin import StorageMetrics

    return StorageMetrics()
