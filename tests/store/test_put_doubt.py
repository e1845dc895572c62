"""A put batch whose index commit outlives io_timeout_s (or whose call is cancelled during it) is in
doubt (put_doubt.py): answered False, its slots kept out of use until a later commit settles it:
adopted (served, its right bytes) when the commit landed, freed when it did not. Before this its
slots stayed out of use until a restart.

The stall is a ``StoreHooks.commit`` given at open that raises asyncio.TimeoutError for puts, either
before committing ("lost": it never lands) or after ("landed": it landed late). Every check
reads real bytes back, also after a reopen.
"""

from __future__ import annotations

import asyncio

import pytest

from conftest import payload, small_config
from support.paged import OBJ, get_checked, page_keys
from support.waits import until
from umbp_nvme.store import PageStore
from umbp_nvme.store.hooks import StoreHooks



_keys, _get = page_keys, get_checked


async def _put(st, keys):
    return await st.put_many(keys, [payload(k, OBJ) for k in keys])


async def _open_with_doubt(root, stuck_puts, keys):
    """A store whose put of ``keys`` landed in the index but is in doubt (answered False)."""
    st = await PageStore.open(root, small_config(), hooks=stuck_puts.hooks)
    stuck_puts[0] = "landed"
    assert await _put(st, keys) == [False] * len(keys)
    stuck_puts[0] = None
    return st


class Mode(list):
    """``[mode]`` a hook reads at each call; ``hooks`` goes to PageStore.open."""

    hooks: StoreHooks


@pytest.fixture
def stuck_puts():
    """``mode[0]``: None (commits work), "lost" (a put's commit times out without landing) or
    "landed" (it lands, then times out)."""
    mode = Mode([None])

    async def commit(real, store, puts, deletes):
        if puts and mode[0] == "lost":
            raise asyncio.TimeoutError
        if puts and mode[0] == "landed":
            await real(puts, deletes)
            raise asyncio.TimeoutError
        return await real(puts, deletes)

    mode.hooks = StoreHooks(commit=commit)
    return mode


@pytest.mark.parametrize("durability", ["relaxed", "strict"])
async def test_a_put_whose_commit_timed_out_without_landing_gives_its_slots_back(tmp_path, stuck_puts, durability):
    root = str(tmp_path / "store")
    cfg = small_config(ssd_durability_mode=durability)
    st = await PageStore.open(root, cfg, hooks=stuck_puts.hooks)
    a, b, c = _keys(2, "a"), _keys(2, "b"), _keys(2, "c")
    assert await _put(st, a) == [True] * 4
    stuck_puts[0] = "lost"
    assert await _put(st, b) == [False] * 4
    assert st.exists_many_nowait(b) == [False] * 4
    assert st.delete_pending(b) == [True] * 4  # it may still land: not settled
    assert st.stats()["bytes_used"] == 8 * OBJ  # its slots are out of use, not free
    stuck_puts[0] = None
    assert await _put(st, c) == [True] * 4  # a commit after it settles it: not landed, slots back
    assert st.stats()["bytes_used"] == 8 * OBJ
    assert st.delete_pending(b) == [False] * 4
    res, wrong = await _get(st, a + b + c)
    assert wrong == 0 and res == [True] * 4 + [False] * 4 + [True] * 4
    assert await _put(st, b) == [True] * 4  # put again: written anew
    await st.close()
    st = await PageStore.open(root, cfg, hooks=stuck_puts.hooks)
    res, wrong = await _get(st, a + b + c)
    assert wrong == 0 and res == [True] * 12
    assert st.stats()["bytes_used"] == 12 * OBJ
    await st.close()


async def test_a_put_whose_commit_landed_late_is_adopted_with_its_bytes(tmp_path, stuck_puts):
    root = str(tmp_path / "store")
    st = await PageStore.open(root, small_config(), hooks=stuck_puts.hooks)
    a, b = _keys(2, "a"), _keys(2, "b")
    stuck_puts[0] = "landed"
    assert await _put(st, a) == [False] * 4
    assert st.exists_many_nowait(a) == [False] * 4  # not known yet
    stuck_puts[0] = None
    assert await _put(st, b) == [True] * 4  # settles it: landed, so its objects are served
    res, wrong = await _get(st, a + b)
    assert wrong == 0 and res == [True] * 8
    assert st.stats()["bytes_used"] == 8 * OBJ and st.stats()["objects"] == 8
    assert st.delete_pending(a) == [True] * 4  # stored
    assert await st.delete_many(a[:2]) == [True, True]
    assert st.stats()["bytes_used"] == 6 * OBJ
    await st.close()
    st = await PageStore.open(root, small_config(), hooks=stuck_puts.hooks)
    res, wrong = await _get(st, a + b)
    assert wrong == 0 and res == [False, False] + [True] * 6
    await st.close()


