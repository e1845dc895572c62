"""Issue 10: the store trusts nothing it did not just check in its own metadata and directory.

Defect 1 (a damaged index.lmdb must never SIGBUS anyone), 2 and 10 (a damaged MANIFEST.json or
field: a StoreError naming it; a writer moves it aside and keeps caching), 3 (keys with 0xFF or
invalid UTF-8 in the index must not shift records, and stay evictable and deletable) and the
store side of 7 (directory and file trust). Opens of a damaged index run in child processes: a
SIGBUS there kills the child, and the test asserts its exit status and its report.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap

import lmdb
import numpy as np
import pytest

from conftest import ROOT, KiB, MiB, payload, small_config
from umbp_nvme.errors import (
    IndexDamagedError,
    ManifestDamagedError,
    NotAStoreError,
    StoreDamagedError,
    UnsafeStorePathError,
)
from umbp_nvme.index import INDEX_FILE, REC_DTYPE, Index, check_index_file
from umbp_nvme.maintenance import StoreReader, verify_records
from umbp_nvme.segments import SegmentAllocator, segment_name
from umbp_nvme.store import MANIFEST_FILE, PageStore, read_manifest

OBJ = 4 * KiB
OTHER_UID = 65534  # "nobody": files chowned to it stand for another user's (tests run as root in CI)


def cfg(**kw):
    return small_config(ssd_capacity_bytes=16 * MiB, ssd_segment_size_bytes=1 * MiB, **kw)


async def put(st, keys, n=OBJ):
    return await st.put_many(keys, [payload(k, n) for k in keys])


async def got(st, keys, n=OBJ) -> list[bool]:
    """get_many; every hit must carry exactly the key's bytes (a wrong byte fails the test)."""
    outs = [np.zeros(n, np.uint8) for _ in keys]
    ok = await st.get_many(keys, outs)
    for k, g, o in zip(keys, ok, outs):
        assert not g or bytes(o) == bytes(payload(k, n)), f"wrong bytes served for {k!r}"
    return ok


def errors_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("umbp_nvme")]


# ------------------------------------------------------------------ 1. damaged index: no SIGBUS

