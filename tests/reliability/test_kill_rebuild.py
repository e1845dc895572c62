"""SIGKILL mid-batch, then the index is lost: the segments' records bring back every
acknowledged object, byte-exact, and no acknowledged delete comes back (issue 14). A rebuild
itself killed or interrupted at each of its steps, at open or by `verify --rebuild-index`, loses
nothing and brings nothing back (issue 34)."""

from __future__ import annotations

import asyncio
import copy
import os
import random
import shutil
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import ROOT, payload, small_config
from support import rebuild_kills, version_crash
from support.versions import Tally, read_log, version_in, versioned
from umbp_nvme.cli.maintenance import rebuild_index_dir
from umbp_nvme.store import PageStore, layout
from umbp_nvme.store.index import INDEX_FILE, Index
from umbp_nvme.store import index_swap
from umbp_nvme.store.index_swap import DAMAGED_COPIES_KEPT, REPLACED_SUFFIX, TEMP_SUFFIX
from umbp_nvme.store.records import area_blocks
from umbp_nvme.store.rebuild import OPEN_STEPS, VERIFY_STEPS

_CHILD = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[3])
    from conftest import payload, small_config
    from umbp_nvme.store import PageStore

    async def main(path, rnd):
        st = await PageStore.open(path, small_config(ssd_durability_mode=sys.argv[4], ssd_capacity_bytes=128 << 20))
        for b in range(200):  # at most 25 MiB a round: nothing is evicted
            keys = [f"r{rnd}-b{b}-{i}" for i in range(32)]
            sizes = [3000 + 97 * (i % 5) for i in range(32)]
            ok = await st.put_many(keys, [payload(k, n) for k, n in zip(keys, sizes)])
            print("put", *[f"{k}:{n}" for k, n, g in zip(keys, sizes, ok) if g], flush=True)
            if b % 3 == 2:
                gone = keys[:4]
                print("deleting", *gone, flush=True)
                ok = await st.delete_many(gone)
                print("del", *[k for k, g in zip(gone, ok) if g], flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def _read_until_kill(p: subprocess.Popen, after_batches: int, delay_s: float) -> str:
    """The child's whole stdout: lines until ``after_batches`` acknowledged puts, then ``delay_s``
    more, then SIGKILL and the rest. The rest is read through the same file object: readline
    leaves whatever else the pipe held in that object's buffer, and communicate(timeout=...)
    reads the raw fd and never sees it (acknowledged deletes went missing that way)."""
    lines = []
    deadline = time.monotonic() + 120
    try:
        while sum(1 for x in lines if x.startswith("put")) < after_batches and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
        time.sleep(delay_s)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)  # dead: the pipe's write end is closed, so the read below ends
    return "".join(lines) + p.stdout.read()


def _parse(text: str) -> tuple[dict, set, set]:
    """(acknowledged key -> size, acknowledged deletes, keys of the delete the kill cut short)."""
    acked, deleted, doubt = {}, set(), set()
    for line in text.split("\n")[:-1]:  # the last piece was cut by the kill (or is empty)
        if not line.strip():  # a line the kill's partial flush left empty
            continue
        kind, *items = line.split()
        if kind == "put":
            for it in items:
                k, n = it.rsplit(":", 1)
                acked[k] = int(n)
        elif kind == "deleting":
            doubt = set(items)
        elif kind == "del":
            deleted.update(items)
            doubt = set()
    return acked, deleted, doubt


