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
import time

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
from umbp_nvme.store.index import FLAG_KEYCRC, INDEX_FILE, REC_DTYPE, Index, check_index_file, key_crcs
from umbp_nvme.cli.maintenance import StoreReader, verify_records
from umbp_nvme.store.segments import SegmentAllocator, segment_name
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
    from umbp_nvme.cli.maintenance import StoreReader, verify_records

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


def _run_trials(template, tmp_path, trials, children: int = 2) -> list[dict]:
    """Each trial's answers, in trial order: the trials dealt round-robin to ``children`` child
    processes that run side by side, each in a directory of its own (CI's second core)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    runs = []
    for c in range(children):
        work = tmp_path / f"child{c}"
        work.mkdir()
        out, err = open(work / "stdout", "w+"), open(work / "stderr", "w+")  # files: no pipe fills while we wait on another
        p = subprocess.Popen([sys.executable, "-c", _CHILD, template, str(work), json.dumps(trials[c::children])],
                             stdout=out, stderr=err, text=True, env=env)  # fmt: skip
        runs.append((p, out, err))
    try:
        rcs = [p.wait(timeout=600) for p, _, _ in runs]
    finally:
        for p, _, _ in runs:
            if p.poll() is None:
                p.kill()
                p.wait()
    got = []
    for c, ((_, out, err), rc) in enumerate(zip(runs, rcs)):
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
        out.close(), err.close()
        assert rc == 0, f"child died (exit {rc}; -7 is SIGBUS):\n{stdout[-3000:]}\n{stderr[-3000:]}"
        got.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
        assert len(got[c]) == len(trials[c::children]), stderr[-3000:]
    outs = [got[i % children][i // children] for i in range(len(trials))]
    assert [o["trial"] for o in outs] == trials
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
        # issue 14: the index is rebuilt from the records in the segments: every page comes back
        assert o["objects"] == _TEMPLATE_KEYS and o["hits"] == _TEMPLATE_KEYS and len(o["aside"]) == 1, o
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
            assert o["objects"] == _TEMPLATE_KEYS and o["hits"] == _TEMPLATE_KEYS, o  # rebuilt (issue 14)
            assert len(o["aside"]) == 1 and len(o["errors"]) == 1, o
            assert o["aside"][0] in o["errors"][0], o
        elif t["kind"] == "missing":
            assert o["ro"] == "FileNotFoundError" and o["objects"] == o["hits"] == _TEMPLATE_KEYS, o  # rebuilt
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


# ------------------------------------------------------------------ 3. key bytes in the index

_ODD_KEYS = [b"w\xffa", b"\xff", b"w\xc3(", b"w\xed\xa0\x80", b"\xffz\xff"]  # 0xFF, invalid UTF-8, a surrogate


async def _store_with_odd_keys(path) -> tuple[list[str], list[str]]:
    """Records written straight into LMDB under key bytes no str key could have put; each odd
    key takes over the record (slot, CRC) of one good key, whose own entry is removed."""
    from umbp_nvme.keybytes import decode_key

    st = await PageStore.open(path, cfg())
    good = [f"good{i}" for i in range(8)]
    assert all(await put(st, good))
    await st.close()
    # through Index: LMDB allows one handle per file and process (the store's closes on a thread)
    idx = Index(os.path.join(path, INDEX_FILE), readonly=False, map_size=1 << 30, durable=True)
    recs = np.frombuffer(b"".join(idx.get_records([g.encode() for g in good[: len(_ODD_KEYS)]])), REC_DTYPE).copy()
    # as a writer would have written them: the key checksum is of the odd key's bytes; the
    # first one is a record from before key checksums existed (FLAG_KEYCRC clear)
    recs["key_crc"] = key_crcs(list(_ODD_KEYS))
    recs["flags"][0] &= ~np.uint32(FLAG_KEYCRC)
    puts = [(k, recs[i : i + 1].tobytes()) for i, k in enumerate(_ODD_KEYS)]
    idx.commit(puts=puts, deletes=[g.encode() for g in good[: len(_ODD_KEYS)]])
    idx.close()
    return [decode_key(k) for k in _ODD_KEYS], good


async def test_index_keys_with_0xff_or_bad_utf8_keep_their_own_records(store_dir):
    odd, good = await _store_with_odd_keys(store_dir)
    st = await PageStore.open(store_dir, cfg())
    assert st.stats()["objects"] == 8
    for o, g in zip(odd, good):  # each odd key serves exactly the bytes of the record it holds
        buf = np.zeros(OBJ, np.uint8)
        assert await st.get_many([o], [buf]) == [True] and bytes(buf) == bytes(payload(g, OBJ)), o
    assert await got(st, good[5:]) == [True] * 3  # the records after them did not shift
    await st.close()
    with StoreReader(store_dir) as r:  # verify/export read the same pairs
        names, recs = r.scan()
        assert sorted(names) == sorted(odd + good[5:])
        assert verify_records(store_dir)["bad"] == []
        by_key = {rec.key: rec for rec in r.records()}
        assert [rec.key for rec in r.lookup(odd)] == odd
    assert len({(by_key[o].segment, by_key[o].offset) for o in odd}) == len(odd)


async def test_index_keys_that_do_not_decode_are_deletable_and_evictable(store_dir):
    odd, good = await _store_with_odd_keys(store_dir)
    st = await PageStore.open(store_dir, cfg())
    assert await st.delete_many([odd[1]]) == [True]
    assert await st.exists_many([odd[1]]) == [False]
    # capacity pressure: 16 MiB of new objects evicts the oldest, the odd keys among them
    new = [f"new{i}" for i in range(4000)]
    for lo in range(0, len(new), 200):
        await put(st, new[lo : lo + 200])
    assert st.stats()["evictions"] >= len(odd) - 1
    assert await st.exists_many(odd) == [False] * len(odd)
    await st.close()
    idx = Index(os.path.join(store_dir, INDEX_FILE), readonly=True, map_size=1 << 30, durable=False)
    assert idx.get_records(_ODD_KEYS) == [None] * len(_ODD_KEYS)  # gone durably, not leaked
    idx.close()
    st = await PageStore.open(store_dir, cfg())  # and the next open finds nothing of them
    assert await st.exists_many(odd) == [False] * len(odd)
    await st.close()


def test_scan_decodes_keys_one_by_one(tmp_path):
    from umbp_nvme.keybytes import decode_key

    p = str(tmp_path / INDEX_FILE)
    idx = Index(p, readonly=False, map_size=1 << 24, durable=False)
    rec = np.zeros(1, REC_DTYPE).tobytes()
    keys = [b"a\xff", b"a\xffb\xff", b"\xff\xff", b"b"]
    idx.commit(puts=[(k, rec) for k in keys])
    names, recs = idx.scan()
    assert names == [decode_key(k) for k in sorted(keys)] and len(recs) == len(keys)
    idx.close()


# ------------------------------------------------------------------ 2 and 10. damaged manifest

_MANIFEST_DAMAGE = {
    "not_json": (b'{"format_version": 1, "lay', None),
    "empty": (b"", None),
    "garbage": (bytes(range(256)) * 4, None),
    "array": (b"[1, 2]", None),
    "segment_bytes_0": (("layout", "segment_bytes", 0), "layout.segment_bytes=0"),
    "segment_bytes_4097": (("layout", "segment_bytes", 4097), "layout.segment_bytes=4097"),
    "segment_bytes_abc": (("layout", "segment_bytes", "abc"), "layout.segment_bytes='abc'"),
    "segment_bytes_negative": (("layout", "segment_bytes", -4096), "layout.segment_bytes=-4096"),
    "segment_bytes_huge": (("layout", "segment_bytes", 1 << 62), f"layout.segment_bytes={1 << 62}"),
    "segment_bytes_bool": (("layout", "segment_bytes", True), "layout.segment_bytes=True"),
    "segment_bytes_missing": (("layout", "segment_bytes", KeyError), "layout.segment_bytes is missing"),
    "capacity_str": ((None, "ssd_capacity_bytes", "16M"), "ssd_capacity_bytes='16M'"),
    "capacity_negative": ((None, "ssd_capacity_bytes", -1), "ssd_capacity_bytes=-1"),
    "capacity_bool": ((None, "ssd_capacity_bytes", True), "ssd_capacity_bytes=True"),
    "capacity_huge": ((None, "ssd_capacity_bytes", 1 << 70), f"ssd_capacity_bytes={1 << 70}"),
    "format_version_2": ((None, "format_version", 2), "format_version=2"),
    "format_version_str": ((None, "format_version", "1"), "format_version='1'"),
    "format_version_bool": ((None, "format_version", True), "format_version=True"),
    "format_version_missing": ((None, "format_version", KeyError), "format_version is missing"),
    "namespace_list": ((None, "namespace", [1]), "namespace=[1]"),
}


def _damage_manifest(path, how):
    p = os.path.join(path, MANIFEST_FILE)
    if isinstance(how, bytes):
        data = how
    else:
        section, field, value = how
        m = json.load(open(p))
        d = m if section is None else m[section]
        if value is KeyError:
            del d[field]
        else:
            d[field] = value
        data = json.dumps(m).encode()
    with open(p, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("case", sorted(_MANIFEST_DAMAGE))
async def test_damaged_manifest_is_reported_then_recovered_by_the_writer(store_dir, case, caplog):
    how, names = _MANIFEST_DAMAGE[case]
    ns = {"model": "m", "page_size": 64}
    st = await PageStore.open(store_dir, cfg(), namespace=ns)
    keys = [f"k{i}" for i in range(40)]
    assert all(await put(st, keys))
    await st.close()
    _damage_manifest(store_dir, how)
    mpath = os.path.join(store_dir, MANIFEST_FILE)
    # read-only openers (follower, verify, inspect): a StoreError naming the field, value and file
    with pytest.raises(ManifestDamagedError) as e:
        await PageStore.open(store_dir, cfg(), readonly=True, namespace=ns)
    assert mpath in str(e.value) and (names is None or names in str(e.value)), str(e.value)
    assert isinstance(e.value, StoreDamagedError) and isinstance(e.value, NotAStoreError)
    with pytest.raises(ManifestDamagedError, match=MANIFEST_FILE):
        read_manifest(store_dir)
    with pytest.raises(ManifestDamagedError):
        StoreReader(store_dir)
    assert not glob.glob(mpath + ".corrupt-*")  # read-only openers move nothing
    # the writer: one ERROR line, the file moved aside, the store up with what it held
    caplog.set_level(logging.INFO, logger="umbp_nvme")
    st = await PageStore.open(store_dir, cfg(), namespace=ns)
    aside = glob.glob(mpath + ".corrupt-*")
    errs = errors_logged(caplog)
    assert len(aside) == 1 and len(errs) == 1, errs
    assert "manifest is damaged" in errs[0] and aside[0] in errs[0] and "segment_bytes=1048576 from the segment files" in errs[0]
    assert await got(st, keys) == [True] * len(keys)
    assert all(await put(st, ["after"]))
    await st.close()
    m = read_manifest(store_dir)
    assert m["layout"]["segment_bytes"] == MiB and m["namespace"] == ns and m["ssd_capacity_bytes"] == 16 * MiB
    st = await PageStore.open(store_dir, cfg(), readonly=True, namespace=ns)
    assert await got(st, keys + ["after"]) == [True] * (len(keys) + 1)
    await st.close()


async def test_a_manifest_damaged_at_every_open_keeps_only_the_newest_copies(store_dir, caplog):
    """Damage at every restart (a bad disk, a broken deploy script) must not fill the disk with copies."""
    st = await PageStore.open(store_dir, cfg())
    assert all(await put(st, ["a"]))
    await st.close()
    mpath = os.path.join(store_dir, MANIFEST_FILE)
    caplog.set_level(logging.INFO, logger="umbp_nvme")
    made = []
    for i in range(4):
        _damage_manifest(store_dir, b"garbage %d" % i)
        st = await PageStore.open(store_dir, cfg())
        assert await got(st, ["a"]) == [True]
        await st.close()
        made.append(sorted(set(glob.glob(mpath + ".corrupt-*")) - set(made))[-1])
    left = sorted(glob.glob(mpath + ".corrupt-*"))
    assert sorted(left) == sorted(made[-2:]), (left, made)
    assert [open(p, "rb").read() for p in sorted(left, key=made.index)] == [b"garbage 2", b"garbage 3"]
    removed = [r.getMessage() for r in caplog.records if "removed an older damaged copy of MANIFEST.json" in r.getMessage()]
    assert len(removed) == 2, removed


async def test_missing_manifest_beside_store_files_is_recovered(store_dir, caplog):
    st = await PageStore.open(store_dir, cfg())
    assert all(await put(st, ["a", "b"]))
    await st.close()
    os.unlink(os.path.join(store_dir, MANIFEST_FILE))
    caplog.set_level(logging.INFO, logger="umbp_nvme")
    # the config asks for another segment size: the files' own size wins
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=16 * MiB, ssd_segment_size_bytes=4 * MiB))
    errs = errors_logged(caplog)
    assert len(errs) == 1 and "missing" in errs[0] and "from the segment files" in errs[0], errs
    assert st.segment_bytes == MiB and await got(st, ["a", "b"]) == [True, True]
    await st.close()


def test_segment_allocator_validates_without_assert():
    for bad in (0, 4097, -4096, "abc", 4096.0):
        with pytest.raises(ValueError, match="segment_bytes"):
            SegmentAllocator(4, bad)
    a = SegmentAllocator(2, 8192)
    seg, off = a.alloc(4096)
    a.free(seg, off)
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(seg, off)  # a double free is refused even under python -O
    # records from a damaged index: wrapped offsets, past the segment, misaligned, overlapping
    segs = np.array([0, 0, 0, 1, 1, 1], np.uint32)
    offs = np.array([1 << 63, 8192, 100, 0, 0, 4096], np.uint64)
    lens = np.array([4096, 4096, 4096, 4096, 4096, 4096], np.uint32)
    gens = np.array([1, 2, 3, 4, 5, 6], np.uint64)
    keep = a.rebuild(segs, offs, lens, gens)
    assert keep.tolist() == [False, False, False, False, True, True]
    assert a.used_bytes == 2 * 4096


# ------------------------------------------------------------------ 7. directory and file trust


async def test_store_under_a_directory_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: anyone may rename our directory away
    with pytest.raises(UnsafeStorePathError, match="sticky"):
        await PageStore.open(str(shared / "store"), cfg())
    os.chmod(shared, 0o775)
    with pytest.raises(UnsafeStorePathError, match="group or others"):
        await PageStore.open(str(shared / "store"), cfg())
    os.chmod(shared, 0o1777)  # like /tmp, owned by this user (root in CI): entries are safe
    st = await PageStore.open(str(shared / "store"), cfg())
    await st.close()
    os.chown(shared, OTHER_UID, -1)  # another user's directory: they may replace ours
    with pytest.raises(UnsafeStorePathError, match=f"owned by uid {OTHER_UID}"):
        await PageStore.open(str(shared / "store"), cfg())
    with pytest.raises(UnsafeStorePathError):
        await PageStore.open(str(shared / "store"), cfg(), readonly=True)


async def test_store_directory_writable_by_others_is_refused(store_dir):
    st = await PageStore.open(store_dir, cfg())
    await st.close()
    os.chmod(store_dir, 0o770)
    with pytest.raises(UnsafeStorePathError, match="chmod go-w"):
        await PageStore.open(store_dir, cfg())


@pytest.mark.parametrize("name", ["LOCK", MANIFEST_FILE, INDEX_FILE, INDEX_FILE + "-lock", segment_name(0)])
async def test_store_files_owned_by_another_user_are_refused(store_dir, name):
    st = await PageStore.open(store_dir, cfg())
    assert all(await put(st, ["a"]))
    await st.close()
    p = os.path.join(store_dir, name)
    if not os.path.exists(p):
        open(p, "wb").close()
    before = open(p, "rb").read()
    os.chown(p, OTHER_UID, -1)
    with pytest.raises(Exception) as e:
        await PageStore.open(store_dir, cfg())
    assert f"owned by uid {OTHER_UID}" in str(e.value) and name in str(e.value), str(e.value)
    assert open(p, "rb").read() == before  # not written, not moved aside
    if name == segment_name(0):  # a reader opens segments on first use: that read misses
        ro = await PageStore.open(store_dir, cfg(), readonly=True)
        assert await got(ro, ["a"]) == [False]
        await ro.close()
    elif name != "LOCK":  # a reader takes no LOCK
        with pytest.raises(Exception, match=f"owned by uid {OTHER_UID}"):
            await PageStore.open(store_dir, cfg(), readonly=True)


async def test_index_lock_symlink_is_refused(store_dir, tmp_path):
    st = await PageStore.open(store_dir, cfg())
    await st.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 100)
    lock = os.path.join(store_dir, INDEX_FILE + "-lock")
    os.unlink(lock)
    os.symlink(victim, lock)
    for ro in (False, True):
        with pytest.raises(UnsafeStorePathError, match="symlink"):
            await PageStore.open(store_dir, cfg(), readonly=ro)
    assert victim.read_bytes() == b"x" * 100


async def test_manifest_temp_file_is_exclusive_and_never_followed(store_dir, tmp_path):
    st = await PageStore.open(store_dir, cfg())
    await st.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    # the old predictable temp name, planted as a symlink: the writer must neither follow nor fail on it
    planted = os.path.join(store_dir, f"{MANIFEST_FILE}.tmp.{os.getpid()}")
    os.symlink(victim, planted)
    st = await PageStore.open(store_dir, small_config(ssd_capacity_bytes=32 * MiB, ssd_segment_size_bytes=MiB))
    await st.close()  # the capacity changed: the manifest was rewritten
    assert read_manifest(store_dir)["ssd_capacity_bytes"] == 32 * MiB
    assert victim.read_bytes() == b"precious" and os.path.islink(planted)
    assert [n for n in os.listdir(store_dir) if ".tmp." in n] == [os.path.basename(planted)]


# ------------------------------------------------------------------ 1. an SGLang follower on a damaged index


@pytest.mark.timeout(240)
def test_sglang_follower_on_a_damaged_index_starts_and_misses_until_the_leader_repairs_it(tmp_path):
    from support import sglang_env as E

    E.require_sglang()
    from support.sglang_follower import Follower

    root = str(tmp_path / "l3")
    pool = E.mla_pool()
    leader = E.load_backend(E.storage_config(root, tp_rank=0, tp_size=2, is_mla=True), pool.host)
    hashes = E.page_hashes(128, seed=60)
    idx = pool.alloc_pages(128)
    E.fill_random(pool.host, idx[: 64 * E.PAGE_SIZE], 61)
    assert all(leader.batch_set_v1(hashes[:64], idx[: 64 * E.PAGE_SIZE], E.extra_info([])))
    leader.close()
    ipath = os.path.join(root, INDEX_FILE)
    os.truncate(ipath, os.path.getsize(ipath) // 2)  # a power loss in relaxed mode, say
    follower = Follower(root)  # register_mem_pool_host on the damaged store: no SIGBUS, no raise
    try:
        assert follower.read() == ["started", "0", "True"]
        assert follower.send("check 64 61")[:3] == ["checked", "0", "0"]  # misses, not a crash
        leader = E.load_backend(E.storage_config(root, tp_rank=0, tp_size=2, is_mla=True), pool.host)  # repairs
        assert glob.glob(ipath + ".corrupt-*")
        assert all(leader.batch_set_v1(hashes[:64], idx[: 64 * E.PAGE_SIZE], E.extra_info([])))
        deadline = time.monotonic() + 30  # a hang guard: a follower retries its open at most every 50 ms
        while (got := follower.send("check 64 61"))[1] != "64" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == ["checked", "64", "64", "True", "[True,", "True]", "0"]
        leader.close()
    finally:
        follower.stop()


def _rename_key_in_leaf(index_path: str, old: bytes, new: bytes) -> None:
    """Overwrite a key's bytes inside its leaf page (same length): the damage a flipped bit does."""
    data = open(index_path, "rb").read()
    at = -1
    while True:
        at = data.find(old, at + 1)
        assert at >= 0, "key not found in a leaf page"
        page = at // 4096 * 4096
        if int.from_bytes(data[page + 10 : page + 12], "little") & 0x02:  # P_LEAF
            break
    with open(index_path, "r+b") as f:
        f.seek(at)
        f.write(new)