_TEMPLATE_KEYS = 300


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A store whose index spans many pages (long keys), closed cleanly."""
    path = str(tmp_path_factory.mktemp("tmpl") / "store")

    async def make():
        st = await PageStore.open(path, cfg())
        keys = [f"{'p' * 90}-{i:05d}" for i in range(_TEMPLATE_KEYS)]
        for lo in range(0, len(keys), 50):
            assert all(await put(st, keys[lo : lo + 50]))
        await st.close()

    asyncio.run(make())
    return path


_CHILD = textwrap.dedent(
    r"""
    import asyncio, glob, json, logging, os, random, shutil, sys
    import numpy as np
    from conftest import payload, small_config, MiB
    from umbp_nvme.store import PageStore
    from umbp_nvme.errors import IndexDamagedError
    from umbp_nvme.maintenance import StoreReader, verify_records

    template, work, trials = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    OBJ = 4096
    KEYS = [f"{'p' * 90}-{i:05d}" for i in range(300)]
    errors = []

    class Grab(logging.Handler):
        def emit(self, r):
            if r.levelno >= logging.ERROR:
                errors.append(r.getMessage())

    logging.getLogger("umbp_nvme").addHandler(Grab())
    logging.getLogger("umbp_nvme").setLevel(logging.INFO)
    cfg = small_config(ssd_capacity_bytes=16 * MiB, ssd_segment_size_bytes=1 * MiB)

    def damage(path, t):
        p = os.path.join(path, "index.lmdb")
        kind, arg = t["kind"], t.get("arg")
        size = os.path.getsize(p)
        if kind == "truncate":
            os.truncate(p, arg)
        elif kind == "zero_page":
            with open(p, "r+b") as f:
                f.seek(arg * 4096); f.write(bytes(4096))
        elif kind == "flip":
            rng = random.Random(arg)
            with open(p, "r+b") as f:
                for _ in range(t.get("n", 1)):
                    off = rng.randrange(size) if not t.get("meta") else rng.choice((0, 4096)) + rng.randrange(16, 152)
                    f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
        elif kind == "garbage":
            with open(p, "wb") as f:
                f.write(random.Random(arg).randbytes(size))
        elif kind == "empty":
            open(p, "wb").close()
        elif kind == "missing":
            os.unlink(p)
        else:
            raise SystemExit(f"unknown damage {kind}")

    async def get(st, keys):
        outs = [np.zeros(OBJ, np.uint8) for _ in keys]
        ok = await st.get_many(keys, outs)
        wrong = sum(1 for k, g, o in zip(keys, ok, outs) if g and bytes(o) != bytes(payload(k, OBJ)))
        return sum(ok), wrong

    async def trial(t, path):
        out = {"trial": t}
        try:  # a follower: opens read-only; damage is reported, never a crash
            ro = await PageStore.open(path, cfg, readonly=True)
            out["ro"] = "ok"
            out["ro_hits"], out["ro_wrong"] = await get(ro, KEYS[:50])
            await ro.close()
        except Exception as e:
            out["ro"] = type(e).__name__
            out["ro_msg"] = str(e)
        try:  # verify / inspect read through StoreReader
            with StoreReader(path) as r:
                r.records()
            s = verify_records(path)
            out["verify"] = "clean" if not s["bad"] else f"{len(s['bad'])} bad"
        except Exception as e:
            out["verify"] = type(e).__name__
        del errors[:]
        st = await PageStore.open(path, cfg)  # the writer: must come up whatever it finds
        out["objects"] = st.stats()["objects"]
        out["hits"], out["wrong"] = await get(st, KEYS)
        out["errors"] = list(errors)
        out["aside"] = [os.path.basename(p) for p in glob.glob(os.path.join(path, "index.lmdb.corrupt-*"))]
        assert all(await st.put_many(["new"], [payload("new", OBJ)]))
        out["new_hits"], out["new_wrong"] = await get(st, ["new"])
        await st.close()
        st = await PageStore.open(path, cfg)  # and the repaired store reopens with what it stored
        out["reopen_hits"], _ = await get(st, ["new"])
        await st.close()
        return out

    for i, t in enumerate(trials):
        path = os.path.join(work, f"t{i}")
        shutil.copytree(template, path)
        damage(path, t)
        print(json.dumps(asyncio.run(trial(t, path))), flush=True)
        shutil.rmtree(path)
    """
)


def _run_trials(template, tmp_path, trials) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, template, str(tmp_path), json.dumps(trials)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, f"child died (exit {p.returncode}; -7 is SIGBUS):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    outs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(outs) == len(trials), p.stderr[-3000:]
    for o in outs:
        assert o["ro"] in ("ok", "IndexDamagedError", "FileNotFoundError"), o
        # a flipped record is a record verify reports bad (its CRC or extent), never a crash
        assert o["verify"] in ("clean", "IndexDamagedError", "NotAStoreError") or o["verify"].endswith(" bad"), o
        assert o.get("ro_wrong", 0) == 0 and o["wrong"] == 0 and o["new_wrong"] == 0, o
        assert o["new_hits"] == 1 and o["reopen_hits"] == 1, o
    return outs


def _index_pages(template) -> int:
    return os.path.getsize(os.path.join(template, INDEX_FILE)) // 4096


def test_truncated_index_never_crashes_any_opener(template, tmp_path):
    pages = _index_pages(template)
    assert pages >= 8  # the fixture must give an index of several pages
    size = pages * 4096
    cuts = sorted({size // 2, 1, 100, 4095, 4096 + 152, size - 1, *range(0, size, 4096)})
    outs = _run_trials(template, tmp_path, [{"kind": "truncate", "arg": c} for c in cuts])
    for o in outs:
        cut = o["trial"]["arg"]
        # LMDB's newest meta page names the last page: any cut below the end is damage
        assert o["ro"] == "IndexDamagedError" and o["verify"] == "IndexDamagedError", o
        assert "damaged" in o["ro_msg"] and "index.lmdb" in o["ro_msg"], o
        assert o["objects"] == 0 and len(o["aside"]) == 1, o
        assert len(o["errors"]) == 1 and o["aside"][0] in o["errors"][0] and "damaged" in o["errors"][0], (cut, o)
        if cut >= 2 * 4096:
            assert "truncated" in o["errors"][0], o


def test_zeroed_garbage_empty_and_missing_index_never_crash(template, tmp_path):
    pages = _index_pages(template)
    trials = [{"kind": "zero_page", "arg": p} for p in range(pages)]
    trials += [{"kind": "garbage", "arg": 1}, {"kind": "empty"}, {"kind": "missing"}]
    outs = _run_trials(template, tmp_path, trials)
    for o in outs:
        t = o["trial"]
        if t["kind"] in ("garbage", "empty") or (t["kind"] == "zero_page" and t["arg"] < 2):
            assert o["ro"] == "IndexDamagedError" and o["verify"] == "IndexDamagedError", o
            assert o["objects"] == 0 and len(o["aside"]) == 1 and len(o["errors"]) == 1, o
            assert o["aside"][0] in o["errors"][0], o
        elif t["kind"] == "missing":
            assert o["ro"] == "FileNotFoundError" and o["objects"] == 0, o
            assert len(o["errors"]) == 1 and "missing" in o["errors"][0], o
        else:  # a zeroed data page: LMDB reports it (moved aside), or it held nothing live
            assert o["ro"] in ("ok", "IndexDamagedError"), o
            assert len(o["errors"]) <= 1 and len(o["aside"]) == len(o["errors"]), o
    # an undamaged page stays undamaged: the last trial set includes pages the tree does not use
    assert any(o["objects"] == _TEMPLATE_KEYS and o["hits"] == _TEMPLATE_KEYS for o in outs if o["trial"]["kind"] == "zero_page")


def test_flipped_bits_in_the_index_never_crash(template, tmp_path):
    trials = [{"kind": "flip", "arg": s, "meta": True} for s in range(40)]
    trials += [{"kind": "flip", "arg": 1000 + s, "n": 8} for s in range(40)]
    outs = _run_trials(template, tmp_path, trials)
    for o in outs:
        assert len(o["errors"]) <= 1 and len(o["aside"]) <= 1, o
        if o["aside"]:
            assert o["aside"][0] in o["errors"][0], o


def test_check_index_file_reads_the_meta_pages(template, tmp_path):
    p = str(tmp_path / INDEX_FILE)
    shutil.copy(os.path.join(template, INDEX_FILE), p)
    check_index_file(p)  # intact
    size = os.path.getsize(p)
    with open(p, "r+b") as f:  # last_pg of both meta pages far past the end of the file
        for base in (0, 4096):
            f.seek(base + 136)
            f.write((10**6).to_bytes(8, "little"))
    with pytest.raises(Exception, match=f"file is {size} bytes but its meta page"):
        check_index_file(p)
    with pytest.raises(IndexDamagedError, match="truncated"):
        Index(p, readonly=True, map_size=1 << 30, durable=False)


def test_cli_verify_and_inspect_report_a_truncated_index(template, tmp_path):
    path = str(tmp_path / "s")
    shutil.copytree(template, path)
    os.truncate(os.path.join(path, INDEX_FILE), os.path.getsize(os.path.join(path, INDEX_FILE)) // 2)
    env = dict(os.environ, PYTHONPATH=ROOT)
    for cmd in (["verify", "--store", path], ["inspect", "--store", path, "x"]):
        p = subprocess.run([sys.executable, "-m", "umbp_nvme.cli", *cmd], capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 2, (cmd, p.returncode, p.stderr)  # EXIT_ERROR, not a signal
        assert "damaged" in p.stderr and "truncated" in p.stderr and INDEX_FILE in p.stderr, p.stderr
    assert os.path.getsize(os.path.join(path, INDEX_FILE))  # read-only openers move nothing
    assert not glob.glob(os.path.join(path, INDEX_FILE + ".corrupt-*"))
