"""Admission in the store (store/admit_gate.py): a declined put answers True, stores nothing,
counts in put_declined (never put_failed), and a page's components are decided together."""

from __future__ import annotations

import hashlib

import numpy as np

from umbp_nvme.store import PageStore
from conftest import small_config

KiB = 1 << 10


def page(i: int) -> str:
    return hashlib.sha256(b"adm-%d" % i).hexdigest()


def comps(pages: list[str]) -> list[str]:
    return [p + s for p in pages for s in ("_0_k", "_0_v")]


def bufs(keys: list[str], version: int = 0) -> list[np.ndarray]:
    return [np.full(16 * KiB, (hash(k) + version) & 0xFF, np.uint8) for k in keys]


async def test_second_write_policy_declines_a_first_put_and_stores_the_second(store_dir):
    st = await PageStore.open(store_dir, small_config(admission_policy="second"))
    keys = comps([page(0), page(1)])
    assert await st.put_many(keys, bufs(keys)) == [True] * 4
    assert await st.exists_many(keys) == [False] * 4
    s = st.stats()
    assert (s["put_declined"], s["put_failed"], s["objects"]) == (4, 0, 0)
    data = bufs(keys, 1)
    assert await st.put_many(keys, data) == [True] * 4
    assert await st.exists_many(keys) == [True] * 4
    outs = [np.zeros(16 * KiB, np.uint8) for _ in keys]
    assert await st.get_many(keys, outs) == [True] * 4
    assert all(np.array_equal(o, d) for o, d in zip(outs, data))  # the bytes of the write that was kept
    assert st.stats()["put_declined"] == 4
    await st.close()


async def test_components_of_a_page_share_one_decision(store_dir):
    st = await PageStore.open(store_dir, small_config(admission_policy="second"))
    a, b = page(10), page(11)
    await st.put_many(comps([a]), bufs(comps([a])))  # a offered once
    keys = comps([a, b])  # a's second offer, b's first
    assert await st.put_many(keys, bufs(keys)) == [True] * 4
    assert await st.exists_many(keys) == [True, True, False, False]
    await st.close()


async def test_all_auto_and_a_cold_adaptive_store_write_every_page(store_dir):
    for policy in ("all", "auto", "adaptive"):
        st = await PageStore.open(f"{store_dir}/{policy}", small_config(admission_policy=policy))
        keys = comps([page(20), page(21)])
        assert await st.put_many(keys, bufs(keys)) == [True] * 4
        assert await st.exists_many(keys) == [True] * 4
        assert st.stats().get("put_declined", 0) == 0
        await st.close()


def test_the_sglang_backend_store_is_adaptive_unless_configured_otherwise():
    from umbp_nvme.config import StoreConfig
    from umbp_nvme.sglang.stores import backup_config

    assert StoreConfig().admission_policy == "auto"
    assert backup_config(StoreConfig()).admission_policy == "adaptive"
    assert backup_config(StoreConfig(admission_policy="all")).admission_policy == "all"
