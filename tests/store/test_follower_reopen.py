"""Followers that notice (issue 25, scenario 4): a read-only opener whose index the writer replaced.

A follower opened before a writer's rebuild must not go on reading the file the writer moved
aside (or that was deleted): once it checks, it serves the writer's new pages, never a page the
writer deleted or replaced, and while the new file is not finished it serves misses. The writer
runs in another process, as the leader rank does; every version of a key has its own bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, key_set_ready, payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store import index
from umbp_nvme.store.index import INDEX_FILE

OBJ = 5000
VERSIONS = (1, 2, 3)


def data(key: str, version: int) -> np.ndarray:
    return payload(f"{key}#v{version}", OBJ)


WRITER = f"""
import asyncio, json, sys
sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, "tests")!r}]
from conftest import payload, small_config
from umbp_nvme.store import PageStore, layout
from umbp_nvme.store.index import INDEX_FILE, Index
from umbp_nvme.store.rebuild import boot_id, rebuild_records
from umbp_nvme.keybytes import encode_key
import os

def data(key, version):
    return payload(f"{{key}}#v{{version}}", {OBJ})

async def apply(st, step):  # deletes first: a put of a stored key keeps the stored bytes
    assert all(await st.delete_many(step.get("delete", [])))
    puts = step.get("put", {{}})
    assert all(await st.put_many(list(puts), [data(k, v) for k, v in puts.items()]))

