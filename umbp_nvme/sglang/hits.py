"""Prefix-hit counting for batch_exists (v1) and batch_exists_v2 (docs/sglang.md §5).

Page hashes are chained, so "pages present from the start" is the usable prefix. A page is
present only when all of its objects are (K and V, every split-head group, every Mamba
component). These functions are pure: callers pass existence lists and lookup functions and
wrap the plain results in sglang's types.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

ALL_PAGES = "all_pages"
TRAILING_PAGES = "trailing_pages"
BLOCK_GROUPS = "block_groups"


def leading_true(flags: Sequence[bool]) -> int:
    """Number of leading truthy entries."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def consecutive_pages(object_exists: Sequence[bool], multiplier: int) -> int:
    """v1 hit: leading existing objects // objects per page (K+V of page 0 and K of page 1 -> 1)."""
    if multiplier <= 0:
        raise ValueError(f"multiplier must be >= 1 object per page, got {multiplier}")
    return leading_true(object_exists) // multiplier


def pages_ok(object_exists: Sequence[bool], multiplier: int, pages: int) -> list[bool]:
    """Per page, whether all of its `multiplier` objects exist."""
    return [all(object_exists[i * multiplier : (i + 1) * multiplier]) for i in range(pages)]


def _policy(transfer: Any) -> str:
    policy = getattr(transfer, "hit_policy", ALL_PAGES)
    return str(policy.value) if isinstance(policy, Enum) else str(policy)


def trailing_stop_points(page_ok: Sequence[bool], window: int) -> list[int]:
    """Prefix lengths p >= 1 whose last `window` pages (fewer near the start) all exist."""
    window = max(1, window)
    points = []
    run = 0  # length of the run of existing pages ending at the current page
    for i, ok in enumerate(page_ok):
        run = run + 1 if ok else 0
        p = i + 1
        if run >= min(window, p):
            points.append(p)
    return points


def block_group_pages(page_ok: Sequence[bool], block_pages: int, group_pages: int) -> int:
    """BLOCK_GROUPS verdict: pages covered by the leading complete key groups.

    The span is cut into blocks of `block_pages` FULL pages from its start. Block j is covered
    when its key group -- the `group_pages` pages that end at its boundary, (j+1)*block_pages -
    group_pages .. (j+1)*block_pages - 1 -- all exist; the verdict is block_pages times the
    number of leading covered blocks. A partial last block covers nothing. group_pages == 0
    means the whole block. Geometry that cannot be laid out (block_pages < 1, group_pages >
    block_pages) gives 0.
    """
    if block_pages < 1:
        return 0
    group = block_pages if group_pages <= 0 else group_pages
    if group > block_pages:
        return 0
    covered = 0
    while covered + block_pages <= len(page_ok):
        end = covered + block_pages
        if not all(page_ok[end - group : end]):
            break
        covered = end
    return covered


class V2Hits(NamedTuple):
    """Plain result of v2_hits; PoolTransferResult(kv_hit_pages, extra_pool_hit_pages) positionally."""

    kv_hit_pages: int
    extra_pool_hit_pages: dict
    restorable_prefix_pages: list[int]


def v2_hits(
    keys: Sequence[str],
    kv_hit: int,
    transfers: Sequence[Any] | None,
    exists_fn: Callable[[list[str]], Sequence[bool]],
    component_keys_fn: Callable[[Sequence[str], Any], tuple[list[str], int]],
    *,
    kv_name: Any = "kv",
) -> V2Hits:
    """batch_exists_v2 over the KV hit and the side pools, UMBP's algorithm (spec §6.6).

    - `kv_hit`: pages of `keys` the KV anchor has (len(keys) for a logical anchor).
    - `component_keys_fn(page_keys, transfer) -> (object keys, objects per page)`; it raises
      for an unregistered pool, and that error propagates.
    - `exists_fn(object keys) -> one bool per key`. A result of the wrong length logs an error
      and makes the whole answer a miss (kv_hit_pages 0; hits found so far, the KV entry
      included, stay in the dict, as UMBP does).

    Transfers are taken in order and `final` shrinks as they go: ALL_PAGES cuts it at the
    first missing page; TRAILING_PAGES at the longest prefix p <= final whose window of
    max(1, len(transfer.keys)) pages ending at p exists; an unknown policy at 0. A pool is in
    the hit dict only when its boundary is > 0. BLOCK_GROUPS reports its own verdict
    (block_group_pages over the current prefix) and never gates `final`.

    `restorable_prefix_pages` is the set of prefix lengths every gating pool can serve (the
    intersection of their stop points, as Mooncake computes it), ascending. A trailing window
    leaves holes -- a Mamba state may exist at 5 and 3 but not 4 -- and UMBP's `final` can land
    in one when two pools disagree; SGLang reduces this set across ranks instead of the
    maximum. Its largest member is never above kv_hit_pages.
    """
    kv = max(0, int(kv_hit))
    hits: dict = {kv_name: kv} if kv else {}
    final = kv
    restorable = list(range(1, kv + 1))
    for transfer in transfers or ():
        if final == 0:
            break
        component_keys, multiplier = component_keys_fn(keys[:final], transfer)
        exists = list(exists_fn(component_keys))
        if len(exists) != len(component_keys):
            logger.error(
                "umbp_nvme v2 batch_exists result-size mismatch for pool %s: expected=%d actual=%d; "
                "treating the storage prefix as a miss",
                getattr(transfer, "name", transfer),
                len(component_keys),
                len(exists),
            )
            final = 0
            break
        # A pool with no objects per page has nothing to miss: all([]) is True, as in UMBP.
        page_ok = pages_ok(exists, multiplier, final)
        policy = _policy(transfer)
        name = getattr(transfer, "name", None)
        if policy == BLOCK_GROUPS:
            verdict = block_group_pages(
                page_ok, int(getattr(transfer, "block_pages", 0) or 0), int(getattr(transfer, "group_pages", 0) or 0)
            )
            if verdict:
                hits[name] = verdict
            continue
        if policy == ALL_PAGES:
            boundary = leading_true(page_ok)
            stops = set(range(1, boundary + 1))
        elif policy == TRAILING_PAGES:
            transfer_keys = getattr(transfer, "keys", None)
            window = max(1, len(transfer_keys) if transfer_keys else 1)
            points = trailing_stop_points(page_ok, window)
            boundary = points[-1] if points else 0
            stops = set(points)
        else:
            logger.error("umbp_nvme: unknown hit policy %r for pool %s; treating it as a miss", policy, name)
            boundary = 0
            stops = set()
        if boundary:
            hits[name] = boundary
        final = min(final, boundary)
        restorable = [p for p in restorable if p in stops]
    if final == 0:
        restorable = []
    return V2Hits(final, hits, restorable)