async def test_a_delete_of_a_key_whose_put_is_in_doubt_settles_it(tmp_path, stuck_puts):
    root = str(tmp_path / "store")
    a = _keys(2, "a")
    st = await _open_with_doubt(root, stuck_puts, a)
    assert await st.delete_many(a) == [True] * 4  # settled (landed, adopted), then deleted
    assert st.delete_pending(a) == [False] * 4
    assert st.stats()["bytes_used"] == 0
    await st.close()
    st = await PageStore.open(root, small_config(), hooks=stuck_puts.hooks)
    assert st.exists_many_nowait(a) == [False] * 4
    await st.close()


async def test_a_re_put_while_in_doubt_keeps_the_new_copy(tmp_path, stuck_puts):
    root = str(tmp_path / "store")
    a = _keys(2, "a")
    st = await _open_with_doubt(root, stuck_puts, a)
    assert await _put(st, a) == [True] * 4  # written anew; its commit overwrote the one in doubt
    assert st.stats()["bytes_used"] == 4 * OBJ  # the doubtful slots came back
    res, wrong = await _get(st, a)
    assert wrong == 0 and res == [True] * 4
    await st.close()
    st = await PageStore.open(root, small_config(), hooks=stuck_puts.hooks)
    res, wrong = await _get(st, a)
    assert wrong == 0 and res == [True] * 4 and st.stats()["bytes_used"] == 4 * OBJ
    await st.close()


async def test_a_put_cancelled_during_its_commit_is_in_doubt_and_settles(tmp_path):
    root = str(tmp_path / "store")
    a, b = _keys(2, "a"), _keys(2, "b")
    entered, gate = asyncio.Event(), asyncio.Event()

    async def commit(real, store, puts, deletes):
        if puts and not gate.is_set():
            entered.set()
            await gate.wait()
        return await real(puts, deletes)

    st = await PageStore.open(root, small_config(), hooks=StoreHooks(commit=commit))
    task = asyncio.ensure_future(_put(st, a))
    await asyncio.wait_for(entered.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert st.stats()["bytes_used"] == 4 * OBJ and st.delete_pending(a) == [True] * 4
    gate.set()
    assert await _put(st, b) == [True] * 4
    assert st.stats()["bytes_used"] == 4 * OBJ and st.delete_pending(a) == [False] * 4
    res, wrong = await _get(st, a + b)
    assert wrong == 0 and res == [False] * 4 + [True] * 4
    await st.close()


async def test_a_put_cancelled_waiting_for_the_commit_lock_frees_its_slots_at_once(tmp_path):
    root = str(tmp_path / "store")
    st = await PageStore.open(root, small_config())
    a = _keys(2, "a")
    async with st.writer.commit_lock:  # another commit holds the lock: this put never reaches its commit
        task = asyncio.ensure_future(_put(st, a))
        assert await until(lambda: st.writer.commit_lock._waiters, 30), "the put never waited for the commit lock"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert st.stats()["bytes_used"] == 0  # nothing was committed: nothing in doubt
    assert st.delete_pending(a) == [False] * 4
    assert await _put(st, a) == [True] * 4
    res, wrong = await _get(st, a)
    assert wrong == 0 and res == [True] * 4
    await st.close()


async def test_close_settles_a_put_in_doubt(tmp_path, stuck_puts):
    root = str(tmp_path / "store")
    st = await PageStore.open(root, small_config(), hooks=stuck_puts.hooks)
    a = _keys(2, "a")
    stuck_puts[0] = "lost"
    assert await _put(st, a) == [False] * 4
    stuck_puts[0] = None
    await st.close()
    st = await PageStore.open(root, small_config(), hooks=stuck_puts.hooks)
    res, wrong = await _get(st, a)
    assert wrong == 0 and st.stats()["bytes_used"] == OBJ * sum(res)
    await st.close()


@pytest.mark.parametrize("mode", ["lost", "landed"])
async def test_a_store_filled_with_puts_in_doubt_settles_them_to_make_room(tmp_path, stuck_puts, mode):
    """Slots in doubt are not rows eviction can take: a put that finds no room settles them first
    (before, such a store refused every put until a delete or close)."""
    st = await PageStore.open(str(tmp_path / "store"), small_config(ssd_capacity_bytes=2 << 20), hooks=stuck_puts.hooks)
    stuck_puts[0] = mode
    for i in range(12):  # 12 x 256 KiB: more than the store holds, every slot in doubt
        assert await _put(st, _keys(8, f"d{i}_")) == [False] * 16
    if mode == "lost":
        assert st.stats()["puts_in_doubt_bytes"] > (1 << 20) and st.stats()["objects"] == 0
    else:  # settled while filling: what landed became rows (served with its own bytes), then evicted
        old = [k for i in range(12) for k in _keys(8, f"d{i}_")]
        res, wrong = await _get(st, old)
        assert wrong == 0 and 0 < sum(res) < len(old)
    stuck_puts[0] = None
    fresh = _keys(4, "fresh")
    assert await _put(st, fresh) == [True] * 8  # room made by settling the doubts
    res, wrong = await _get(st, fresh)
    assert wrong == 0 and res == [True] * 8
    assert st.stats()["puts_in_doubt_bytes"] == 0
    await st.close()