def _run_and_kill(path: str, rnd: int, mode: str, after_batches: int, delay_s: float) -> tuple[dict, set, set]:
    """Run the child until it acknowledged ``after_batches`` batches, let it go on ``delay_s``
    (mid-batch, most likely), SIGKILL it; (acknowledged key -> size, acknowledged deletes, keys of
    the delete the kill cut short: each may be gone or intact, never wrong)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-c", _CHILD, path, str(rnd), os.path.join(ROOT, "tests"), mode],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    with p.stdout:
        return _parse(_read_until_kill(p, after_batches, delay_s))


def test_kill_reader_keeps_lines_the_pipe_already_held():
    """The child writes its ack lines before the parent reads the first: every line written before
    the kill is parsed, the acknowledged delete included (the old communicate(timeout=...) remainder
    dropped the lines readline had buffered, and an acknowledged delete looked like a lost object)."""
    out = "put a:1\ndeleting a\ndel a\nput b:2 c:3\ndeleting b\nput cut:4"
    child = f"import os, time\nos.write(1, {out!r}.encode())\ntime.sleep(60)"  # one write: one pipe read
    p = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    with p.stdout:
        assert select.select([p.stdout], [], [], 60)[0], "the child wrote nothing"
        text = _read_until_kill(p, 1, 0.0)
    assert text == out
    assert _parse(text) == ({"a": 1, "b": 2, "c": 3}, {"a"}, {"b"})


@pytest.mark.parametrize("mode", ["strict", "relaxed"])
async def test_sigkill_mid_batch_then_index_lost_loses_no_acknowledged_object(tmp_path, mode):
    path = str(tmp_path / "store")
    rng = random.Random(14)
    acked: dict[str, int] = {}
    deleted: set[str] = set()
    doubt: set[str] = set()
    for rnd in range(3):
        a, d, cut = _run_and_kill(path, rnd, mode, rng.randrange(3, 40), rng.uniform(0.0, 0.05))
        acked.update(a)
        deleted |= d
        doubt |= cut
        assert a, "the child acknowledged nothing before the kill"
        os.unlink(os.path.join(path, INDEX_FILE))  # the index is lost with the process
        st = await PageStore.open(path, small_config(ssd_durability_mode=mode, ssd_capacity_bytes=128 << 20))
        live = [k for k in acked if k not in deleted]
        outs = [np.zeros(acked[k], np.uint8) for k in live]
        ok = await st.get_many(live, outs)
        lost = [k for k, g in zip(live, ok) if not g and k not in doubt]
        wrong = [k for k, g, o in zip(live, ok, outs) if g and not np.array_equal(o, payload(k, acked[k]))]
        back = [k for k, e in zip(sorted(deleted), await st.exists_many(sorted(deleted))) if e]
        await st.close()
        assert (lost, wrong, back) == ([], [], []), (rnd, len(live))


# --- issue 34: a rebuild interrupted at any step ------------------------------------------------
# The store: support/version_crash.py's layout (segment 0 full, some keys re-put, victims put and
# deleted, then a put killed after its records reached the disk), then a session that checks,
# re-puts, deletes and closes cleanly. Each case copies it, makes the next open rebuild (or runs
# `verify --rebuild-index`), kills that at one step, then checks every key against the version
# model; then a session re-puts keys, re-puts and deletes others, and a second rebuild must still
# serve exactly what was acknowledged: nothing lost, nothing deleted or replaced comes back.


@pytest.fixture(scope="module")
def rebuilt_base(tmp_path_factory):
    """(layout, the store after the killed session and a clean one, the model, the next version)."""
    c = version_crash.Layout()
    d = tmp_path_factory.mktemp("interrupted-rebuild")
    killed, acks = str(d / "killed"), str(d / "acks")
    version_crash.kill_child(c, killed, acks)
    st = read_log(acks)
    tally = Tally()
    asyncio.run(version_crash.next_session(c, killed, st.model, st.next_version, "mixed", tally))
    assert tally.bad() == 0 and tally.versions_checked == len(every_key(c)), tally.figures()
    return c, killed, st.model, st.next_version + 1000


def every_key(c) -> list[str]:
    return [k for part in version_crash.names(c) for k in part]


async def checked(c, path: str, model) -> Tally:
    """Every key the workload touched, as a writer opening ``path`` serves it (its open may rebuild)."""
    tally = Tally()
    st = await PageStore.open(path, c.config())
    try:
        await version_crash.check_all(st, c, model, tally, every_key(c))
    finally:
        await st.close()
    return tally


async def reput_and_delete(c, path: str, model, nv: int, seed: int) -> None:
    """The session after the interrupted rebuild: 16 acknowledged keys re-put (new versions), 16
    re-put and then deleted (their older records are still on disk)."""
    rng = random.Random(seed)
    present = sorted(k for k in every_key(c) if model.must_exist(k))
    rng.shuffle(present)
    st = await PageStore.open(path, c.config())
    try:
        s = version_crash.Session(st, c.obj, model, None, nv)
        await s.reput(present[:32])
        await s.delete(present[16:32])
    finally:
        await st.close()


def leftovers(path: str) -> list[str]:
    return sorted(f for f in os.listdir(path) if f.startswith(INDEX_FILE + TEMP_SUFFIX))


# two damaged copies an earlier rebuild kept: a rebuild that keeps one more removes the older first
SEEDED = [INDEX_FILE + ".corrupt-20240101-000000", INDEX_FILE + ".corrupt-20240101-000001"]


def seed_copies(path: str) -> None:
    for f in SEEDED:
        with open(os.path.join(path, f), "wb") as fh:
            fh.write(f.encode())


def asides(path: str) -> list[str]:
    """The replaced file and the damaged copies beside the index (by name: the time, then .n)."""
    return sorted(f for f in os.listdir(path) if f in (INDEX_FILE + REPLACED_SUFFIX,)
                  or f.startswith(INDEX_FILE + ".corrupt-"))  # fmt: skip


async def interrupted_case(rebuilt_base, tmp_path, kind: str, target: str, sig: int, route: str) -> dict:
    c, base, model, nv = rebuilt_base
    path = str(tmp_path / "store")
    shutil.copytree(base, path)
    seed_copies(path)
    model = copy.deepcopy(model)
    if kind == "open":
        version_crash.rebuild_by(route, path, c.capacity)  # the next open rebuilds
    run = rebuild_kills.run_child(kind, path, c, target, sig)
    assert run.stopped_at == target, (run.steps, run.stderr[-2000:])
    want_rc = -signal.SIGKILL if sig == signal.SIGKILL else 130  # Ctrl-C: `umbp-nvme` says "interrupted"
    assert run.returncode == want_rc, (run.returncode, run.stderr[-2000:])
    left, aside = leftovers(path), asides(path)
    after_kill = await checked(c, path, model)
    assert leftovers(path) == [], "the next writer's open removes what the interrupted rebuild left"
    # the old index was sound (or gone): never kept as damaged, and a replaced one a kill left is removed
    assert asides(path) == SEEDED, (target, asides(path))
    await reput_and_delete(c, path, model, nv, seed=hash((kind, target, sig, route)) & 0xFFFF)
    if kind == "open":
        version_crash.rebuild_by("power_loss", path, c.capacity)
    else:
        rebuild_index_dir(path)
    after_rebuild = await checked(c, path, model)
    assert asides(path) == SEEDED, (target, asides(path))
    return {"left": left, "aside": aside, "after_kill": after_kill.figures(),
            "after_rebuild": after_rebuild.figures(), "examples": after_kill.examples + after_rebuild.examples}


CLEAN = {"wrong_bytes": 0, "stale_served": 0, "resurrected": 0, "lost_acknowledged": 0}


def assert_clean(out: dict, c) -> None:
    n = len(every_key(c))
    for when in ("after_kill", "after_rebuild"):
        f = dict(out[when])
        assert f.pop("versions_checked") == n, (when, out)
        assert f == CLEAN, (when, out)


@pytest.mark.parametrize("route", ["power_loss", "index_lost"])
def test_interrupted_rebuild_at_open_every_step(rebuilt_base, tmp_path, route):
    """A writer's open rebuilding the index (power loss: an old index at the path; index lost:
    none), SIGKILLed at each step, in turn; the next open serves every acknowledged version, and
    after re-puts and deletes a second rebuild brings nothing back."""
    c = rebuilt_base[0]
    for target in OPEN_STEPS:
        out = asyncio.run(interrupted_case(rebuilt_base, tmp_path / target, "open", target, signal.SIGKILL, route))
        assert_clean(out, c)
        tmp = INDEX_FILE + TEMP_SUFFIX
        left = {"created": [tmp, tmp + "-lock"], "committed": [tmp, tmp + "-lock"], "marked": [tmp], "set_aside": [tmp]}
        assert out["left"] == left.get(target, []), (target, out["left"])
        # the sound old index waits as index.lmdb.replaced from the move aside until it is removed
        replaced = route == "power_loss" and target in ("set_aside", "renamed", "dir_synced")
        assert out["aside"] == sorted(SEEDED + [INDEX_FILE + REPLACED_SUFFIX] * replaced), (target, out["aside"])


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "sigint"])
def test_interrupted_rebuild_by_verify_every_step(rebuilt_base, tmp_path, sig):
    """`umbp-nvme verify --rebuild-index` killed (SIGKILL) or interrupted (Ctrl-C) at each step."""
    c = rebuilt_base[0]
    for target in VERIFY_STEPS:
        out = asyncio.run(interrupted_case(rebuilt_base, tmp_path / target, "verify", target, sig, "verify"))
        assert_clean(out, c)
        if sig == signal.SIGINT:  # Ctrl-C cleans up: no temporary file stays
            assert out["left"] == [], (target, out["left"])
        # Ctrl-C after the move aside still finishes the rename (index_swap.py), not the removal
        replaced = target in ("set_aside", "renamed", "dir_synced")
        assert out["aside"] == sorted(SEEDED + [INDEX_FILE + REPLACED_SUFFIX] * replaced), (target, out["aside"])


@pytest.mark.parametrize("kind", ["open", "verify"])
def test_interrupted_rebuild_steps_are_every_step_a_rebuild_takes(rebuilt_base, tmp_path, kind):
    """The step lists the tests above walk are the steps a rebuild runs, in order."""
    c, base, _, _ = rebuilt_base
    path = str(tmp_path / "store")
    shutil.copytree(base, path)
    if kind == "open":
        version_crash.rebuild_by("power_loss", path, c.capacity)
    run = rebuild_kills.run_child(kind, path, c, None)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.steps == list(OPEN_STEPS if kind == "open" else VERIFY_STEPS)
    assert leftovers(path) == []


async def test_interrupted_rebuild_left_an_unmarked_index_the_next_open_rebuilds(rebuilt_base, tmp_path):
    """What a rebuild killed mid-way left before issue 34 (and a store's creation killed before
    its first mark leaves): an empty, valid index without a writer state at the path. It is
    "maybe behind": the open rebuilds from the records, never trusts it (it served 0 of 264)."""
    c, base, model, nv = rebuilt_base
    path = str(tmp_path / "store")
    shutil.copytree(base, path)
    model = copy.deepcopy(model)
    ipath = os.path.join(path, INDEX_FILE)
    os.rename(ipath, ipath + ".old")
    os.unlink(ipath + "-lock")
    Index(ipath, readonly=False, map_size=layout.map_size_bytes(c.capacity), durable=False).close()
    assert (await checked(c, path, model)).figures() == dict(CLEAN, versions_checked=len(every_key(c)))
    await reput_and_delete(c, path, model, nv, seed=34)
    version_crash.rebuild_by("power_loss", path, c.capacity)
    assert (await checked(c, path, model)).figures() == dict(CLEAN, versions_checked=len(every_key(c)))


async def _store_without_records(c, path: str, keys: list[str]) -> None:
    """A store as written before the records (the index is its truth), one index key damaged in
    place: the writer's scan leaves it out and replaces the index with the intact records."""
    st = await PageStore.open(path, c.config())
    assert all(await st.put_many(keys, [versioned(k, 1, c.obj) for k in keys]))
    await st.close()
    m = layout.read_manifest(path)
    del m["layout"]["record_bytes"]
    layout.write_manifest(os.path.join(path, layout.MANIFEST_FILE), m)
    area = area_blocks(c.segment, c.obj) * 4096
    for name in layout.segment_files(path).values():  # no records on disk
        with open(os.path.join(path, name), "r+b") as f:
            f.seek(c.segment - area)
            f.write(bytes(area))
    with open(os.path.join(path, INDEX_FILE), "r+b") as f:
        raw = f.read()
        at = raw.find(keys[-1].encode())
        assert at >= 0 and raw.find(keys[-1].encode(), at + 1) < 0
        f.seek(at + len(keys[-1]) - 1)
        f.write(b"x")  # still in LMDB's order: only the key checksum tells


