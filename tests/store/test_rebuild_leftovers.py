"""What index rebuilds leave beside index.lmdb: a sound old index (verify --rebuild-index on a
healthy store, one maybe behind after a power loss) is removed once the new one is in place; a
damaged one is kept for diagnosis as index.lmdb.corrupt-<time>, the newest two only (each older one
removed with a log line). Before, every rebuild left a copy as large as the index, without bound.
The files listed here are the test's own glob, not the product's list."""

from __future__ import annotations

import logging
import os

import numpy as np

from conftest import small_config
from support.version_crash import rebuild_by
from support.versions import version_in, versioned
from umbp_nvme.cli.maintenance import rebuild_index_dir
from umbp_nvme.store import PageStore, index_swap
from umbp_nvme.store.index import INDEX_FILE

KiB = 1 << 10
OBJ = 16 * KiB
KEPT = 2  # docs/reliability.md: the newest two damaged copies
CAP = 16 << 20


def beside(path: str) -> list[str]:
    """Every file beside index.lmdb whose name starts with it, but its own lock file."""
    return sorted(f for f in os.listdir(path) if f.startswith(INDEX_FILE + ".") and f != INDEX_FILE + "-lock")


def copies(path: str) -> list[str]:
    """The damaged copies, by name (the name sorts by time: YYYYmmdd-HHMMSS, then .n within a second)."""
    def order(f):
        stamp, _, n = f[len(INDEX_FILE + ".corrupt-"):].partition(".")
        return stamp, int(n or 0)

    return sorted((f for f in beside(path) if f.startswith(INDEX_FILE + ".corrupt-2")
                   and os.path.isfile(os.path.join(path, f))), key=order)


async def served(path: str, model: dict[str, int]) -> dict[str, int | None]:
    """Each key's version as a writer opening ``path`` serves it (its open may rebuild)."""
    st = await PageStore.open(path, small_config(ssd_capacity_bytes=CAP))
    try:
        keys = sorted(model)
        outs = [np.zeros(OBJ, np.uint8) for _ in keys]
        got = await st.get_many(keys, outs)
        return {k: version_in(k, o) if g else None for k, g, o in zip(keys, got, outs)}
    finally:
        await st.close()


async def reput(path: str, model: dict[str, int], keys: list[str], version: int) -> None:
    """New bytes under ``keys``: deleted first (a put of a present key keeps the old bytes)."""
    st = await PageStore.open(path, small_config(ssd_capacity_bytes=CAP))
    try:
        assert await st.delete_many(keys) == [True] * len(keys)
        assert await st.put_many(keys, [versioned(k, version, OBJ) for k in keys]) == [True] * len(keys)
        model.update({k: version for k in keys})
    finally:
        await st.close()


