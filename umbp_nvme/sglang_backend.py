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

import logging
import os
import threading
import time
from collections import deque
from typing import Any, List, Optional, Sequence

from .buffers import address_of
from .config import StoreConfig, load_config
from .errors import NamespaceMismatchError, StoreDamagedError, StoreError
from .hits import v2_hits
from .keys import KeyScheme, PoolRegistry, is_mla_follower, pool_name_str, rank_subdir

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
FLAT_KEY_PREFIX = "flat_"  # legacy whole-page objects; v1 keys start with a 64-hex page hash
NAMESPACE_KIND = "umbp_nvme.sglang/1"
_FOLLOWER_RETRY_S = 0.05  # a follower retries a failed open of the leader's store at most this often
_MANIFEST = "MANIFEST.json"  # PageStore's; a follower opens the leader's store once it exists
_METRICS_MAX = 4096  # entries kept per metrics list between two get_stats() calls


class UMBPNvmeStore(HiCacheStorage):
    """HiCacheStorage on local NVMe. See the module docstring for the rules it keeps."""

    def __init__(self, storage_config=None, mem_pool_host=None, *, engine_factory=None, **kwargs):
        # engine_factory: PageStore.open's hook (tests and fault injection wrap the engines there)
        self._engine_factory = engine_factory
        # The dynamic loader passes its kwargs dict as the second positional argument; only a
        # real host pool (something with a layout) is registered here, as UMBP's own form does.
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        # our own switches (not StoreConfig fields): Prometheus export and a doctor report at open
        prometheus = extra.pop("prometheus", None)
        self._doctor_at_start = _truthy(extra.pop("doctor_at_start", False))
        self.config: StoreConfig = load_config(extra)
        self.interface_v1 = _truthy(extra.get("interface_v1", 0))
        self.scheme = KeyScheme.from_storage_config(storage_config)
        self.is_mla = self.scheme.is_mla
        self.is_mla_follower = is_mla_follower(storage_config)
        self.enable_storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self.model_name = getattr(storage_config, "model_name", None) or ""
        self._prometheus = self.enable_storage_metrics if prometheus is None else _truthy(prometheus)
        self.root_dir = os.path.abspath(self.config.ssd_storage_dir)
        sub = rank_subdir(storage_config)
        cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
        if cp_size > 1:
            # Attention-CP ranks hold disjoint slices of each page under the same key: one
            # directory (one writer) each.
            sub = "_".join(p for p in (sub, f"cp{int(getattr(storage_config, 'attn_cp_rank', 0) or 0)}") if p)
        self.store_dir = os.path.join(self.root_dir, sub) if sub else self.root_dir
        tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        self.private_dir = os.path.join(self.root_dir, "_".join(p for p in (sub, f"tp{tp_rank}_sidecar") if p))

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
        n = len(keys) if keys is not None else 0
        try:
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
        n = len(keys)
        if n == 0:
            return [], 0
        pool = self.mem_pool_host
        if pool is None:
            self._log_once("v1_unregistered", "batch I/O before register_mem_pool_host; reporting misses")
            return [False] * n, 0
        if host_indices is None or len(host_indices) // self.page_size != n:
            self._log_once(
                "v1_count",
                "batch_%s_v1 got %d keys for %s host indices with page_size=%d; reporting misses",
                "set" if is_set else "get",
                n,
                None if host_indices is None else len(host_indices),
                self.page_size,
            )
            return [False] * n, 0
        store = self._main()
        if store is None:
            return [False] * n, 0
        if self.scheme.split_factor and not self._envelope:
            ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices, self.scheme.split_factor)
        else:
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        sizes = _normalise_sizes(sizes, len(ptrs))
        sfx = self._v1_sfx
        m = len(sfx)
        objkeys = [h + s for h in keys for s in sfx]
        if len(objkeys) != len(ptrs) or len(sizes) != len(ptrs):
            self._log_once(
                "v1_meta",
                "host pool gave %d pointers and %d sizes for %d objects (%d pages x %d); reporting misses",
                len(ptrs),
                len(sizes),
                len(objkeys),
                n,
                m,
            )
            return [False] * n, 0
        bufs = list(zip(ptrs, sizes))
        if is_set:
            depths = None
            prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
            if prefix is not None:
                base = len(prefix)
                depths = [base + i for i in range(n) for _ in range(m)]
            res = store.put_many(objkeys, bufs, depths=depths)
        else:
            res = store.get_many(objkeys, bufs)
        if len(res) != len(objkeys):
            self._log_once("v1_result", "store returned %d results for %d objects; reporting misses", len(res), len(objkeys))
            return [False] * n, 0
        pages = _fold(res, m, n)
        nbytes = sum(int(s) for s, ok in zip(sizes, res) if ok)
        return pages, nbytes

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
        results: dict = {}
        # store id -> (store, object keys, buffers, [(transfer name, first object, pages, m)])
        batches: dict[int, tuple[Any, list, list, list]] = {}
        for t in transfers or ():
            name = t.name
            pool = self.registry.get(name)  # raises "Unregistered UMBP hybrid pool: ..." (docs/sglang.md §6)
            keys = list(t.keys or [])
            if not keys or t.host_indices is None:
                results[name] = [False] * len(keys)
                continue
            ps = int(getattr(pool, "page_size", 1) or 1)
            if len(keys) != len(t.host_indices) // ps:
                raise ValueError(
                    f"UMBP v2 pool {pool_name_str(name)} has {len(keys)} keys for "
                    f"{len(t.host_indices)} indices with page_size={ps}."
                )
            ck, m = self.scheme.side_pool_keys(keys, name, pool)
            ptrs, sizes = pool.get_page_buffer_meta(t.host_indices)
            if not (len(ck) == len(ptrs) == len(sizes)):
                raise ValueError(
                    f"UMBP v2 buffer-meta mismatch for pool {pool_name_str(name)}: keys={len(ck)} "
                    f"ptrs={len(ptrs)} sizes={len(sizes)}"
                )
            store = self._store_for_pool(name, pool, for_write=is_set)
            if store is None:
                results[name] = [False] * len(keys)
                continue
            if store == "skip":  # a follower never writes the leader's shared pools
                results[name] = [True] * len(keys)
                continue
            batch = batches.setdefault(id(store), (store, [], [], []))
            batch[3].append((name, len(batch[1]), len(keys), m))
            batch[1].extend(ck)
            batch[2].extend(zip(ptrs, sizes))
        for store, objkeys, bufs, parts in batches.values():
            try:
                res = store.put_many(objkeys, bufs) if is_set else store.get_many(objkeys, bufs)
            except Exception as e:  # noqa: BLE001 - I/O failures are misses, not errors
                self._log_once("v2_io", "batch_%s_v2 store call failed: %r", "set" if is_set else "get", e)
                res = []
            for name, start, pages, m in parts:
                if len(res) != len(objkeys):
                    log.error(
                        "umbp_nvme: v2 %s for pool %s returned %d results for %d objects; reporting misses",
                        "set" if is_set else "get",
                        pool_name_str(name),
                        len(res),
                        len(objkeys),
                    )
                    results[name] = [False] * pages
                else:
                    results[name] = _fold(res[start : start + pages * m], m, pages)
        return results

    # ------------------------------------------------------------------------- legacy (flat pages)

    def _flat_key(self, key: str) -> str:
        return f"{FLAT_KEY_PREFIX}{key}{self._flat_sfx}"

    def get(self, key, target_location=None, target_sizes=None):
        sizes = None if target_sizes is None else [target_sizes]
        return self.batch_get([key], [target_location], sizes)[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        n = len(keys)
        if target_locations is None:
            return [None] * n
        try:
            store = self._main()
            if store is None or n == 0:
                return [None] * n
            bufs = [_legacy_buffer(loc, None if target_sizes is None else target_sizes[i]) for i, loc in enumerate(target_locations)]
            ok_idx = [i for i, b in enumerate(bufs) if b is not None]
            res = store.get_many([self._flat_key(keys[i]) for i in ok_idx], [bufs[i] for i in ok_idx])
            out: list = [None] * n
            for i, ok in zip(ok_idx, res):
                if ok:
                    out[i] = target_locations[i]
            return out
        except Exception as e:  # noqa: BLE001 - the legacy prefetch path must not die either
            self._log_once("batch_get", "batch_get of %d pages failed: %r", n, e)
            return [None] * n

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set(
            [key],
            None if value is None else [value],
            None if target_location is None else [target_location],
            None if target_sizes is None else [target_sizes],
        )

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        if not keys:
            return False
        if self.is_mla_follower:
            return True
        try:
            store = self._main()
            if store is None:
                return False
            bufs = []
            for i in range(len(keys)):
                if values is not None:
                    buf = _legacy_buffer(values[i], None, writable=False)
                elif target_locations is not None:
                    buf = _legacy_buffer(target_locations[i], None if target_sizes is None else target_sizes[i])
                else:
                    buf = None
                if buf is None:
                    return False
                bufs.append(buf)
            return all(store.put_many([self._flat_key(k) for k in keys], bufs))
        except Exception as e:  # noqa: BLE001
            self._log_once("batch_set", "batch_set of %d pages failed: %r", len(keys), e)
            return False

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
        for store in (self._store, self._private):
            if store is None:
                continue
            if store.readonly:
                log.info("umbp_nvme: %s is the leader's store (read-only here); clear() leaves it", store.path)
                continue
            try:
                store.clear()
            except Exception as e:  # noqa: BLE001
                log.error("umbp_nvme: clearing %s failed: %s", store.path, e)

    def flush(self) -> bool:
        ok = True
        for store in (self._store, self._private):
            if store is not None and not store.readonly:
                ok = bool(store.flush()) and ok
        return ok

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stores, self._store, self._private = (self._store, self._private), None, None
        for store in stores:
            if store is None:
                continue
            if getattr(store, "metrics", None) is not None:
                store.metrics.owner.unwatch(store)
            try:
                if not store.readonly:
                    store.flush()
            except Exception as e:  # noqa: BLE001
                log.warning("umbp_nvme: flush of %s at close failed: %s", store.path, e)
            try:
                store.close()
            except Exception as e:  # noqa: BLE001
                log.warning("umbp_nvme: closing %s failed: %s", store.path, e)

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
        return metrics

    def store_stats(self) -> dict:
        """The underlying store's counters (objects, bytes, hits, evictions, ...)."""
        out = {}
        for label, store in (("store", self._store), ("private", self._private)):
            if store is not None:
                try:
                    out[label] = store.stats()
                except Exception as e:  # noqa: BLE001
                    out[label] = {"error": repr(e)}
        return out

    # ------------------------------------------------------------------------- internals

    def _make_namespace(self, pool) -> dict:
        """What the objects in this store mean: a directory made for another one is refused."""
        kv_bytes = None
        if getattr(pool, "kv_buffer", None) is not None:
            try:
                import torch  # the host pool is torch-based whenever it has a kv_buffer

                idx = torch.arange(self.page_size, dtype=torch.int64)
                if self.scheme.split_factor and not self._envelope:
                    _, sizes = pool.get_split_heads_page_buffer_meta(idx, self.scheme.split_factor)
                else:
                    _, sizes = pool.get_page_buffer_meta(idx)
                kv_bytes = [int(s) for s in _normalise_sizes(sizes, len(self._v1_sfx))]
            except Exception as e:  # noqa: BLE001 - a pool without meta still gets a namespace
                log.debug("umbp_nvme: could not size KV objects for the namespace: %r", e)
        return {
            "kind": NAMESPACE_KIND,
            "model": self.model_name,
            "layout": getattr(pool, "layout", None),
            "dtype": str(getattr(pool, "dtype", None)),
            "page_size": self.page_size,
            "kv_object_bytes": kv_bytes,
            "kv_objects_per_page": len(self._v1_sfx),
            "interface": "v1" if self.interface_v1 else "flat",
        }

    def _log_leader_not_ready(self) -> None:
        self._log_once(
            "follower_wait",
            "follower: the leader has not created %s yet; reporting misses until it does",
            self.store_dir,
            level=logging.INFO,
        )

    @property
    def store(self):
        """This rank's SyncPageStore (the shared one, read-only, on an MLA follower); None until opened."""
        return self._store

    def _open_main(self, *, raise_errors: bool):
        """Open this rank's store if it is not open; None while a follower waits for its leader."""
        if self._store is not None or self._closed or not self.config.ssd_enabled or self._namespace is None:
            return self._store
        from .store.sync import SyncPageStore

        if self.is_mla_follower:
            # Until the leader has created the store, a lookup costs one stat() and misses.
            if not os.path.exists(os.path.join(self.store_dir, _MANIFEST)):
                self._log_leader_not_ready()
                return None
            now = time.monotonic()
            if now < self._next_follower_try and not raise_errors:
                return None
            self._next_follower_try = now + _FOLLOWER_RETRY_S
            try:
                store = SyncPageStore(
                    self.store_dir, self.config, readonly=True, namespace=self._namespace,
                    engine_factory=self._engine_factory,
                )  # fmt: skip
            except StoreDamagedError as e:
                # the leader (the writer) moves damaged metadata aside at its open: miss until then
                self._log_once("follower_damaged", "follower: %s; reporting misses until the leader repairs it", e)
                return None
            except FileNotFoundError:
                self._log_leader_not_ready()
                return None
            except (NamespaceMismatchError, StoreError):
                if raise_errors:
                    raise
                return None
        else:
            store = SyncPageStore(
                self.store_dir, self.config, readonly=False, namespace=self._namespace,
                engine_factory=self._engine_factory,
            )  # fmt: skip
        self._register_ranges(store, self._ranges)
        self._watch(store, "main")
        self._store = store
        return store

    def _main(self):
        store = self._store
        if store is not None:
            return store
        if self._closed:  # every call answers False / 0 without opening anything again
            self._log_once("closed", "called after close(); answering False / 0", level=logging.WARNING)
            return None
        with self._lock:
            try:
                return self._open_main(raise_errors=False)
            except Exception as e:  # noqa: BLE001 - lookups degrade to misses
                self._log_once("open", "opening %s failed: %r; reporting misses", self.store_dir, e)
                return None

    def _store_for_pool(self, name, pool, *, for_write: bool):
        """The store that holds this side pool on this rank; "skip" for a follower's shared pools."""
        if not self.is_mla_follower:
            return self._main()
        own = f"_{self.scheme.rank_suffix}_"
        if not any(s.startswith(own) for s in self.scheme.side_pool_suffixes(name, pool)):
            return "skip" if for_write else self._main()  # rank-replicated: the leader writes it
        if self._private is None:
            with self._lock:
                if self._private is None and not self._closed:
                    from .store.sync import SyncPageStore

                    ns = dict(self._namespace or {}, kind=NAMESPACE_KIND + "/sidecar")
                    store = SyncPageStore(
                        self.private_dir, self.config, readonly=False, namespace=ns, engine_factory=self._engine_factory
                    )  # fmt: skip
                    self._register_ranges(store, self._ranges)
                    self._watch(store, "sidecar")
                    self._private = store
        return self._private

    def _add_ranges(self, pool) -> None:
        new = [r for r in _pool_ranges(pool) if r not in self._ranges]
        if not new:
            return
        with self._lock:
            self._ranges.extend(new)
            for store in (self._store, self._private):
                if store is not None:
                    self._register_ranges(store, new)

    @staticmethod
    def _register_ranges(store, ranges) -> None:
        for addr, nbytes in ranges:
            store.register_memory(addr, nbytes)

    def _record(self, pgs: deque, bws: deque, results: list, nbytes: int, t0: float) -> None:
        if not results:
            return
        dt = time.perf_counter() - t0
        with self._metrics_lock:
            pgs.append(sum(1 for r in results if r))
            bws.append(nbytes / dt / 1e9 if dt > 0 else 0.0)

    def _watch(self, store, role: str) -> None:
        """Export the store's metrics (and log a doctor report) when asked; never fails an open."""
        if self._doctor_at_start and role == "main":
            try:
                from .doctor import log_report

                log_report(store.path, self.config, ranges=list(self._ranges))
            except Exception as e:  # noqa: BLE001
                log.warning("umbp_nvme: doctor at start failed: %r", e)
        if not self._prometheus:
            return
        try:
            from . import metrics

            m = metrics.default()
            if m is not None:
                m.watch(store, metrics.labels_from_storage_config(self.storage_config, role))
        except Exception as e:  # noqa: BLE001 - metrics never take the backend down
            self._log_once("metrics", "metrics for %s not exported: %r", store.path, e, level=logging.WARNING)

    def _log_once(self, kind: str, msg: str, *args, level: int = logging.ERROR) -> None:
        if kind in self._logged:
            log.debug("umbp_nvme: " + msg, *args)
            return
        self._logged.add(kind)
        log.log(level, "umbp_nvme: " + msg + " (logged once)", *args)


# ---------------------------------------------------------------------------------------------


def _truthy(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _normalise_sizes(sizes, n: int) -> list:
    """UMBP v1 accepts an int or a one-element list for every object (docs/sglang.md §3)."""
    if isinstance(sizes, int):
        return [sizes] * n
    sizes = list(sizes)
    if len(sizes) == 1 and n > 1:
        return sizes * n
    return sizes


def _fold(res: Sequence[bool], m: int, pages: int) -> list[bool]:
    """Per-object results -> per-page: a page is there only when all m of its objects are."""
    if m == 1:
        return [bool(r) for r in res[:pages]]
    if m == 2:
        return [bool(a and b) for a, b in zip(res[0::2], res[1::2])]
    return [all(res[i * m : (i + 1) * m]) for i in range(pages)]


def _pool_ranges(pool) -> list[tuple[int, int]]:
    """(address, nbytes) of every non-empty host tensor of a pool, deduplicated by address."""
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    bufs: Any = None
    if callable(getter):
        try:
            bufs = getter()
        except Exception:  # noqa: BLE001 - e.g. a logical anchor
            bufs = None
    if bufs is None:
        bufs = getattr(pool, "kv_buffer", None)
    out: list[tuple[int, int]] = []
    seen = set()

    def walk(b):
        if b is None:
            return
        if isinstance(b, (list, tuple)):
            for x in b:
                walk(x)
            return
        if hasattr(b, "data_ptr") and hasattr(b, "numel"):  # torch tensor (views included)
            addr, nbytes = int(b.data_ptr()), int(b.numel()) * int(b.element_size())
        else:
            try:  # numpy arrays, memoryviews, mmaps, ...
                addr, nbytes = address_of(b, writable=False)
            except TypeError:
                return
        if nbytes > 0 and addr and addr not in seen:
            seen.add(addr)
            out.append((addr, nbytes))

    walk(bufs)
    # A pool may expose its state buffers beside the KV ones (Mamba: temporal + conv).
    for attr in ("temporal_buffer", "conv_buffer"):
        walk(getattr(pool, attr, None))
    return out


def _legacy_buffer(loc, size, *, writable: bool = True):
    """A legacy target: a CPU tensor (SGLang's flat page) or a raw pointer with a size (UMBP)."""
    if loc is None:
        return None
    if isinstance(loc, int):
        if size is None:
            return None
        size = int(size if not isinstance(size, (list, tuple)) else size[0])
        # An (address, nbytes) pair, so the store's registered-range check applies: a raw
        # pointer outside the registered host pool is refused, never written through.
        return (int(loc), size)
    if hasattr(loc, "is_contiguous") and not loc.is_contiguous():
        if writable:
            return None  # reading into a copy would lose the bytes
        loc = loc.contiguous()
    return loc


def _storage_metrics():
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics  # type: ignore[import-not-found]

        if HAVE_SGLANG:
            return StorageMetrics()
    except Exception:  # noqa: BLE001
        pass
    from ._hicache_standin import StorageMetrics

    return StorageMetrics()
