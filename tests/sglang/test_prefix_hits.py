"""Prefix-hit counting (spec §6.5-6.6, §10), checked against brute-force references."""

from __future__ import annotations

import logging
from enum import Enum
from types import SimpleNamespace as NS

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from umbp_nvme.sglang.hits import (
    ALL_PAGES,
    BLOCK_GROUPS,
    TRAILING_PAGES,
    V2Hits,
    block_group_pages,
    consecutive_pages,
    leading_true,
    trailing_stop_points,
    v2_hits,
)


class PoolHitPolicy(str, Enum):  # stand-in for sglang's enum
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


# ---------------------------------------------------------------------------- v1

@pytest.mark.parametrize(
    "objects,m,expected",
    [
        ([True, True, True], 2, 1),  # K+V of page 0, only K of page 1
        ([True, True, True, True], 2, 2),
        ([False, True, True, True], 2, 0),
        ([], 2, 0),
        ([True], 1, 1),
        ([True] * 7, 4, 1),  # split heads sf=2: a page needs all 4 objects
        ([True, True, False, True, True, True], 2, 1),
    ],
)
def test_consecutive_pages_examples(objects, m, expected):
    assert consecutive_pages(objects, m) == expected


def test_consecutive_pages_rejects_zero_multiplier():
    with pytest.raises(ValueError, match="multiplier must be >= 1 object per page, got 0"):
        consecutive_pages([True], 0)


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 6))
def test_consecutive_pages_matches_brute_force(objects, m):
    best = 0
    for p in range(len(objects) // m + 1):
        if all(objects[: p * m]):
            best = p
    assert consecutive_pages(objects, m) == best


@given(st.lists(st.booleans(), max_size=30), st.integers(1, 8))
def test_trailing_stop_points_matches_definition(page_ok, w):
    expected = [p for p in range(1, len(page_ok) + 1) if all(page_ok[max(0, p - w) : p])]
    assert trailing_stop_points(page_ok, w) == expected


# ---------------------------------------------------------------------------- v2 harness

class World:
    """Side pools with per-page components; exists_fn answers from a set of present objects."""

    def __init__(self, components: dict, present: set, short_pools: frozenset = frozenset()):
        self.components = components  # pool name -> objects per page
        self.present = present  # {(pool, page_index, component)}
        self.short_pools = short_pools  # pools whose exists answer drops one entry
        self.queries = []

    def component_keys(self, page_keys, transfer):
        name = str(transfer.name.value if isinstance(transfer.name, Enum) else transfer.name)
        m = self.components[name]
        return [f"{name}|{k}|{c}" for k in page_keys for c in range(m)], m

    def exists(self, keys):
        self.queries.append(list(keys))
        out = []
        for key in keys:
            name, page, comp = key.split("|")
            out.append((name, int(page[1:]), int(comp)) in self.present)
        if keys and keys[0].split("|")[0] in self.short_pools:
            out = out[:-1]
        return out

    def page_ok(self, name, i):
        return all((name, i, c) in self.present for c in range(self.components[name]))


def page_keys(n):
    return [f"p{i}" for i in range(n)]


def run(world, n, kv, transfers):
    return v2_hits(page_keys(n), kv, transfers, world.exists, world.component_keys)


def T(name, policy=ALL_PAGES, window=None, block_pages=0, group_pages=0):
    return NS(name=name, hit_policy=policy, keys=None if window is None else [f"w{i}" for i in range(window)],
              block_pages=block_pages, group_pages=group_pages)


def world_with(**pools):
    """pools: name -> (components, string of page flags '1101')."""
    present = set()
    comps = {}
    for name, (m, flags) in pools.items():
        comps[name] = m
        for i, f in enumerate(flags):
            if f == "1":
                present.update((name, i, c) for c in range(m))
    return World(comps, present)


def test_kv_only():
    assert run(world_with(), 5, 3, []) == V2Hits(3, {"kv": 3}, [1, 2, 3])


def test_kv_zero_gives_empty_hits_and_no_queries():
    w = world_with(swa=(2, "1111"))
    assert run(w, 4, 0, [T("swa")]) == V2Hits(0, {}, [])
    assert w.queries == []


def test_all_pages_cuts_at_first_missing_page():
    w = world_with(indexer=(1, "11011"))
    assert run(w, 5, 5, [T("indexer")]) == V2Hits(2, {"kv": 5, "indexer": 2}, [1, 2])


def test_all_pages_needs_every_component():
    w = world_with(swa=(2, "111"))
    w.present.discard(("swa", 1, 1))  # page 1 has K but not V
    assert run(w, 3, 3, [T("swa")]) == V2Hits(1, {"kv": 3, "swa": 1}, [1])


def test_trailing_takes_longest_complete_window_not_prefix():
    w = world_with(mamba=(2, "00101"))  # window 1: states at pages 2 and 4
    assert run(w, 5, 5, [T("mamba", TRAILING_PAGES, window=1)]) == V2Hits(5, {"kv": 5, "mamba": 5}, [3, 5])


def test_trailing_window_of_two():
    w = world_with(swa=(2, "011101"))
    assert run(w, 6, 6, [T("swa", TRAILING_PAGES, window=2)]) == V2Hits(4, {"kv": 6, "swa": 4}, [3, 4])


def test_trailing_without_keys_uses_window_one():
    w = world_with(mamba=(1, "001"))
    assert run(w, 3, 3, [T("mamba", TRAILING_PAGES)]) == V2Hits(3, {"kv": 3, "mamba": 3}, [3])


def test_pool_with_zero_boundary_is_not_in_hits_and_stops_the_loop():
    w = world_with(indexer=(1, "011"), swa=(1, "111"))
    assert run(w, 3, 3, [T("indexer"), T("swa")]) == V2Hits(0, {"kv": 3}, [])
    assert len(w.queries) == 1  # swa never queried once final is 0


def test_progressive_shrinking_queries_only_the_current_prefix():
    w = world_with(indexer=(1, "11100"), swa=(2, "11111"))
    result = run(w, 5, 4, [T("indexer"), T("swa")])
    assert result == V2Hits(3, {"kv": 4, "indexer": 3, "swa": 3}, [1, 2, 3])
    assert w.queries[0] == ["indexer|p0|0", "indexer|p1|0", "indexer|p2|0", "indexer|p3|0"]
    assert len(w.queries[1]) == 3 * 2


def test_umbp_final_can_land_in_a_hole_restorable_does_not():
    # mamba (window 1) is restorable at 5 and 3; indexer cuts the prefix at 4. UMBP keeps 4 (it
    # never re-checks mamba); the intersection says only 1..3 minus mamba's holes = {3}.
    w = world_with(mamba=(1, "00101"), indexer=(1, "11110"))
    result = run(w, 5, 5, [T("mamba", TRAILING_PAGES, window=1), T("indexer")])
    assert result == V2Hits(4, {"kv": 5, "mamba": 5, "indexer": 4}, [3])


def test_length_mismatch_is_a_miss_that_keeps_earlier_hits(caplog):
    w = world_with(indexer=(1, "111"), swa=(1, "111"))
    w.short_pools = frozenset({"swa"})
    with caplog.at_level(logging.ERROR, logger="umbp_nvme.sglang.hits"):
        result = run(w, 3, 3, [T("indexer"), T("swa")])
    assert result == V2Hits(0, {"kv": 3, "indexer": 3}, [])
    assert "treating the storage prefix as a miss" in caplog.text


def test_unknown_policy_is_zero():
    w = world_with(swa=(1, "111"))
    assert run(w, 3, 3, [T("swa", "sideways")]) == V2Hits(0, {"kv": 3}, [])


def test_enum_policies_and_names():
    class PoolName(str, Enum):
        SWA = "swa"

    w = world_with(swa=(1, "0111"))
    result = run(w, 4, 4, [T(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, window=2)])
    assert result.kv_hit_pages == 4
    assert result.extra_pool_hit_pages[PoolName.SWA] == 4 and result.extra_pool_hit_pages["swa"] == 4


def test_kv_name_is_configurable():
    assert v2_hits(["a"], 1, [], lambda k: [], lambda k, t: ([], 1), kv_name="KV").extra_pool_hit_pages == {"KV": 1}


def test_unregistered_pool_error_propagates():
    def component_keys(keys, transfer):
        raise ValueError("Unregistered UMBP hybrid pool: swa")

    with pytest.raises(ValueError, match="^Unregistered UMBP hybrid pool: swa"):
        v2_hits(["a"], 1, [T("swa")], lambda k: [], component_keys)


def test_zero_component_pool_is_always_present():
    w = World({"empty": 0}, set())
    assert run(w, 3, 3, [T("empty")]) == V2Hits(3, {"kv": 3, "empty": 3}, [1, 2, 3])


# ---------------------------------------------------------------------------- BLOCK_GROUPS

@pytest.mark.parametrize(
    "flags,block,group,expected",
    [
        ("1111", 2, 2, 4),
        ("1101", 2, 2, 2),
        ("0101", 2, 1, 4),  # one key per block, at its last page
        ("1010", 2, 1, 0),
        ("11111", 2, 0, 4),  # group 0 = whole block; the partial block covers nothing
        ("111", 4, 1, 0),
        ("1111", 0, 1, 0),  # no geometry
        ("1111", 2, 3, 0),  # a group cannot be larger than its block
    ],
)
def test_block_group_pages(flags, block, group, expected):
    assert block_group_pages([f == "1" for f in flags], block, group) == expected


def test_block_groups_reports_its_own_verdict_and_never_gates():
    w = world_with(c4=(1, "0001"), indexer=(1, "1111"))
    result = run(w, 4, 4, [T("c4", BLOCK_GROUPS, block_pages=2, group_pages=1), T("indexer")])
    assert result == V2Hits(4, {"kv": 4, "indexer": 4}, [1, 2, 3, 4])  # c4 verdict 0: no entry
    w = world_with(c4=(1, "0101"))
    result = run(w, 5, 5, [T("c4", PoolHitPolicy.BLOCK_GROUPS, block_pages=2, group_pages=1)])
    assert result == V2Hits(5, {"kv": 5, "c4": 4}, [1, 2, 3, 4, 5])


# ---------------------------------------------------------------------------- brute force

def reference(world, n, kv, transfers):
    """v2 hits straight from the definitions, over the whole world rather than per-query answers."""
    def valid(t, p):  # can this pool serve a stop at prefix p?
        name = str(t.name)
        if t.hit_policy == ALL_PAGES:
            return all(world.page_ok(name, i) for i in range(p))
        if t.hit_policy == TRAILING_PAGES:
            w = max(1, len(t.keys) if t.keys else 1)
            return all(world.page_ok(name, i) for i in range(max(0, p - w), p))
        return False

    hits = {"kv": kv} if kv else {}
    final = kv
    gating = []
    for t in transfers:
        if final == 0:
            break
        name = str(t.name)
        if name in world.short_pools:
            final = 0
            break
        if t.hit_policy == BLOCK_GROUPS:
            B, G = t.block_pages, t.group_pages or t.block_pages
            verdict = 0
            if B >= 1 and G <= B:
                for blocks in range(final // B + 1):
                    if all(world.page_ok(name, i) for j in range(blocks) for i in range((j + 1) * B - G, (j + 1) * B)):
                        verdict = blocks * B
            if verdict:
                hits[name] = verdict
            continue
        boundary = max([p for p in range(0, final + 1) if p == 0 or valid(t, p)])
        if boundary:
            hits[name] = boundary
        final = min(final, boundary)
        gating.append(t)
    restorable = [p for p in range(1, kv + 1) if all(valid(t, p) for t in gating)] if final else []
    return V2Hits(final, hits, restorable)


@st.composite
def scenarios(draw):
    n = draw(st.integers(0, 10))
    kv = draw(st.integers(0, n))
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True, max_size=4))
    components, present, transfers = {}, set(), []
    for name in names:
        m = draw(st.integers(1, 3))
        components[name] = m
        for i in range(n):
            for c in range(m):
                if draw(st.booleans()) or draw(st.booleans()):  # mostly present, so prefixes get long
                    present.add((name, i, c))
        policy = draw(st.sampled_from([ALL_PAGES, TRAILING_PAGES, TRAILING_PAGES, BLOCK_GROUPS, "bogus"]))
        window = draw(st.none() | st.integers(0, 4))
        block = draw(st.integers(0, 4))
        group = draw(st.integers(0, 4))
        transfers.append(T(name, policy, window=window, block_pages=block, group_pages=group))
    short = draw(st.frozensets(st.sampled_from(names), max_size=1)) if names and draw(st.integers(0, 9)) == 0 else frozenset()
    return World(components, present, short), n, kv, transfers