async def test_a_key_renamed_in_its_leaf_never_serves_another_keys_bytes(template, tmp_path, caplog):
    """A damaged key that now equals its neighbour carries that neighbour's-neighbour record: the
    scan sees keys out of LMDB's order, and the writer rebuilds the index without both."""
    path = str(tmp_path / "s")
    shutil.copytree(template, path)
    keys = [f"{'p' * 90}-{i:05d}" for i in range(_TEMPLATE_KEYS)]
    _rename_key_in_leaf(os.path.join(path, INDEX_FILE), keys[12].encode(), keys[13].encode())
    s = verify_records(path)  # a reader reports it and leaves both out
    assert s["index_damage"] == "2 keys out of order (damaged nodes)" and s["checked"] == _TEMPLATE_KEYS - 2
    caplog.set_level(logging.INFO, logger="umbp_nvme")
    st = await PageStore.open(path, cfg())
    errs = errors_logged(caplog)
    assert len(errs) == 1 and "damaged nodes" in errs[0] and "record areas of the segments" in errs[0], errs
    assert len(glob.glob(os.path.join(path, INDEX_FILE + ".corrupt-*"))) == 1
    hits = await got(st, keys)  # wrong bytes fail inside got()
    # issue 14: rebuilt from the records in the segments, the damaged nodes' keys come back too
    assert [k for k, h in zip(keys, hits) if not h] == []
    assert all(await put(st, [keys[12], keys[13]]))
    await st.close()
    st = await PageStore.open(path, cfg())
    assert await got(st, keys) == [True] * _TEMPLATE_KEYS
    await st.close()


