"""Serving before the index is loaded (store/loading.py, issue 36).

A store whose index file is at least ``ssd_background_open_bytes`` returns from open at once and
loads behind it. While it loads: lookups miss (never a wrong byte), puts wait a bounded time then
answer False, deletes wait and still remove keys not loaded yet, close() is clean. The tests hold
the load at one of its steps through ``StoreHooks.load_step``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from conftest import ROOT, payload, small_config
from umbp_nvme.store import PageStore, put_path
from umbp_nvme.store.hooks import StoreHooks
from umbp_nvme.store.index import INDEX_FILE

SIZE = 4096
BG = dict(ssd_background_open_bytes=0)  # every existing store loads in the background


def keys_of(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


async def fill(path: str, keys: list[str]) -> None:
    st = await PageStore.open(path, small_config())
    try:
        assert all(await st.put_many(keys, [payload(k, SIZE) for k in keys]))
    finally:
        await st.close()


class Hold:
    """A load_step hook that holds the load at ``step`` until released."""

    def __init__(self, step: str):
        self.step, self.reached, self.go = step, threading.Event(), threading.Event()

    def __call__(self, name: str) -> None:
        if name == self.step:
            self.reached.set()
            assert self.go.wait(30), "the test never released the load"


async def read_back(st, keys: list[str]) -> list[bool]:
    outs = [np.zeros(SIZE, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    return [ok and bytes(o) == bytes(payload(k, SIZE)) for k, ok, o in zip(keys, res, outs)]


@pytest.mark.parametrize("step", ["index", "rows"])
def test_writer_misses_while_loading_and_serves_everything_after(tmp_path, step):
    path, keys = str(tmp_path / "s"), keys_of(60)

    async def run():
        await fill(path, keys)
        hold = Hold(step)
        st = await PageStore.open(path, small_config(**BG), hooks=StoreHooks(load_step=hold))
        try:
            assert await asyncio.to_thread(hold.reached.wait, 10)
            # open returned while the load is held at its step (it never finishes without hold.go): no time bound needed
            assert st.stats()["loading"] is True and st.stats()["index_loading"] == 1  # the metric's number
            assert await st.exists_many(keys[:4]) == [False] * 4
            assert await st.exists_prefix(keys) == 0
            assert await read_back(st, keys[:4]) == [False] * 4
            assert st.object_count() == 0 and st.keys() == [] and st.locate(keys[:1]) == [None]
            assert st.stats()["loading_misses"] == 4 + 60 + 4
            t = time.perf_counter()
            assert await st.put_many(["new"], [payload("new", SIZE)]) == [False]  # bounded wait, then False
            assert 0.5 < time.perf_counter() - t < 30  # it waited (PUT_WAIT_S = 1 s), and it did not hang
            assert st.stats()["puts_refused_loading"] == 1
            hold.go.set()
            assert await st.wait_loaded() is True
            assert st.stats()["loading"] is False and st.stats()["index_loading"] == 0 and st.object_count() == 60
            assert await st.exists_prefix(keys) == 60
            assert all(await read_back(st, keys))
            assert await st.put_many(["new"], [payload("new", SIZE)]) == [True]
        finally:
            hold.go.set()
            await st.close()
        st = await PageStore.open(path, small_config())
        try:
            assert st.object_count() == 61 and all(await read_back(st, keys + ["new"]))
        finally:
            await st.close()

    asyncio.run(run())


def test_a_put_during_the_load_lands_when_the_load_ends_within_its_wait(tmp_path, monkeypatch):
    path, keys = str(tmp_path / "s"), keys_of(20)
    # the wait made long: the load's last steps after the release must not race a 1-s bound on a loaded machine
    monkeypatch.setattr(put_path, "PUT_WAIT_S", 30.0)

    async def run():
        await fill(path, keys)
        hold = Hold("rows")
        st = await PageStore.open(path, small_config(**BG), hooks=StoreHooks(load_step=hold))
        try:
            assert await asyncio.to_thread(hold.reached.wait, 10)
            threading.Timer(0.2, hold.go.set).start()
            assert await st.put_many(["late"], [payload("late", SIZE)]) == [True]
            assert st.stats()["puts_refused_loading"] == 0
            assert all(await read_back(st, keys + ["late"]))
        finally:
            hold.go.set()
            await st.close()

    asyncio.run(run())


def test_a_delete_of_a_key_not_loaded_yet_still_removes_it_durably(tmp_path):
    path, keys = str(tmp_path / "s"), keys_of(40)

    async def run():
        await fill(path, keys)
        hold = Hold("index")
        st = await PageStore.open(path, small_config(**BG), hooks=StoreHooks(load_step=hold))
        try:
            assert await asyncio.to_thread(hold.reached.wait, 10)
            gone = asyncio.ensure_future(st.delete_many(keys[:5]))
            await asyncio.sleep(0.2)
            assert not gone.done()  # it waits for the load: the keys are not in the rows yet
            hold.go.set()
            assert await gone == [True] * 5
            assert await st.exists_many(keys[:6]) == [False] * 5 + [True]
        finally:
            hold.go.set()
            await st.close()
        for cfg in (small_config(), small_config(**BG)):
            st = await PageStore.open(path, cfg)
            try:
                await st.wait_loaded()
                assert await st.exists_many(keys[:6]) == [False] * 5 + [True]
                assert st.object_count() == 35
            finally:
                await st.close()

    asyncio.run(run())


@pytest.mark.parametrize("step", ["index", "rows"])
def test_close_during_the_load_is_clean_and_keeps_everything(tmp_path, step):
    path, keys = str(tmp_path / "s"), keys_of(30)

    async def run():
        await fill(path, keys)
        hold = Hold(step)
        st = await PageStore.open(path, small_config(**BG), hooks=StoreHooks(load_step=hold))
        assert await asyncio.to_thread(hold.reached.wait, 10)
        closing = asyncio.ensure_future(st.close())
        await asyncio.sleep(0.05)
        hold.go.set()
        await closing
        assert st.closed and await st.exists_many(keys[:2]) == [False, False]
        # held before the rows: the load stops; held at the rows: it finishes and close() is a clean one
        assert st.stats()["loading"] == ("failed: stopped by close()" if step == "index" else False)
        st = await PageStore.open(path, small_config())
        try:
            assert st.object_count() == 30 and all(await read_back(st, keys))
        finally:
            await st.close()

    asyncio.run(run())


def test_damage_found_by_the_background_load_is_rebuilt_and_nothing_wrong_was_served(tmp_path):
    path, keys = str(tmp_path / "s"), keys_of(200)

    async def run():
        await fill(path, keys)
        ipath = os.path.join(path, INDEX_FILE)
        with open(ipath, "r+b") as f:  # zero every page past the meta pages: the walk must refuse it
            size = os.fstat(f.fileno()).st_size
            f.seek(2 * 4096)
            f.write(bytes(size - 2 * 4096))
        st = await PageStore.open(path, small_config(**BG))
        try:
            before = await st.exists_many(keys)
            assert await st.wait_loaded() is True
            assert all(await read_back(st, keys))  # rebuilt from the records in the segments
            assert not any(before) or all(await read_back(st, [k for k, b in zip(keys, before) if b]))
        finally:
            await st.close()
        aside = [n for n in os.listdir(path) if n.startswith(INDEX_FILE) and n not in (INDEX_FILE, INDEX_FILE + "-lock")]
        assert aside, os.listdir(path)  # the damaged file was moved aside, as a synchronous open does

    asyncio.run(run())


def test_reader_misses_while_its_index_opens_then_follows_the_writer(tmp_path):
    path, keys = str(tmp_path / "s"), keys_of(50)

    async def run():
        await fill(path, keys)
        hold = Hold("index")
        r = await PageStore.open(path, small_config(**BG), readonly=True, hooks=StoreHooks(load_step=hold))
        try:
            assert await asyncio.to_thread(hold.reached.wait, 10)
            assert r.stats()["loading"] is True
            assert await r.exists_prefix(keys) == 0 and await r.exists_many(keys[:2]) == [False, False]
            assert await read_back(r, keys[:3]) == [False] * 3
            hold.go.set()
            assert await r.wait_loaded() is True
            assert await r.exists_prefix(keys) == 50 and all(await read_back(r, keys[:10]))
        finally:
            hold.go.set()
            await r.close()
        hold = Hold("index")
        r = await PageStore.open(path, small_config(**BG), readonly=True, hooks=StoreHooks(load_step=hold))
        assert await asyncio.to_thread(hold.reached.wait, 10)
        closing = asyncio.ensure_future(r.close())
        await asyncio.sleep(0.05)
        hold.go.set()
        await closing
        assert r.closed and r.stats()["loading"] == "failed: stopped by close()"

    asyncio.run(run())


CHILD = r"""
import asyncio, os, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from conftest import payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store.hooks import StoreHooks

