"""The data paths of ``backend.UMBPNvmeStore``: one store call per SGLang call.

- ``v1_io``: ``batch_get_v1`` / ``batch_set_v1`` on the KV anchor (host slots -> ``(address,
  nbytes)`` through the pool's buffer meta, page hashes -> component keys).
- ``v2_io``: ``batch_get_v2`` / ``batch_set_v2`` over hybrid-pool ``PoolTransfer``s, one store
  call per store touched.
- ``legacy_batch_get`` / ``legacy_batch_set``: legacy (non ``interface_v1``) whole flat pages
  under their own keys (``KeyScheme.flat_key``).

Each takes the backend's ``Seam`` (seam.py); the callers in ``backend`` keep the
never-raise wrappers.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from .keys import pool_name_str
from .stores import main_store, normalise_sizes, store_for_pool

log = logging.getLogger("umbp_nvme.sglang_backend")


def fold(res: Sequence[bool], m: int, pages: int) -> list[bool]:
    """Per-object results -> per-page: a page is there only when all m of its objects are."""
    if m == 1:
        return [bool(r) for r in res[:pages]]
    if m == 2:
        return [bool(a and b) for a, b in zip(res[0::2], res[1::2])]
    return [all(res[i * m : (i + 1) * m]) for i in range(pages)]


# ------------------------------------------------------------------------------- v1 (KV anchor)


def v1_io(seam, keys, host_indices, *, is_set: bool, extra_info) -> tuple[list[bool], int]:
    """One v1 batch: (per-page results, bytes moved). May raise; the caller turns that into False."""
    n = len(keys)
    if n == 0:
        return [], 0
    pool = seam.anchor
    if pool is None:
        seam.log_once("v1_unregistered", "batch I/O before register_mem_pool_host; reporting misses")
        return [False] * n, 0
    if host_indices is None or len(host_indices) // seam.page_size != n:
        seam.log_once(
            "v1_count",
            "batch_%s_v1 got %d keys for %s host indices with page_size=%d; reporting misses",
            "set" if is_set else "get",
            n,
            None if host_indices is None else len(host_indices),
            seam.page_size,
        )
        return [False] * n, 0
    store = main_store(seam)
    if store is None:
        return [False] * n, 0
    if seam.scheme.split_factor and not seam.envelope:
        ptrs, sizes = pool.get_split_heads_page_buffer_meta(host_indices, seam.scheme.split_factor)
    else:
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    sizes = normalise_sizes(sizes, len(ptrs))
    sfx = seam.v1_sfx
    m = len(sfx)
    objkeys = [h + s for h in keys for s in sfx]
    if len(objkeys) != len(ptrs) or len(sizes) != len(ptrs):
        seam.log_once(
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
        rz = seam.residency
        if rz is not None:  # the parents of the pages this put announces (kv_residency.py)
            rz.link(keys, prefix[-1] if prefix else None, objkeys)
        res = store.put_many(objkeys, bufs, depths=depths)
    else:
        res = store.get_many(objkeys, bufs)
    if len(res) != len(objkeys):
        seam.log_once("v1_result", "store returned %d results for %d objects; reporting misses", len(res), len(objkeys))
        return [False] * n, 0
    pages = fold(res, m, n)
    nbytes = sum(int(s) for s, ok in zip(sizes, res) if ok)
    return pages, nbytes


# ------------------------------------------------------------------------------- v2 (hybrid pools)


def v2_io(seam, transfers, *, is_set: bool) -> dict:
    """batch_get_v2 / batch_set_v2: pool name -> per-page results."""
    results: dict = {}
    # store id -> (store, object keys, buffers, [(transfer name, first object, pages, m)])
    batches: dict[int, tuple[Any, list, list, list]] = {}
    for t in transfers or ():
        name = t.name
        pool = seam.registry.get(name)  # raises "Unregistered UMBP hybrid pool: ..." (docs/sglang.md §6)
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
        ck, m = seam.scheme.side_pool_keys(keys, name, pool)
        ptrs, sizes = pool.get_page_buffer_meta(t.host_indices)
        if not (len(ck) == len(ptrs) == len(sizes)):
            raise ValueError(
                f"UMBP v2 buffer-meta mismatch for pool {pool_name_str(name)}: keys={len(ck)} "
                f"ptrs={len(ptrs)} sizes={len(sizes)}"
            )
        store = store_for_pool(seam, name, pool, for_write=is_set)
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
            seam.log_once("v2_io", "batch_%s_v2 store call failed: %r", "set" if is_set else "get", e)
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
                results[name] = fold(res[start : start + pages * m], m, pages)
    return results


# ------------------------------------------------------------------------------- legacy (flat pages)


def legacy_buffer(loc, size, *, writable: bool = True):
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


def legacy_batch_get(seam, keys, target_locations=None, target_sizes=None):
    n = len(keys)
    if target_locations is None:
        return [None] * n
    try:
        store = main_store(seam)
        if store is None or n == 0:
            return [None] * n
        bufs = [legacy_buffer(loc, None if target_sizes is None else target_sizes[i]) for i, loc in enumerate(target_locations)]
        ok_idx = [i for i, b in enumerate(bufs) if b is not None]
        res = store.get_many([seam.scheme.flat_key(keys[i]) for i in ok_idx], [bufs[i] for i in ok_idx])
        out: list = [None] * n
        for i, ok in zip(ok_idx, res):
            if ok:
                out[i] = target_locations[i]
        return out
    except Exception as e:  # noqa: BLE001 - the legacy prefetch path must not die either
        seam.log_once("batch_get", "batch_get of %d pages failed: %r", n, e)
        return [None] * n


def legacy_batch_set(seam, keys, values=None, target_locations=None, target_sizes=None) -> bool:
    if not keys:
        return False
    if seam.follower:
        return True
    try:
        store = main_store(seam)
        if store is None:
            return False
        bufs = []
        for i in range(len(keys)):
            if values is not None:
                buf = legacy_buffer(values[i], None, writable=False)
            elif target_locations is not None:
                buf = legacy_buffer(target_locations[i], None if target_sizes is None else target_sizes[i])
            else:
                buf = None
            if buf is None:
                return False
            bufs.append(buf)
        return all(store.put_many([seam.scheme.flat_key(k) for k in keys], bufs))
    except Exception as e:  # noqa: BLE001
        seam.log_once("batch_set", "batch_set of %d pages failed: %r", len(keys), e)
        return False
