"""The small JSON files beside a store's data (DRIVES.json, OWED_DELETES.jsonl, STATS.json) are read
as untrusted: a FIFO in their place never blocks the open or `umbp-nvme stats`, and damage (nesting
too deep for the parser, bytes that are not UTF-8, a JSON value that is not an object) is ignored
like any other damage instead of raising out of the open (store/layout.read_json_or_none,
owed_deletes.py reading its lines, cli/drives.live_counters). Hangs are caught in a child by its timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

TIMEOUT_S = 60
DEEP = "[" * 100_000  # json raises RecursionError for it, which is not a ValueError


def _child(*parts: str) -> subprocess.CompletedProcess:
    code = "\n".join(textwrap.dedent(p) for p in parts)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


_PRELUDE = """
    import asyncio, os, sys, numpy as np
    from umbp_nvme.config import StoreConfig
    from umbp_nvme.store import PageStore
    roots = {roots!r}
    cfg = StoreConfig(ssd_storage_dir=roots, ssd_capacity_bytes=8 << 20, ssd_segment_size_bytes=1 << 20,
                      ssd_durability_mode="relaxed", ssd_io_backend="posix")
    keys = [f"k{{i}}" for i in range(8)]

    async def reads():
        s = await PageStore.open(roots, cfg)
        try:
            bufs = [np.zeros(4096, np.uint8) for _ in keys]
            ok = await s.get_many(keys, bufs)
            return [bool(o and (b == i + 1).all()) for i, (o, b) in enumerate(zip(ok, bufs))], s.drive_of(keys)
        finally:
            await s.close()
"""


def _two_drive_store(tmp_path) -> list[str]:
    roots = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    r = _child(_PRELUDE.format(roots=roots), """
        async def fill():
            s = await PageStore.open(roots, cfg)
            try:
                assert all(await s.put_many(keys, [np.full(4096, i + 1, np.uint8) for i in range(len(keys))]))
            finally:
                await s.close()
        asyncio.run(fill())
    """)
    assert r.returncode == 0, r.stderr
    assert os.path.exists(os.path.join(roots[0], "DRIVES.json"))
    return roots


def _open_and_read(roots) -> tuple[list[bool], list[int]]:
    r = _child(_PRELUDE.format(roots=roots), """
        ok, drives = asyncio.run(reads())
        print(ok); print(drives)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    ok, drives = r.stdout.strip().split("\n")[-2:]
    return eval(ok), eval(drives)


def _replace(path: str, kind: str, text: str = "") -> None:
    os.unlink(path) if os.path.exists(path) else None
    if kind == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)


@pytest.mark.parametrize("kind", ["fifo", "deep"])
def test_a_damaged_drive_set_record_does_not_stop_the_open(tmp_path, kind):
    roots = _two_drive_store(tmp_path)
    _, drives = _open_and_read(roots)
    _replace(os.path.join(roots[0], "DRIVES.json"), kind, DEEP)  # the old open hung / raised RecursionError
    ok, _ = _open_and_read(roots)
    # the drive whose record is damaged has no history of its own (no other drive vouches for it):
    # cleared before it serves (issue 34); the other drive serves every key it holds
    assert ok == [d == 1 for d in drives]
    assert 0 in drives and 1 in drives


def test_a_fifo_owed_log_does_not_block_the_open(tmp_path):
    roots = _two_drive_store(tmp_path)
    _replace(os.path.join(roots[0], "OWED_DELETES.jsonl"), "fifo")  # the old open hung
    ok, _ = _open_and_read(roots)
    assert ok == [True] * 8


def test_damaged_owed_log_lines_are_skipped_and_the_intact_ones_applied(tmp_path):
    roots = _two_drive_store(tmp_path)
    _, drives = _open_and_read(roots)
    k = drives.index(1)  # a key on drive 1, owed (deleted) by a line in drive 0's log
    owe = json.dumps({"drive": roots[1], "at": 1, "keys": [f"k{k}"]})
    # a deep line was a RecursionError and a byte that is not UTF-8 a UnicodeDecodeError out of the open
    _replace(os.path.join(roots[0], "OWED_DELETES.jsonl"), "file", b"\n" + DEEP.encode() + b"\n\xff\xfe{\n"
             + owe.encode() + b"\n")
    ok, _ = _open_and_read(roots)
    assert ok == [i != k for i in range(8)]


@pytest.mark.parametrize("kind,text", [("fifo", ""), ("file", "5"), ("file", '"hits"'), ("file", DEEP)])
def test_stats_ignores_a_published_counters_file_that_is_not_an_object(tmp_path, kind, text):
    roots = _two_drive_store(tmp_path)
    _replace(os.path.join(roots[0], "STATS.json"), kind, text)  # old: hang, TypeError, TypeError, RecursionError
    r = _child(f"import sys; import umbp_nvme.cli.main as cli; sys.exit(cli.main(['stats', '--store', {roots[0]!r}]))")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "counters     none published" in r.stdout