def step(name, delay, kill_at):
    if name == kill_at:
        os.kill(os.getpid(), 9)  # killed at exactly this step of the background load
    time.sleep(delay)  # widen each step: the parent's kills land inside

async def main(path, ack_path, rnd, delay, kill_at):
    hooks = StoreHooks(load_step=lambda name: step(name, delay, kill_at))
    st = await PageStore.open(path, small_config(ssd_background_open_bytes=0), hooks=hooks)
    fd = os.open(ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    print("ready", flush=True)
    gone = [f"k{{(int(rnd) * 3 + j) % 300}}" for j in range(3)]
    res = await st.delete_many(gone)  # waits for the load: keys not loaded yet
    os.write(fd, "".join(f"-{{k}}\n" for k, ok in zip(gone, res) if ok).encode())
    new = [f"n{{rnd}}-{{j}}" for j in range(4)]
    res = await st.put_many(new, [payload(k, 4096) for k in new])
    os.write(fd, "".join(f"+{{k}}\n" for k, ok in zip(new, res) if ok).encode())
    await st.close()

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]))
"""


def test_kills_during_the_background_load_lose_nothing_durable_and_serve_nothing_wrong(tmp_path):
    path, ack = str(tmp_path / "s"), str(tmp_path / "acks")
    keys = keys_of(300)
    asyncio.run(fill(path, keys))
    rng = random.Random(36)
    script = CHILD.format(root=ROOT, tests=os.path.join(ROOT, "tests"))
    deleted: set[str] = set()
    added: set[str] = set()
    for rnd in range(10):
        kill_at = ("index", "rows")[rnd] if rnd < 2 else "-"  # first at each step, then at random moments
        p = subprocess.Popen([sys.executable, "-c", script, path, ack, str(rnd), "0.05", kill_at], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            ready = p.stdout.readline().strip()
            if kill_at != "-":  # it kills itself at that step (before or after it says ready)
                assert p.wait(30) == -signal.SIGKILL
            else:
                assert ready == b"ready"
                time.sleep(rng.uniform(0.0, 0.2) if rnd % 2 else rng.uniform(0.2, 1.5))  # inside the load, or past it
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait()
        with open(ack) if os.path.exists(ack) else open(os.devnull) as f:
            for line in f:
                if line.endswith("\n"):
                    (deleted if line[0] == "-" else added).add(line[1:-1])

        async def verify():
            st = await PageStore.open(path, small_config())
            try:
                have = set(st.keys())
                assert not (deleted & have), f"acknowledged deletes came back: {sorted(deleted & have)[:5]}"
                assert added <= have, f"acknowledged puts lost: {sorted(added - have)[:5]}"
                assert set(keys) - deleted - have == set(), "objects that were never deleted are gone"
                sample = rng.sample(sorted(have), min(60, len(have)))
                assert all(await read_back(st, sample)), "an object read back wrong"
            finally:
                await st.close()

        asyncio.run(verify())
    assert deleted or added  # some children got past the load before their kill