async def test_a_key_renamed_into_a_new_key_in_order_is_not_served(template, tmp_path, caplog):
    """A flipped key byte that keeps LMDB's order and names a key the store never held: the record's
    key checksum (FLAG_KEYCRC) tells it belongs to another key, so no opener serves it."""
    path = str(tmp_path / "s")
    shutil.copytree(template, path)
    keys = [f"{'p' * 90}-{i:05d}" for i in range(_TEMPLATE_KEYS)]
    ghost = f"{'p' * 90}-0001/"  # sorts between keys[9] and keys[10]: LMDB's order still holds
    assert keys[9] < ghost < keys[10]
    _rename_key_in_leaf(os.path.join(path, INDEX_FILE), keys[10].encode(), ghost.encode())
    ro = await PageStore.open(path, cfg(), readonly=True)  # a follower looks keys up one by one
    assert await got(ro, [ghost, keys[10], keys[11]]) == [False, False, True]
    assert await ro.exists_many([ghost, keys[11]]) == [False, True]
    assert await ro.exists_prefix([keys[9], ghost]) == 1
    await ro.close()
    caplog.set_level(logging.INFO, logger="umbp_nvme")
    st = await PageStore.open(path, cfg())  # the writer's scan finds it and rebuilds without it
    errs = errors_logged(caplog)
    assert len(errs) == 1 and "1 keys that do not match" in errs[0], errs
    assert await st.exists_many([ghost, keys[10]]) == [False, True]  # rebuilt from the segments (issue 14)
    hits = await got(st, keys + [ghost])
    assert [k for k, h in zip(keys + [ghost], hits) if not h] == [ghost]
    await st.close()


