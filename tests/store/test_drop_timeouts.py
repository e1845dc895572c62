"""A delete whose index commit outlives io_timeout_s is in doubt (store/deletes.py): it is
never acknowledged, never settled as an owed delete (owed_deletes.apply at open, the probe's
re-admission), and a later delete of the key retries it.

The stall is a ``StoreHooks.commit`` handed to the store at open that raises asyncio.TimeoutError
for deletes on the chosen roots without committing (what a commit stuck on a hung drive past io_timeout_s looks like
to its caller: it may land later, or never). Every check reads real bytes back after a reopen.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import payload, small_config
from support.drive_stores import degrade_by_eio, filled_writer
from support.waits import until
from support.paged import OBJ, get_checked, page_keys
from umbp_nvme.store import PageStore, owed_deletes
from umbp_nvme.store.hooks import StoreHooks



_keys, _get = page_keys, get_checked


class Roots(set):
    """Store paths a hook acts on while listed; ``hooks`` goes to PageStore.open."""

    hooks: StoreHooks


@pytest.fixture
def stuck_deletes():
    """Roots (store paths) whose delete commits time out without landing while listed."""
    stuck = Roots()

    async def commit(real, store, puts, deletes):
        if deletes and store.path in stuck:
            raise asyncio.TimeoutError
        return await real(puts, deletes)

    stuck.hooks = StoreHooks(commit=commit)
    return stuck


async def _stored(tmp_path, pages: int, hooks=None):
    """(root, an open store, the keys of ``pages`` pages put into it: two objects each)."""
    root = str(tmp_path / "store")
    st = await PageStore.open(root, small_config(), hooks=hooks)
    keys = _keys(pages)
    assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 2 * pages
    return root, st, keys


async def test_a_delete_whose_commit_times_out_is_not_acknowledged_and_a_retry_finishes_it(tmp_path, stuck_deletes):
    root, st, keys = await _stored(tmp_path, 4, hooks=stuck_deletes.hooks)
    stuck_deletes.add(st.path)
    assert await st.delete_many(keys[:2]) == [False, False]
    assert st.exists_many_nowait(keys[:2]) == [False, False]  # hidden: the commit may still land
    assert st.delete_pending(keys) == [True] * 8  # but the delete is not done
    assert st.stats()["deletes"] == 0
    stuck_deletes.clear()
    assert await st.delete_many(keys[:2]) == [True, True]  # the retry commits it
    assert st.delete_pending(keys) == [False, False] + [True] * 6
    assert st.stats()["deletes"] == 2
    await st.close()
    st = await PageStore.open(root, small_config(), hooks=stuck_deletes.hooks)
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [False, False] + [True] * 6
    await st.close()


async def test_a_put_after_a_delete_in_doubt_keeps_the_new_copy_through_a_retried_delete(tmp_path, stuck_deletes):
    root, st, k = await _stored(tmp_path, 1, hooks=stuck_deletes.hooks)
    stuck_deletes.add(st.path)
    assert await st.delete_many(k) == [False, False]
    stuck_deletes.clear()
    assert await st.put_many(k, [payload(x, OBJ) for x in k]) == [True, True]  # written anew
    res, wrong = await _get(st, k)
    assert res == [True, True] and wrong == 0
    assert await st.delete_many(k) == [True, True]  # both the new entry and the row in doubt go
    assert st.delete_pending(k) == [False, False] and st.stats()["objects"] == 0
    await st.close()
    st = await PageStore.open(root, small_config(), hooks=stuck_deletes.hooks)
    assert st.exists_many_nowait(k) == [False, False] and st.stats()["objects"] == 0
    await st.close()


async def _owing_writer(tmp_path, probe_interval_s: float, hooks=None):
    """A writer over 2 drives whose drive 1 answers EIO to reads (degraded; its probe cannot read
    back until ``plan`` is cleared), owing the delete of ``gone`` (durably, in drive 0's log).
    Returns (roots, st, plan, gone, kept)."""
    roots, plan, st, keys = await filled_writer(tmp_path, 40, probe_interval_s=probe_interval_s, hooks=hooks)
    on1 = [k for k, d in zip(keys, st.drive_of(keys)) if d == 1]
    await degrade_by_eio(plan, st, roots[1], on1)
    assert st.stats()["drives"][1]["state"] == "degraded"
    gone, kept = on1[:4], on1[4:]
    await st.delete_many(gone)  # owed, recorded on drive 0 before it returns
    assert owed_deletes.load(roots[:1]).keys == {roots[1]: set(gone)}
    return roots, st, plan, gone, kept


async def test_owed_deletes_whose_commit_times_out_at_open_are_not_settled(tmp_path, stuck_deletes):
    roots, st, _, gone, kept = await _owing_writer(tmp_path, 60, hooks=stuck_deletes.hooks)
    await st.close()
    stuck_deletes.add(roots[1])  # the open applies the owed deletes on drive 1: their commit times out
    st = await PageStore.open(roots, small_config(), probe_interval_s=60, hooks=stuck_deletes.hooks)
    assert st.stats()["drives"][1]["state"] == "degraded"  # it owes deletes it could not apply
    res, wrong = await _get(st, gone)
    assert res == [False] * 4 and wrong == 0
    await st.close()
    assert owed_deletes.load(roots).keys.get(roots[1]) == set(gone)  # still owed
    stuck_deletes.clear()
    st = await PageStore.open(roots, small_config(), probe_interval_s=60, hooks=stuck_deletes.hooks)
    res, wrong = await _get(st, gone + kept)
    assert wrong == 0 and res == [False] * 4 + [True] * len(kept)  # never served again
    assert [r["state"] for r in st.stats()["drives"]] == ["healthy", "healthy"]
    await st.close()
    assert not owed_deletes.load(roots).owes(roots[1])


async def test_the_probe_readmits_only_once_a_timed_out_owed_delete_is_committed(tmp_path, stuck_deletes):
    roots, st, plan, gone, kept = await _owing_writer(tmp_path, 0.05, hooks=stuck_deletes.hooks)
    stuck_deletes.add(roots[1])  # the probe's settle step: its delete commits time out
    plan.set_rules([])  # drive 1 reads back again
    await asyncio.sleep(0.6)  # about 10 probes, each retrying the owed deletes
    assert st.stats()["drives"][1]["state"] == "degraded"
    assert st.health[1].deletes_owed == set(gone)
    assert owed_deletes.load(roots[:1]).keys == {roots[1]: set(gone)}  # no settled line
    stuck_deletes.clear()
    assert await until(lambda: st.stats()["drives"][1]["state"] == "healthy", 10)
    await st.close()
    st = await PageStore.open(roots, small_config(), probe_interval_s=60, hooks=stuck_deletes.hooks)
    res, wrong = await _get(st, gone + kept)
    assert wrong == 0 and res == [False] * 4 + [True] * len(kept)
    await st.close()


async def test_a_cancelled_delete_is_in_doubt_and_a_retry_finishes_it(tmp_path):
    """SyncPageStore cancels a call past its bound: a drop cancelled before its commit is in doubt too."""
    gate, entered = asyncio.Event(), asyncio.Event()

    async def slow_tombstone(real, store, rows):
        entered.set()
        await gate.wait()
        return await real(rows)

    root, st, keys = await _stored(tmp_path, 2, hooks=StoreHooks(tombstone=slow_tombstone))
    task = asyncio.ensure_future(st.delete_many(keys[:2]))
    await asyncio.wait_for(entered.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert st.exists_many_nowait(keys) == [False, False, True, True]
    assert st.delete_pending(keys) == [True] * 4
    gate.set()
    assert await st.delete_many(keys[:2]) == [True, True]
    assert st.delete_pending(keys) == [False, False, True, True]
    await st.close()
    st = await PageStore.open(root, small_config())
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [False, False, True, True]
    await st.close()


async def test_an_eviction_retries_the_drops_in_doubt_and_their_slots_come_back(tmp_path, stuck_deletes):
    root = str(tmp_path / "store")
    cfg = small_config(ssd_capacity_bytes=4 << 20)
    st = await PageStore.open(root, cfg, hooks=stuck_deletes.hooks)
    first = _keys(8, "a")
    assert await st.put_many(first, [payload(k, OBJ) for k in first]) == [True] * 16
    stuck_deletes.add(st.path)
    assert await st.delete_many(first[:4]) == [False] * 4
    used = st.stats()["bytes_used"]
    assert used == 16 * OBJ  # the slots in doubt stay out of use
    stuck_deletes.clear()
    n = 0
    while st.stats()["evictions"] == 0 and n < 400:  # fill until the store evicts
        more = _keys(8, f"b{n}_")
        assert await st.put_many(more, [payload(k, OBJ) for k in more]) == [True] * 16
        n += 1
    assert st.stats()["evictions"] > 0
    assert st.delete_pending(first[:4]) == [False] * 4  # retried with the eviction: committed
    await st.close()
    st = await PageStore.open(root, cfg, hooks=stuck_deletes.hooks)
    assert st.exists_many_nowait(first[:4]) == [False] * 4
    await st.close()


# ---------------------------------------------------------------- a tombstone that landed, a commit that failed


@pytest.fixture
def failing_deletes():
    """Roots whose delete commits fail (an LMDB error: nothing committed) after the tombstones
    (the cleared records in the segments) landed."""
    failing = Roots()

    async def commit(real, store, puts, deletes):
        if deletes and store.path in failing:
            return False
        return await real(puts, deletes)

    failing.hooks = StoreHooks(commit=commit)
    return failing


def _drop_index(root: str) -> None:
    import os

    from umbp_nvme.store.index import INDEX_FILE

    os.unlink(os.path.join(root, INDEX_FILE))  # the next open rebuilds it from the segments' records


@pytest.mark.parametrize("durability", ["relaxed", "strict"])
async def test_a_failed_delete_whose_tombstone_landed_is_never_served_again(tmp_path, failing_deletes, durability):
    """The answer False and what is served must agree before and after a restart with a rebuild:
    the page is no longer served once its record on disk is cleared (the drop is finished later)."""
    root = str(tmp_path / "store")
    cfg = small_config(ssd_durability_mode=durability)
    st = await PageStore.open(root, cfg, hooks=failing_deletes.hooks)
    keys = _keys(4)
    assert await st.put_many(keys, [payload(k, OBJ) for k in keys]) == [True] * 8
    failing_deletes.add(st.path)
    assert await st.delete_many(keys[:2]) == [False, False]
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [False, False] + [True] * 6  # not served here ...
    assert st.exists_many_nowait(keys[:2]) == [False, False]
    assert st.delete_pending(keys[:2]) == [True, True]  # ... and not settled
    assert st.stats()["bytes_used"] == 8 * OBJ  # its slots stay out of use until the drop lands
    await st.close()  # the retry at close fails too
    _drop_index(root)
    st = await PageStore.open(root, cfg, hooks=failing_deletes.hooks)
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [False, False] + [True] * 6  # ... nor after a rebuild
    await st.close()


async def test_a_failed_delete_is_finished_by_a_retry_or_at_close(tmp_path, failing_deletes):
    root, st, keys = await _stored(tmp_path, 4, hooks=failing_deletes.hooks)
    failing_deletes.add(st.path)
    assert await st.delete_many(keys[:4]) == [False] * 4
    failing_deletes.clear()
    assert await st.delete_many(keys[:2]) == [True, True]  # retried: the drop lands
    assert st.delete_pending(keys[:4]) == [False, False, True, True]
    assert st.stats()["bytes_used"] == 6 * OBJ
    await st.close()  # finishes the other drop in doubt
    st = await PageStore.open(root, small_config(), hooks=failing_deletes.hooks)  # the index is kept: no rebuild
    res, wrong = await _get(st, keys)
    assert wrong == 0 and res == [False] * 4 + [True] * 4
    assert st.stats()["bytes_used"] == 4 * OBJ
    await st.close()