@settings(max_examples=600, deadline=None)
@given(scenarios())
def test_v2_hits_matches_brute_force(scenario):
    world, n, kv, transfers = scenario
    result = run(world, n, kv, transfers)
    assert result == reference(world, n, kv, transfers)
    # Invariants the controller relies on.
    assert result.restorable_prefix_pages == sorted(set(result.restorable_prefix_pages))
    assert all(1 <= p <= result.kv_hit_pages for p in result.restorable_prefix_pages)
    assert result.kv_hit_pages <= kv


def test_leading_true():
    assert leading_true([1, 1, 0, 1]) == 2 and leading_true([]) == 0


def test_with_sglang_types_when_installed():
    hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    from umbp_nvme.sglang.keys import KeyScheme, PoolRegistry

    scheme = KeyScheme.from_storage_config(NS(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False,
                                              model_name="m", extra_config={}))
    registry = PoolRegistry()
    registry.register(hs.PoolName.KV, object())
    registry.register(hs.PoolName.MAMBA, NS(conv_buffer=[0], temporal_state_elem_size=1))
    present = {"m_h1_0_temporal", "m_h1_0_conv_0"}
    transfer = hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["h1"], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)
    hits = v2_hits(["h0", "h1"], 2, [transfer], lambda ks: [k in present for k in ks],
                   lambda ks, t: scheme.component_keys(ks, t.name, registry), kv_name=hs.PoolName.KV)
    result = hs.PoolTransferResult(hits.kv_hit_pages, hits.extra_pool_hit_pages)
    assert result.kv_hit_pages == 2
    assert result.extra_pool_hit_pages.get(hs.PoolName.MAMBA.value) == 2
    assert hits.restorable_prefix_pages == [2]
    with pytest.raises(ValueError, match="^Unregistered UMBP hybrid pool: swa"):
        v2_hits(["h0"], 1, [hs.PoolTransfer(name=hs.PoolName.SWA)], lambda ks: [],
                lambda ks, t: scheme.component_keys(ks, t.name, registry))