def test_interrupted_index_replacement_without_records_every_step(tmp_path):
    """A store made before the records keeps its index as the truth: its damaged index replaced
    at open (the intact records kept) and killed at each step still serves every intact object."""
    c = version_crash.Layout()
    keys = [f"legacy-{i:03d}" for i in range(64)]
    base = str(tmp_path / "base")
    asyncio.run(_store_without_records(c, base, keys))

    async def served(path):
        st = await PageStore.open(path, c.config())
        try:
            outs = [np.zeros(c.obj, np.uint8) for _ in keys]
            ok = await st.get_many(keys, outs)
            return [k for k, g, o in zip(keys, ok, outs) if g and version_in(k, o) == 1]
        finally:
            await st.close()

    for target in index_swap.STEPS:
        path = str(tmp_path / target)
        shutil.copytree(base, path)
        seed_copies(path)
        run = rebuild_kills.run_child("open", path, c, target)
        assert run.stopped_at == target and run.returncode == -signal.SIGKILL, (run.steps, run.stderr[-2000:])
        # the damaged file is kept: before the build the oldest copy goes, so never more than the bound
        after_kill = asides(path)
        added = [f for f in after_kill if f not in SEEDED]
        assert after_kill == SEEDED[1:] + added and len(added) == (index_swap.STEPS.index(target) >= 3), target
        assert asyncio.run(served(path)) == keys[:-1], target
        now = asides(path)  # killed before the move aside, the next open replaced it again
        assert len(now) == DAMAGED_COPIES_KEPT and now[0] == SEEDED[1] and now[1] not in SEEDED, (target, now)