async def test_a_flipped_byte_in_the_manifest_namespace_is_damage_not_another_model(store_dir, caplog):
    """The manifest carries a checksum: a byte flipped inside the namespace is damage (moved aside,
    the writer keeps serving), while a manifest written for another model is still refused."""
    from umbp_nvme.errors import NamespaceMismatchError

    ns = {"model": "llama-8b", "tp_size": 1}
    st = await PageStore.open(store_dir, cfg(), namespace=ns)
    assert all(await put(st, ["a", "b"]))
    await st.close()
    mpath = os.path.join(store_dir, MANIFEST_FILE)
    data = open(mpath, "rb").read()
    assert b'"crc32c"' in data
    open(mpath, "wb").write(data.replace(b"llama-8b", b"llama-9b"))  # still valid JSON, another model
    caplog.set_level(logging.INFO, logger="umbp_nvme")
    st = await PageStore.open(store_dir, cfg(), namespace=ns)
    errs = errors_logged(caplog)
    assert len(errs) == 1 and "checksum does not match" in errs[0], errs
    assert len(glob.glob(mpath + ".corrupt-*")) == 1
    assert all(await put(st, ["c"])) and (await got(st, ["c"])) == [True]
    await st.close()
    assert read_manifest(store_dir)["namespace"] == ns
    with pytest.raises(NamespaceMismatchError, match="llama-8b"):  # a real other model: refused
        await PageStore.open(store_dir, cfg(), namespace={"model": "qwen", "tp_size": 1})