async def test_repeated_rebuilds_leave_at_most_the_newest_damaged_copies(tmp_path, caplog):
    path = str(tmp_path / "store")
    ipath = os.path.join(path, INDEX_FILE)
    model = {f"k{i:03d}": 1 for i in range(48)}
    st = await PageStore.open(path, small_config(ssd_capacity_bytes=CAP))
    assert await st.put_many(sorted(model), [versioned(k, 1, OBJ) for k in sorted(model)]) == [True] * 48
    await st.close()
    # what the old code left: three copies named as damaged; and files an operator put there, not ours
    old = [INDEX_FILE + s for s in (".corrupt-20240101-000000", ".corrupt-20240101-000001", ".corrupt-20240101-000001.1")]
    theirs = [INDEX_FILE + ".corrupt-notes", INDEX_FILE + ".bak"]
    for f in old + theirs:
        with open(os.path.join(path, f), "wb") as fh:
            fh.write(f.encode())
    os.mkdir(os.path.join(path, INDEX_FILE + ".corrupt-20200101-000000"))  # a directory of that name: not a copy
    theirs = sorted(theirs + [INDEX_FILE + ".corrupt-20200101-000000"])
    caplog.set_level(logging.WARNING, logger="umbp_nvme")

    for r in range(4):  # verify --rebuild-index on a sound index: not kept; the old copies pruned to two
        s = rebuild_index_dir(path)
        assert beside(path) == sorted(old[-KEPT:] + theirs), r
        assert s.get("old_index_removed") is True and "moved_aside" not in s, s
        keys = sorted(model)[8 * r : 8 * r + 8]
        await reput(path, model, keys, version=r + 2)
        assert await served(path, model) == model, r
    removed = [r.getMessage() for r in caplog.records if "removed an older damaged copy" in r.getMessage()]
    assert len(removed) == 1 and os.path.join(path, old[0]) in removed[0]

    kept: list[str] = []
    for r in range(3):  # a damaged index: each rebuild keeps its copy, and only the newest two stay
        rebuild_by("index_damaged", path, CAP)
        s = rebuild_index_dir(path)
        kept.append(os.path.basename(s["moved_aside"]))
        assert copies(path) == (old[-KEPT:] + kept)[-KEPT:], r
        assert beside(path) == sorted(copies(path) + theirs)
        assert await served(path, model) == model, r
    with open(os.path.join(path, kept[-1]), "rb") as f, open(ipath, "rb") as g:
        assert f.read(4096) != g.read(4096)  # the copy is the damaged file, not the new one

    # at a writer's open: a damaged index is kept (the oldest copy goes), a maybe-behind one is not
    rebuild_by("index_damaged", path, CAP)
    assert await served(path, model) == model
    now = copies(path)
    assert len(now) == KEPT and now[0] == kept[-1] and now[1] not in kept
    rebuild_by("power_loss", path, CAP)
    assert await served(path, model) == model
    assert beside(path) == sorted(now + theirs)  # nothing added, no index.lmdb.replaced left
    removed = [r.getMessage() for r in caplog.records if "removed an older damaged copy" in r.getMessage()]
    assert len(removed) == 1 + 3 + 1  # one line per copy removed, each naming it
    assert index_swap.DAMAGED_COPIES_KEPT == KEPT


def test_verify_says_what_became_of_the_old_index(tmp_path, capsys):
    import asyncio

    from umbp_nvme.cli.main import main

    path = str(tmp_path / "store")
    model = {f"k{i:03d}": 1 for i in range(8)}

    async def fill():
        st = await PageStore.open(path, small_config(ssd_capacity_bytes=CAP))
        assert await st.put_many(sorted(model), [versioned(k, 1, OBJ) for k in sorted(model)]) == [True] * 8
        await st.close()

    asyncio.run(fill())
    assert main(["verify", "--store", path, "--rebuild-index"]) == 0
    assert "8 objects; the old index (sound) was removed" in capsys.readouterr().out
    rebuild_by("index_damaged", path, CAP)
    assert main(["verify", "--store", path, "--rebuild-index"]) == 0
    (copy,) = copies(path)
    assert f"8 objects; the old index was damaged: kept as {os.path.join(path, copy)}" in capsys.readouterr().out
    assert asyncio.run(served(path, model)) == model


async def test_a_replaced_index_a_kill_left_is_removed_by_the_next_writer_and_never_the_live_one(tmp_path):
    """A kill between the move aside and the end leaves index.lmdb.replaced (at most one name); the
    next writer removes it once the path names an index, and never touches the live file."""
    path = str(tmp_path / "store")
    ipath = os.path.join(path, INDEX_FILE)
    model = {f"k{i:03d}": 1 for i in range(16)}
    st = await PageStore.open(path, small_config(ssd_capacity_bytes=CAP))
    assert await st.put_many(sorted(model), [versioned(k, 1, OBJ) for k in sorted(model)]) == [True] * 16
    await st.close()
    live = os.stat(ipath).st_ino
    with open(ipath + ".replaced", "wb") as f:
        f.write(b"a sound index a killed rebuild replaced")
    assert await served(path, model) == model
    assert beside(path) == []
    assert os.stat(ipath).st_ino == live  # the live index was opened as it was, not replaced or removed
    assert index_swap.REPLACED_SUFFIX == ".replaced"
