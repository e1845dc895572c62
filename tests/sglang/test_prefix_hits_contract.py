"""v2 hit counting with transfers that carry only some of PoolTransfer's fields (issue 17).

Older sglang PoolTransfer objects lack hit_policy, keys, block_pages or group_pages; the spec's
rule is to read every optional field with a default. A missing policy is ALL_PAGES, missing keys
are a window of one page, and a BLOCK_GROUPS transfer without block_pages has no geometry and
reports no hit. Also: the size-mismatch error names the pool, as UMBP's does.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace as NS

from umbp_nvme.sglang.hits import BLOCK_GROUPS, TRAILING_PAGES, V2Hits, v2_hits


def world(flags: dict[str, str], short: frozenset = frozenset()):
    """exists_fn / component_keys_fn over one object per page; flags: pool -> '1101'."""

    def component_keys(page_keys, transfer):
        return [f"{transfer.name}|{k}" for k in page_keys], 1

    def exists(keys):
        out = [flags[k.split("|")[0]][int(k.split("|")[1][1:])] == "1" for k in keys]
        return out[:-1] if keys and keys[0].split("|")[0] in short else out

    return exists, component_keys


def run(flags, n, kv, transfers, short=frozenset()):
    exists, component_keys = world(flags, short)
    return v2_hits([f"p{i}" for i in range(n)], kv, transfers, exists, component_keys)


def test_a_transfer_without_hit_policy_is_all_pages():
    assert run({"indexer": "1101"}, 4, 4, [NS(name="indexer")]) == V2Hits(2, {"kv": 4, "indexer": 2}, [1, 2])


def test_a_trailing_transfer_without_keys_has_a_window_of_one():
    result = run({"mamba": "0101"}, 4, 4, [NS(name="mamba", hit_policy=TRAILING_PAGES)])
    assert result == V2Hits(4, {"kv": 4, "mamba": 4}, [2, 4])


def test_block_groups_without_geometry_reports_nothing():
    for transfer in (
        NS(name="c4", hit_policy=BLOCK_GROUPS),
        NS(name="c4", hit_policy=BLOCK_GROUPS, block_pages=None, group_pages=None),
        NS(name="c4", hit_policy=BLOCK_GROUPS, group_pages=1),
    ):
        assert run({"c4": "1111"}, 4, 4, [transfer]) == V2Hits(4, {"kv": 4}, [1, 2, 3, 4])


def test_block_groups_without_group_pages_needs_whole_blocks():
    # blocks of 2 pages; without group_pages a block's group is the whole block: page 0 missing
    # means block 0 is not covered, even though its last page exists.
    transfer = NS(name="c4", hit_policy=BLOCK_GROUPS, block_pages=2)
    assert run({"c4": "0111"}, 4, 4, [transfer]) == V2Hits(4, {"kv": 4}, [1, 2, 3, 4])
    assert run({"c4": "1110"}, 4, 4, [transfer]) == V2Hits(4, {"kv": 4, "c4": 2}, [1, 2, 3, 4])
    with_group = NS(name="c4", hit_policy=BLOCK_GROUPS, block_pages=2, group_pages=1)
    assert run({"c4": "0101"}, 4, 4, [with_group]) == V2Hits(4, {"kv": 4, "c4": 4}, [1, 2, 3, 4])


def test_size_mismatch_error_names_the_pool_and_the_counts(caplog):
    with caplog.at_level(logging.ERROR, logger="umbp_nvme.sglang.hits"):
        result = run({"swa": "111"}, 3, 3, [NS(name="swa")], short=frozenset({"swa"}))
    assert result == V2Hits(0, {"kv": 3}, [])
    assert [r.getMessage() for r in caplog.records] == [
        "umbp_nvme v2 batch_exists result-size mismatch for pool swa: expected=3 actual=2; "
        "treating the storage prefix as a miss"
    ]


def test_unknown_policy_error_names_policy_and_pool(caplog):
    with caplog.at_level(logging.ERROR, logger="umbp_nvme.sglang.hits"):
        assert run({"swa": "111"}, 3, 3, [NS(name="swa", hit_policy="sideways")]) == V2Hits(0, {"kv": 3}, [])
    assert [r.getMessage() for r in caplog.records] == [
        "umbp_nvme: unknown hit policy 'sideways' for pool swa; treating it as a miss"
    ]
