"""Processes share: one writer, read-only followers in other processes that see new commits."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import numpy as np

from conftest import ROOT, KiB, MiB, payload, small_config
from umbp_nvme.store import PageStore

PRELUDE = f"""
import asyncio, json, os, random, sys, time
import numpy as np
sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
from conftest import payload, small_config
from umbp_nvme.store import PageStore
"""

FOLLOWER = PRELUDE + r"""
async def main(path, want):
    st = await PageStore.open(path, small_config(), readonly=True)
    seen = {}
    deadline = time.monotonic() + 20
    for k in want:  # wait for each key the leader is about to write
        while not await st.exists_many([k]) == [True]:
            assert time.monotonic() < deadline, f"never saw {k}"
            await asyncio.sleep(0.01)
        out = np.zeros(64 * 1024, np.uint8)
        ok = (await st.get_many([k], [out]))[0]
        seen[k] = ok and bytes(out) == bytes(payload(k, 64 * 1024))
        print(json.dumps({"key": k, "ok": seen[k]}), flush=True)
    await st.close()

asyncio.run(main(sys.argv[1], sys.argv[2:]))
"""

SECOND_WRITER = PRELUDE + r"""
from umbp_nvme.errors import StoreLockedError
async def main(path):
    try:
        await PageStore.open(path, small_config())
        print("opened")
    except StoreLockedError as e:
        print("locked:", e)
asyncio.run(main(sys.argv[1]))
"""

RACER = PRELUDE + r"""
async def main(path, n_keys, seconds):
    st = await PageStore.open(path, small_config(verify_crc=False), readonly=True)  # generations alone
    rng = random.Random(7)
    hits = wrong = misses = 0
    end = time.monotonic() + seconds
    # past `seconds`, on until 20 hits (up to 60 s more): a loaded machine's few gets still see bytes
    while time.monotonic() < end or (hits < 20 and time.monotonic() < end + 60):
        keys = [f"w{rng.randrange(n_keys)}" for _ in range(16)]
        outs = [np.zeros(64 * 1024, np.uint8) for _ in keys]
        for k, o, ok in zip(keys, outs, await st.get_many(keys, outs)):
            if ok:
                hits += 1
                wrong += bytes(o) != bytes(payload(k, 64 * 1024))
            else:
                misses += 1
    print(json.dumps({"hits": hits, "wrong": wrong, "misses": misses}), flush=True)
    await st.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
"""


def _spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


async def _wait(p: subprocess.Popen, timeout: float = 60) -> str:
    for _ in range(int(timeout / 0.02)):
        if p.poll() is not None:
            break
        await asyncio.sleep(0.02)
    else:
        p.kill()
    out, err = p.communicate()
    assert p.returncode == 0, err[-2000:]
    return out


async def test_follower_process_sees_new_commits_while_running(store_dir):
    st = await PageStore.open(store_dir, small_config())
    keys = [f"lead{i}" for i in range(6)]
    p = _spawn(FOLLOWER, store_dir, *keys)
    for k in keys:  # one commit at a time: the follower must pick up each while it runs
        await asyncio.sleep(0.05)
        assert await st.put_many([k], [payload(k, 64 * KiB)]) == [True]
    lines = [json.loads(x) for x in (await _wait(p)).splitlines()]
    assert [x["key"] for x in lines] == keys and all(x["ok"] for x in lines)
    await st.close()


async def test_second_writer_in_another_process_gets_a_clear_error(store_dir):
    st = await PageStore.open(store_dir, small_config())
    out = await _wait(_spawn(SECOND_WRITER, store_dir))
    assert out.startswith("locked:") and f"pid {os.getpid()}" in out and "read-only" in out
    await st.close()
    out = await _wait(_spawn(SECOND_WRITER, store_dir))
    assert out.strip() == "opened"


async def test_reader_racing_eviction_and_reuse_gets_misses_never_other_bytes(store_dir):
    # 2 MiB of 64 KiB objects = 32 slots; 600 keys churn through them while a follower reads
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=2 * MiB, ssd_segment_size_bytes=1 * MiB))
    n_keys = 600
    await st.put_many(["w0"], [payload("w0", 64 * KiB)])
    p = _spawn(RACER, store_dir, str(n_keys), "3")
    i = 1
    while p.poll() is None and i < 50_000:
        ks = [f"w{(i + j) % n_keys}" for j in range(4)]
        await st.put_many(ks, [payload(k, 64 * KiB) for k in ks])
        if i % 3 == 0:
            await st.delete_many([f"w{(i * 7) % n_keys}"])
        i += 4
        await asyncio.sleep(0)
    r = json.loads(await _wait(p))
    assert r["wrong"] == 0, r
    assert r["hits"] > 0 and st.stats()["evictions"] > 100, (r, st.stats()["evictions"])
    await st.close()


async def test_follower_in_this_process_shares_the_index(store_dir):
    st = await PageStore.open(store_dir, small_config())
    ro = await PageStore.open(store_dir, small_config(), readonly=True)
    assert await ro.exists_many(["a"]) == [False]
    await st.put_many(["a"], [payload("a", 4096)])
    assert await ro.exists_prefix(["a", "b"]) == 1
    out = np.zeros(4096, np.uint8)
    assert await ro.get_many(["a"], [out]) == [True] and bytes(out) == bytes(payload("a", 4096))
    await ro.close()
    await st.close()
