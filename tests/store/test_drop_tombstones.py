"""A delete or eviction clears its records on disk before it is acknowledged, whichever segments
this session has touched so far (found by the version oracle in the chaos report's crash part:
an evicted page's older version, and a deleted page, came back after rebuilds).

Each version of a key has its own bytes (support/versions.py), so what a rebuild serves shows
which version came back.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import small_config
from support.version_crash import ROUTES, rebuild_by
from support.versions import version_in, versioned
from umbp_nvme.store import PageStore
from umbp_nvme.store.rebuild import rebuild_records

OBJ = 4096
SEG = 1 << 20


def cfg():
    return small_config(ssd_durability_mode="strict")


@pytest.mark.parametrize("route", ROUTES)
async def test_deleting_a_segments_last_object_after_a_clean_open_clears_its_record(store_dir, route):
    st = await PageStore.open(store_dir, cfg())
    assert await st.put_many(["K"], [versioned("K", 1, OBJ)]) == [True]
    await st.close()
    st = await PageStore.open(store_dir, cfg())  # a clean open: the areas are built on first use
    assert await st.delete_many(["K"]) == [True]
    await st.close()
    left = [k for k in rebuild_records(store_dir, SEG, 16)[0] if k == "K"]
    rebuild_by(route, store_dir, cfg().ssd_capacity_bytes)
    st = await PageStore.open(store_dir, cfg())
    try:
        out = np.zeros(OBJ, np.uint8)
        (ok,) = await st.get_many(["K"], [out])
    finally:
        await st.close()
    assert (left, ok) == ([], False), f"the deleted K came back as version {version_in('K', out)}"


async def test_deleting_one_of_several_objects_after_a_clean_open_clears_its_record(store_dir):
    """The control: with another object still in the segment its area is built and the tombstone written."""
    st = await PageStore.open(store_dir, cfg())
    assert await st.put_many(["K", "L"], [versioned("K", 1, OBJ), versioned("L", 1, OBJ)]) == [True, True]
    await st.close()
    st = await PageStore.open(store_dir, cfg())
    assert await st.delete_many(["K"]) == [True]
    await st.close()
    assert sorted(rebuild_records(store_dir, SEG, 16)[0]) == ["L"]
