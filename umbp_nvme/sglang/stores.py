"""Opening and closing the stores behind ``backend.UMBPNvmeStore``.

A backend holds up to two ``SyncPageStore``s (docs/sglang.md §1), both on its ``Seam``
(seam.py): ``seam.main``, this rank's own directory (or, on an MLA follower, the leader's
shared directory opened read-only, retried at most every ``FOLLOWER_RETRY_S`` until the leader has
created it), and ``seam.private``, a follower's own sidecar store for TP-sharded side-pool state.
The functions here take the seam and change only its store fields (under ``seam.lock``).

Also here: the namespace a store directory is opened with, the host ranges registered with every
store, and the metrics / doctor hooks run when a store opens.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..buffers import address_of
from ..errors import NamespaceMismatchError, StoreDamagedError, StoreError
from .keys import FLAT_KEY_PREFIX
from ..store.layout import MANIFEST_FILE as MANIFEST  # a follower opens the leader's store once it exists

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


def make_namespace(seam, pool) -> dict:
    """What the objects in this store mean: a directory made for another one is refused."""
    kv_bytes = None
    if getattr(pool, "kv_buffer", None) is not None:
        try:
            import torch  # the host pool is torch-based whenever it has a kv_buffer

            idx = torch.arange(seam.page_size, dtype=torch.int64)
            if seam.scheme.split_factor and not seam.envelope:
                _, sizes = pool.get_split_heads_page_buffer_meta(idx, seam.scheme.split_factor)
            else:
                _, sizes = pool.get_page_buffer_meta(idx)
            kv_bytes = [int(s) for s in normalise_sizes(sizes, len(seam.v1_sfx))]
        except Exception as e:  # noqa: BLE001 - a pool without meta still gets a namespace
            log.debug("umbp_nvme: could not size KV objects for the namespace: %r", e)
    return {
        "kind": NAMESPACE_KIND,
        "model": seam.model_name,
        "layout": getattr(pool, "layout", None),
        "dtype": str(getattr(pool, "dtype", None)),
        "page_size": seam.page_size,
        "kv_object_bytes": kv_bytes,
        "kv_objects_per_page": len(seam.v1_sfx),
        "interface": "v1" if seam.interface_v1 else "flat",
    }


def _paths(dirs: list[str]):
    """One directory as a path (today's single-drive store), several as a list (one per drive)."""
    return dirs[0] if len(dirs) == 1 else list(dirs)


def _log_leader_not_ready(seam) -> None:
    seam.log_once(
        "follower_wait",
        "follower: the leader has not created %s yet; reporting misses until it does",
        seam.store_dir,
        level=logging.INFO,
    )


def open_main(seam, *, raise_errors: bool):
    """Open the backend's store if it is not open; None while a follower waits for its leader."""
    if seam.main is not None or seam.closed or not seam.config.ssd_enabled or seam.namespace is None:
        return seam.main
    from ..store.sync import SyncPageStore

    if seam.follower:
        # Until the leader has created the store, a lookup costs one stat() and misses. One drive
        # with the leader's store is enough: a drive the leader holds out (unmounted, mounts.py)
        # or has not created yet is a degraded drive here, opened by the probe once it has a store.
        if not any(os.path.exists(os.path.join(d, MANIFEST)) for d in seam.store_dirs):
            _log_leader_not_ready(seam)
            return None
        now = time.monotonic()
        if now < seam.next_follower_try and not raise_errors:
            return None
        seam.next_follower_try = now + FOLLOWER_RETRY_S
        try:
            store = SyncPageStore(
                _paths(seam.store_dirs), seam.config, readonly=True, namespace=seam.namespace,
                engine_factory=seam.engine_factory, page_of=seam.page_of,
            )  # fmt: skip
        except StoreDamagedError as e:
            # the leader (the writer) moves damaged metadata aside at its open: miss until then
            seam.log_once("follower_damaged", "follower: %s; reporting misses until the leader repairs it", e)
            return None
        except FileNotFoundError:
            _log_leader_not_ready(seam)
            return None
        except (NamespaceMismatchError, StoreError):
            if raise_errors:
                raise
            return None
    else:
        store = SyncPageStore(
            _paths(seam.store_dirs), backup_config(seam.config), readonly=False, namespace=seam.namespace,
            engine_factory=seam.engine_factory, page_of=seam.page_of,
        )  # fmt: skip
    register_ranges(store, seam.ranges)
    watch(seam, store, "main")
    seam.main = store
    from .startup import announce

    announce(seam)  # the directory and capacity in use; defaults and a node total past the drive warned
    if not seam.follower:
        start_events(seam, store)
    return store


def publishes_events(storage_config) -> bool:
    """One publisher per KV cache, as SGLang gates its own (pp, attention-TP and attention-CP rank
    0): that rank's store stands for the page on disk (docs/fleet.md, "MHA with TP > 1")."""
    return all(int(getattr(storage_config, a, 0) or 0) == 0 for a in ("pp_rank", "tp_rank", "attn_cp_rank"))


def start_events(seam, store) -> None:
    """Publish this store's residency (kv_events.py) when configured; never fails an open."""
    cfg = seam.events_cfg
    if cfg is None or seam.publisher is not None or not publishes_events(seam.storage_config):
        return
    from .kv_events import Publisher
    from .kv_residency import Residency, attach, detach, drives_of
    from .kv_tokens import FILE_NAME, RECORD_SYNC_RELAXED_S

    prefix, sfx = ("", seam.v1_sfx) if seam.interface_v1 else (FLAT_KEY_PREFIX, (seam.scheme.flat_suffix,))
    rz = Residency(None, sfx, prefix=prefix)
    attach(store, rz)  # first: the publisher's first job is the snapshot of what the store holds
    # what subscribers were told (and the pages' tokens in relay mode), a copy beside every open
    # drive's store (never an unmounted root): a lost drive loses no record (kv_tokens.py)
    record_paths = [os.path.join(d.path, FILE_NAME) for d in drives_of(store.store)]
    try:
        rz.pub = Publisher(cfg, seam.page_size, snapshot=rz.snapshot, resolve=rz.resolve, record_paths=record_paths,
                           record_sync_s=0.0 if store.store.strict else RECORD_SYNC_RELAXED_S)
    except Exception as e:  # noqa: BLE001 - a port in use costs the events, not the cache
        detach(store)
        log.error("umbp_nvme: KV events not published on %s: %r", cfg.endpoint, e)
        return
    seam.publisher, seam.residency = rz.pub, rz
    log.info("umbp_nvme: publishing DISK KV events on %s (replay %s, topic %r)", rz.pub.endpoint,
             rz.pub.replay_endpoint, cfg.topic)  # fmt: skip


def stop_events(seam, store) -> None:
    pub, seam.publisher, seam.residency = seam.publisher, None, None
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


def main_store(seam):
    """The backend's store, opened on first use; None (a miss) while it cannot be opened."""
    store = seam.main
    if store is not None:
        return store
    if seam.closed:  # every call answers False / 0 without opening anything again
        seam.log_once("closed", "called after close(); answering False / 0", level=logging.WARNING)
        return None
    with seam.lock:
        try:
            return open_main(seam, raise_errors=False)
        except Exception as e:  # noqa: BLE001 - lookups degrade to misses
            seam.log_once("open", "opening %s failed: %r; reporting misses", seam.store_dir, e)
            return None


def store_for_pool(seam, name, pool, *, for_write: bool):
    """The store that holds this side pool on this rank; "skip" for a follower's shared pools."""
    if not seam.follower:
        return main_store(seam)
    own = f"_{seam.scheme.rank_suffix}_"
    if not any(s.startswith(own) for s in seam.scheme.side_pool_suffixes(name, pool)):
        return "skip" if for_write else main_store(seam)  # rank-replicated: the leader writes it
    if seam.private is None:
        with seam.lock:
            if seam.private is None and not seam.closed:
                from ..store.sync import SyncPageStore

                ns = dict(seam.namespace or {}, kind=NAMESPACE_KIND + "/sidecar")
                store = SyncPageStore(
                    _paths(seam.private_dirs), seam.config, readonly=False, namespace=ns,
                    engine_factory=seam.engine_factory, page_of=seam.page_of,
                )  # fmt: skip
                register_ranges(store, seam.ranges)
                watch(seam, store, "sidecar")
                seam.private = store
    return seam.private


def add_ranges(seam, pool) -> None:
    """Register a pool's host tensors with every open store (and every store opened later)."""
    new = [r for r in pool_ranges(pool) if r not in seam.ranges]
    if not new:
        return
    with seam.lock:
        seam.ranges.extend(new)
        for store in (seam.main, seam.private):
            if store is not None:
                register_ranges(store, new)


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


def watch(seam, store, role: str) -> None:
    """Export the store's metrics (and log a doctor report) when asked; never fails an open."""
    if seam.doctor_at_start and role == "main":
        try:
            from ..doctor.report import log_report

            for path in seam.store_dirs:  # one report per drive
                log_report(path, seam.config, ranges=list(seam.ranges))
        except Exception as e:  # noqa: BLE001
            log.warning("umbp_nvme: doctor at start failed: %r", e)
    if not seam.prometheus:
        return
    try:
        from .. import metrics

        m = metrics.default()
        if m is not None:
            extra = (lambda: event_counters(seam)) if role == "main" else None
            m.watch(store, metrics.labels_from_storage_config(seam.storage_config, role), extra=extra)
    except Exception as e:  # noqa: BLE001 - metrics never take the backend down
        seam.log_once("metrics", "metrics for %s not exported: %r", store.path, e, level=logging.WARNING)


def clear_stores(seam) -> None:
    for store in (seam.main, seam.private):
        if store is None:
            continue
        if store.readonly:
            log.info("umbp_nvme: %s is the leader's store (read-only here); clear() leaves it", store.path)
            continue
        try:
            store.clear()
        except Exception as e:  # noqa: BLE001
            log.error("umbp_nvme: clearing %s failed: %s", store.path, e)


def flush_stores(seam) -> bool:
    ok = True
    for store in (seam.main, seam.private):
        if store is not None and not store.readonly:
            ok = bool(store.flush()) and ok
    return ok


def close_stores(seam) -> None:
    with seam.lock:
        if seam.closed:
            return
        seam.closed = True
        stores, seam.main, seam.private = (seam.main, seam.private), None, None
    for store in stores:
        if store is stores[0]:
            stop_events(seam, store)
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


def event_counters(seam) -> dict:
    """The KV events' own counters (kv_residency.Residency.counters), shown beside this rank's
    store counters in ``store_stats`` and the metrics; {} while no events are published."""
    rz = seam.residency
    return dict(rz.counters) if rz is not None else {}


def store_stats(seam) -> dict:
    out = {}
    for label, store in (("store", seam.main), ("private", seam.private)):
        if store is not None:
            try:
                out[label] = store.stats()
            except Exception as e:  # noqa: BLE001
                out[label] = {"error": repr(e)}
    if "store" in out and "error" not in out["store"]:
        out["store"].update(event_counters(seam))
    return out


def drive_rows(seam) -> list:
    """The per-drive rows of this rank's store when it spans several drives ([] otherwise), read
    on the calling thread (SyncPageStore.drive_rows): get_stats() runs on SGLang's scheduler
    thread, which must never wait for the store's loop."""
    store = seam.main
    if store is None or len(seam.store_dirs) < 2:
        return []
    try:
        return store.drive_rows()
    except Exception:  # noqa: BLE001 - stats never fail a metrics call
        return []