async def main(path):
    ipath = f"{{path}}/{{INDEX_FILE}}"
    for line in sys.stdin:  # one step per line; "ok" once done
        step = json.loads(line)
        if "state" in step:  # what a writer leaves when the machine loses power under it
            ix = Index(ipath, readonly=False, map_size=1 << 30, durable=True)
            ix.set_writer_state(step["state"].encode())
            ix.close()
        elif step.get("half_build"):  # a new index at the path, never marked: what a rebuild of an
            # older version killed before its mark left (rebuilds now mark their file before it is in place)
            m = layout.read_manifest(path)
            seg = m["layout"]["segment_bytes"]
            cap = layout.recorded_capacity_bytes(m)
            lock = layout.take_lock(path)
            keys, recs, _, _ = rebuild_records(path, seg, cap // seg)
            os.rename(ipath, ipath + ".old")
            os.unlink(ipath + "-lock")
            ix = Index(ipath, readonly=False, map_size=layout.map_size_bytes(cap), durable=True)
            ix.commit(puts=[(encode_key(k), recs[i : i + 1].tobytes()) for i, k in enumerate(keys)])
            ix.close()
            os.close(lock)
        elif step.get("open"):
            st = await PageStore.open(path, small_config())
        elif step.get("close"):
            await st.close()
        else:
            await apply(st, step)
        print("ok", flush=True)

asyncio.run(main(sys.argv[1]))
"""


class Writer:
    """A writer process that takes one step at a time and says when each is done."""

    def __init__(self, path: str):
        self.p = subprocess.Popen([sys.executable, "-c", WRITER, path], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    def do(self, **step) -> None:
        self.p.stdin.write(json.dumps(step) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if line.strip() != "ok":
            self.p.kill()
            raise AssertionError(f"writer step {step} failed: {self.p.stderr.read()[-3000:]}")

    def end(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(60) == 0, self.p.stderr.read()[-3000:]


def _open_environments(path) -> list[str]:
    """The LMDB environments this process holds on files of the store at ``path``."""
    root = os.path.realpath(path) + os.sep
    return [p for p in map(os.path.realpath, index.open_environment_paths()) if p.startswith(root)]


async def view(st, keys) -> dict:
    """Per key: the version it serves, None for a miss, "wrong" for bytes of no version of it."""
    outs = [np.zeros(OBJ, np.uint8) for _ in keys]
    got = await st.get_many(keys, outs)
    res = {}
    for k, ok, o in zip(keys, got, outs):
        res[k] = None if not ok else next((v for v in VERSIONS if np.array_equal(o, data(k, v))), "wrong")
    return res


LIVE = [f"live-{i:02d}" for i in range(12)]
REPUT = [f"reput-{i:02d}" for i in range(12)]
GONE = [f"gone-{i:02d}" for i in range(12)]
NEW = [f"new-{i:02d}" for i in range(12)]
SACRIFICE = "zz-index-damage"  # the key whose index node the damaged route breaks


async def _first_writer(path):
    st = await PageStore.open(path, small_config())
    keys = LIVE + REPUT + GONE + [SACRIFICE]
    assert all(await st.put_many(keys, [data(k, 1) for k in keys]))
    await st.close()


def _damage_a_key_in_the_index(path):
    """Change one byte of a key inside index.lmdb (in place, as bit rot would): the writer's scan finds a
    key that does not match its record's key checksum and rebuilds the index from the segments."""
    p = os.path.join(path, INDEX_FILE)
    with open(p, "r+b") as f:
        raw = f.read()
        at = raw.find(SACRIFICE.encode())
        assert at >= 0 and raw.find(SACRIFICE.encode(), at + 1) < 0
        f.seek(at + len(SACRIFICE) - 1)
        f.write(b"f")  # still the last key in order: only the checksum tells


@pytest.mark.parametrize("route", ["damaged", "deleted", "power_loss"])
async def test_follower_opened_before_a_rebuild_serves_the_new_index_never_deleted_pages(store_dir, route):
    await _first_writer(store_dir)
    follower = await PageStore.open(store_dir, small_config(), readonly=True)
    everything = LIVE + REPUT + GONE + NEW
    assert await view(follower, everything) == {k: (None if k in NEW else 1) for k in everything}
    await key_set_ready(follower)  # its exists answer from a key set of the file it opened
    w = Writer(store_dir)
    if route == "damaged":
        _damage_a_key_in_the_index(store_dir)
    elif route == "deleted":
        os.unlink(os.path.join(store_dir, INDEX_FILE))
    else:
        w.do(state="open:a-boot-before-the-power-loss")
    w.do(open=True)
    # the damaged file is kept for diagnosis; a sound one (power loss: maybe behind) is removed, and
    # the follower, which still maps it, follows the new file all the same
    assert any(f.startswith(INDEX_FILE + ".corrupt-") for f in os.listdir(store_dir)) == (route == "damaged")
    assert not os.path.exists(os.path.join(store_dir, INDEX_FILE + ".replaced"))
    w.do(delete=GONE + REPUT, put={**{k: 2 for k in REPUT}, **{k: 1 for k in NEW}})
    want = {**{k: 1 for k in LIVE}, **{k: 2 for k in REPUT}, **{k: None for k in GONE}, **{k: 1 for k in NEW}}
    assert await view(follower, everything) == want
    await key_set_ready(follower)  # a set of the new file: the old one's would answer GONE
    assert follower.stats()["key_set_builds"] == 2
    assert await follower.exists_many(GONE + NEW) == [False] * len(GONE) + [True] * len(NEW)
    assert await follower.exists_prefix(NEW + GONE) == len(NEW)
    # it goes on following the new file: later puts and deletes show at once
    w.do(delete=REPUT + LIVE[:4], put={k: 3 for k in REPUT})
    want.update({**{k: 3 for k in REPUT}, **{k: None for k in LIVE[:4]}})
    assert await view(follower, everything) == want
    assert follower.stats()["objects"] == len(LIVE) - 4 + len(REPUT) + len(NEW) + 1  # + the sacrificed key
    w.do(close=True)
    w.end()
    await follower.close()


async def test_follower_serves_misses_while_the_new_index_is_not_marked_then_follows_it(store_dir):
    await _first_writer(store_dir)
    follower = await PageStore.open(store_dir, small_config(), readonly=True)
    gone_early = await PageStore.open(store_dir, small_config(), readonly=True)
    keys = LIVE + REPUT + GONE
    assert set((await view(follower, keys)).values()) == {1}
    w = Writer(store_dir)
    w.do(half_build=True)  # the new file holds every record, committed and synced, but no writer mark
    assert set((await view(follower, keys)).values()) == {None}  # not the old file's view either
    assert await follower.exists_many(keys) == [False] * len(keys)
    late = await PageStore.open(store_dir, small_config(), readonly=True)  # a follower racing the writer's open
    assert set((await view(late, keys)).values()) == {None}
    assert set((await view(gone_early, keys)).values()) == {None}
    await gone_early.close()  # closed while it waits for the mark
    w.do(open=True)
    w.do(delete=GONE + REPUT, put={k: 2 for k in REPUT})
    want = {**{k: 1 for k in LIVE}, **{k: 2 for k in REPUT}, **{k: None for k in GONE}}
    assert await view(follower, keys) == want
    assert await view(late, keys) == want
    w.do(close=True)
    w.end()
    await late.close()
    await follower.close()
    assert _open_environments(store_dir) == []  # every LMDB handle the followers took is closed


async def test_follower_whose_index_is_deleted_serves_misses_until_a_writer_rebuilds(store_dir):
    await _first_writer(store_dir)
    follower = await PageStore.open(store_dir, small_config(), readonly=True)
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    assert set((await view(follower, LIVE)).values()) == {None}
    assert await follower.exists_prefix(LIVE) == 0
    w = Writer(store_dir)
    w.do(open=True)
    assert set((await view(follower, LIVE)).values()) == {1}
    w.do(close=True)
    w.end()
    await follower.close()


async def test_writer_rebuilding_beside_a_follower_in_its_process_writes_the_index_at_the_path(store_dir):
    await _first_writer(store_dir)
    st = await PageStore.open(store_dir, small_config())
    follower = await PageStore.open(store_dir, small_config(), readonly=True)  # shares the writer's environment
    await st.close()
    os.unlink(os.path.join(store_dir, INDEX_FILE))
    st = await PageStore.open(store_dir, small_config())  # rebuilds: must not write into the deleted file
    assert os.path.exists(os.path.join(store_dir, INDEX_FILE))
    assert all(await st.put_many(NEW, [data(k, 1) for k in NEW]))
    assert all(await st.delete_many(GONE))
    want = {**{k: 1 for k in LIVE + NEW}, **{k: None for k in GONE}}
    assert await view(follower, LIVE + NEW + GONE) == want
    await follower.close()
    await st.close()
    st = await PageStore.open(store_dir, small_config(), readonly=True)  # a later opener reads the file at the path
    assert await view(st, LIVE + NEW + GONE) == want
    await st.close()


async def test_a_lookup_on_the_old_file_while_another_reopened_is_answered_from_the_new_one(store_dir):
    # threads interleaved by hand: one lookup is reading the old file when the writer replaces it
    # and another lookup reopens; the first must not answer from what it read
    await _first_writer(store_dir)
    follower = await PageStore.open(store_dir, small_config(), readonly=True)
    watch = follower.state.watch
    keys = [k.encode() for k in GONE]
    w = Writer(store_dir)
    read_on = []

    def lookup(ix):
        if not read_on:
            os.unlink(os.path.join(store_dir, INDEX_FILE))
            w.do(open=True)
            w.do(delete=GONE)
            assert watch.records(keys) == [None] * len(keys)  # the other lookup, which reopens
        read_on.append(ix)
        return ix.get_records(keys)

    assert watch.read(lookup, "miss") == [None] * len(keys)
    old, new = read_on
    assert old is not new and old.closed and not new.closed  # the old handle closed once its lookup ended
    assert set((await view(follower, GONE + LIVE)).values()) == {None, 1}
    w.do(close=True)
    w.end()
    await follower.close()