def _follower_tally(view: list, c, model, *, durable: bool) -> Tally:
    """A follower's view of every key, classified (a miss is a loss only where ``durable``)."""
    tally = Tally()
    for k, v in zip(every_key(c), view):
        tally.check(model, k, None if v is None else [None if v == "x" else v], durable=durable)
    return tally


async def test_interrupted_rebuild_a_follower_never_serves_a_wrong_version_and_follows_the_next_writer(
        rebuilt_base, tmp_path):  # fmt: skip
    """A follower (another process) open before a rebuild killed at a step serves the old file,
    misses (the path names nothing) or the new file, never a version that was not acknowledged;
    once the next writer has opened (rebuilt, or put the finished file in place), re-put and
    deleted, it serves exactly what was acknowledged."""
    c, base, model0, nv = rebuilt_base
    for target in ("marked", "set_aside", "renamed", "reopened"):  # each state of the path a follower can see
        path = str(tmp_path / target)
        shutil.copytree(base, path)
        model = copy.deepcopy(model0)
        version_crash.rebuild_by("power_loss", path, c.capacity)
        follower = rebuild_kills.Follower(path, c, every_key(c))
        try:
            run = rebuild_kills.run_child("open", path, c, target)
            assert run.stopped_at == target, (run.steps, run.stderr[-2000:])
            f = _follower_tally(follower.view(), c, model, durable=False).figures()
            assert (f["wrong_bytes"], f["stale_served"], f["resurrected"]) == (0, 0, 0), (target, f)
            await reput_and_delete(c, path, model, nv, seed=7)
            f = _follower_tally(follower.view(), c, model, durable=True).figures()
            assert f == dict(CLEAN, versions_checked=len(every_key(c))), (target, f)
        finally:
            follower.close()
