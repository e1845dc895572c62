"""Opening and closing the stores behind ``sglang_backend.UMBPNvmeStore``.

A backend holds up to two ``SyncPageStore``s (docs/sglang.md §1): ``be._store``, this rank's own
directory (or, on an MLA follower, the leader's shared directory opened read-only, retried at most
every ``FOLLOWER_RETRY_S`` until the leader has created it), and ``be._private``, a follower's own
sidecar store for TP-sharded side-pool state. The functions here take the backend and keep all
state on it, so the backend's attributes stay what SGLang and the tests read; they call one
another through the backend's methods (``be._open_main``, ``be._watch``, ...), as before the split.

Also here: the namespace a store directory is opened with, the host ranges registered with every
store, and the metrics / doctor hooks run when a store opens.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .buffers import address_of
from .errors import NamespaceMismatchError, StoreDamagedError, StoreError
from .fs_room import warn_if_short
from .store.layout import MANIFEST_FILE as MANIFEST  # a follower opens the leader's store once it exists

log = logging.getLogger("umbp_nvme.sglang_backend")

NAMESPACE_KIND = "umbp_nvme.sglang/1"
FOLLOWER_RETRY_S = 0.05  # a follower retries a failed open of the leader's store at most this often


def normalise_sizes(sizes, n: int) -> list:
    """UMBP v1 accepts an int or a one-element list for every object (docs/sglang.md §3)."""
    if isinstance(sizes, int):
        return [sizes] * n
    sizes = list(sizes)
    if len(sizes) == 1 and n > 1:
        return sizes * n
    return sizes


def make_namespace(be, pool) -> dict:
    """What the objects in this store mean: a directory made for another one is refused."""
    kv_bytes = None
    if getattr(pool, "kv_buffer", None) is not None:
        try:
            import torch  # the host pool is torch-based whenever it has a kv_buffer

            idx = torch.arange(be.page_size, dtype=torch.int64)
            if be.scheme.split_factor and not be._envelope:
                _, sizes = pool.get_split_heads_page_buffer_meta(idx, be.scheme.split_factor)
            else:
                _, sizes = pool.get_page_buffer_meta(idx)
            kv_bytes = [int(s) for s in normalise_sizes(sizes, len(be._v1_sfx))]
        except Exception as e:  # noqa: BLE001 - a pool without meta still gets a namespace
            log.debug("umbp_nvme: could not size KV objects for the namespace: %r", e)
    return {
        "kind": NAMESPACE_KIND,
        "model": be.model_name,
        "layout": getattr(pool, "layout", None),
        "dtype": str(getattr(pool, "dtype", None)),
        "page_size": be.page_size,
        "kv_object_bytes": kv_bytes,
        "kv_objects_per_page": len(be._v1_sfx),
        "interface": "v1" if be.interface_v1 else "flat",
    }


def _paths(dirs: list[str]):
    """One directory as a path (today's single-drive store), several as a list (one per drive)."""
    return dirs[0] if len(dirs) == 1 else list(dirs)


def _log_leader_not_ready(be) -> None:
    be._log_once(
        "follower_wait",
        "follower: the leader has not created %s yet; reporting misses until it does",
        be.store_dir,
        level=logging.INFO,
    )


def open_main(be, *, raise_errors: bool):
    """Open the backend's store if it is not open; None while a follower waits for its leader."""
    if be._store is not None or be._closed or not be.config.ssd_enabled or be._namespace is None:
        return be._store
    from .store.sync import SyncPageStore

    if be.is_mla_follower:
        # Until the leader has created the store, a lookup costs one stat() and misses. One drive
        # with the leader's store is enough: a drive the leader holds out (unmounted, mounts.py)
        # or has not created yet is a degraded drive here, opened by the probe once it has a store.
        if not any(os.path.exists(os.path.join(d, MANIFEST)) for d in be.store_dirs):
            _log_leader_not_ready(be)
            return None
        now = time.monotonic()
        if now < be._next_follower_try and not raise_errors:
            return None
        be._next_follower_try = now + FOLLOWER_RETRY_S
        try:
            store = SyncPageStore(
                _paths(be.store_dirs), be.config, readonly=True, namespace=be._namespace,
                engine_factory=be._engine_factory, page_of=be._page_of,
            )  # fmt: skip
        except StoreDamagedError as e:
            # the leader (the writer) moves damaged metadata aside at its open: miss until then
            be._log_once("follower_damaged", "follower: %s; reporting misses until the leader repairs it", e)
            return None
        except FileNotFoundError:
            _log_leader_not_ready(be)
            return None
        except (NamespaceMismatchError, StoreError):
            if raise_errors:
                raise
            return None
    else:
        warn_if_short(be.store_dirs, be.config.ssd_capacity_bytes)  # the server's capacity, before it opens
        store = SyncPageStore(
            _paths(be.store_dirs), backup_config(be.config), readonly=False, namespace=be._namespace,
            engine_factory=be._engine_factory, page_of=be._page_of,
        )  # fmt: skip
    be._register_ranges(store, be._ranges)
    be._watch(store, "main")
    be._store = store
    if not be.is_mla_follower:
        start_events(be, store)
    return store


def publishes_events(storage_config) -> bool:
    """One publisher per KV cache, as SGLang gates its own (pp, attention-TP and attention-CP rank
    0): that rank's store stands for the page on disk (docs/fleet.md, "MHA with TP > 1")."""
    return all(int(getattr(storage_config, a, 0) or 0) == 0 for a in ("pp_rank", "tp_rank", "attn_cp_rank"))


def start_events(be, store) -> None:
    """Publish this store's residency (kv_events.py) when configured; never fails an open."""
    cfg = be._events_cfg
    if cfg is None or be._publisher is not None or not publishes_events(be.storage_config):
        return
    from .kv_events import Publisher
    from .kv_residency import Residency, attach, detach

    prefix, sfx = ("", be._v1_sfx) if be.interface_v1 else ("flat_", (be._flat_sfx,))
    rz = Residency(None, sfx, prefix=prefix)
    attach(store, rz)  # first: the publisher's first job is the snapshot of what the store holds
    try:
        rz.pub = Publisher(cfg, be.page_size, snapshot=rz.snapshot)
    except Exception as e:  # noqa: BLE001 - a port in use costs the events, not the cache
        detach(store)
        log.error("umbp_nvme: KV events not published on %s: %r", cfg.endpoint, e)
        return
    be._publisher, be._residency = rz.pub, rz
    log.info("umbp_nvme: publishing DISK KV events on %s (replay %s, topic %r)", rz.pub.endpoint,
             rz.pub.replay_endpoint, cfg.topic)  # fmt: skip


def stop_events(be, store) -> None:
    pub, be._publisher, be._residency = be._publisher, None, None
    if store is not None:
        from .kv_residency import detach

        detach(store)
    if pub is not None:
        try:
            pub.close()
        except Exception as e:  # noqa: BLE001
            log.warning("umbp_nvme: closing the KV event publisher failed: %r", e)


def backup_config(config):
    """The config of the store SGLang backs up into: admission_policy "auto" is "adaptive" here
    (SGLang's backups are what admission is for; a direct PageStore user's "auto" writes every
    page, so its puts keep meaning "stored until evicted")."""
    if config.admission_policy != "auto":
        return config
    import dataclasses

    return dataclasses.replace(config, admission_policy="adaptive")


def main_store(be):
    """The backend's store, opened on first use; None (a miss) while it cannot be opened."""
    store = be._store
    if store is not None:
        return store
    if be._closed:  # every call answers False / 0 without opening anything again
        be._log_once("closed", "called after close(); answering False / 0", level=logging.WARNING)
        return None
    with be._lock:
        try:
            return be._open_main(raise_errors=False)
        except Exception as e:  # noqa: BLE001 - lookups degrade to misses
            be._log_once("open", "opening %s failed: %r; reporting misses", be.store_dir, e)
            return None


def store_for_pool(be, name, pool, *, for_write: bool):
    """The store that holds this side pool on this rank; "skip" for a follower's shared pools."""
    if not be.is_mla_follower:
        return be._main()
    own = f"_{be.scheme.rank_suffix}_"
    if not any(s.startswith(own) for s in be.scheme.side_pool_suffixes(name, pool)):
        return "skip" if for_write else be._main()  # rank-replicated: the leader writes it
    if be._private is None:
        with be._lock:
            if be._private is None and not be._closed:
                from .store.sync import SyncPageStore

                ns = dict(be._namespace or {}, kind=NAMESPACE_KIND + "/sidecar")
                store = SyncPageStore(
                    _paths(be.private_dirs), be.config, readonly=False, namespace=ns,
                    engine_factory=be._engine_factory, page_of=be._page_of,
                )  # fmt: skip
                be._register_ranges(store, be._ranges)
                be._watch(store, "sidecar")
                be._private = store
    return be._private


def add_ranges(be, pool) -> None:
    """Register a pool's host tensors with every open store (and every store opened later)."""
    new = [r for r in pool_ranges(pool) if r not in be._ranges]
    if not new:
        return
    with be._lock:
        be._ranges.extend(new)
        for store in (be._store, be._private):
            if store is not None:
                be._register_ranges(store, new)


def register_ranges(store, ranges) -> None:
    for addr, nbytes in ranges:
        store.register_memory(addr, nbytes)


def pool_ranges(pool) -> list[tuple[int, int]]:
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
        if getattr(b, "is_cuda", False):
            return  # device memory: read through GDS, never registered as host memory
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


def watch(be, store, role: str) -> None:
    """Export the store's metrics (and log a doctor report) when asked; never fails an open."""
    if be._doctor_at_start and role == "main":
        try:
            from .doctor import log_report

            for path in be.store_dirs:  # one report per drive
                log_report(path, be.config, ranges=list(be._ranges))
        except Exception as e:  # noqa: BLE001
            log.warning("umbp_nvme: doctor at start failed: %r", e)
    if not be._prometheus:
        return
    try:
        from . import metrics

        m = metrics.default()
        if m is not None:
            m.watch(store, metrics.labels_from_storage_config(be.storage_config, role))
    except Exception as e:  # noqa: BLE001 - metrics never take the backend down
        be._log_once("metrics", "metrics for %s not exported: %r", store.path, e, level=logging.WARNING)


def clear_stores(be) -> None:
    for store in (be._store, be._private):
        if store is None:
            continue
        if store.readonly:
            log.info("umbp_nvme: %s is the leader's store (read-only here); clear() leaves it", store.path)
            continue
        try:
            store.clear()
        except Exception as e:  # noqa: BLE001
            log.error("umbp_nvme: clearing %s failed: %s", store.path, e)


def flush_stores(be) -> bool:
    ok = True
    for store in (be._store, be._private):
        if store is not None and not store.readonly:
            ok = bool(store.flush()) and ok
    return ok


def close_stores(be) -> None:
    with be._lock:
        if be._closed:
            return
        be._closed = True
        stores, be._store, be._private = (be._store, be._private), None, None
    for store in stores:
        if store is stores[0]:
            stop_events(be, store)
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


def store_stats(be) -> dict:
    out = {}
    for label, store in (("store", be._store), ("private", be._private)):
        if store is not None:
            try:
                out[label] = store.stats()
            except Exception as e:  # noqa: BLE001
                out[label] = {"error": repr(e)}
    return out


def drive_rows(be) -> list:
    """The per-drive rows of this rank's store when it spans several drives ([] otherwise)."""
    store = be._store
    if store is None or len(be.store_dirs) < 2:
        return []
    try:
        return list(store.stats(timeout_s=1.0).get("drives") or [])
    except Exception:  # noqa: BLE001 - stats never fail a metrics call
        return []
