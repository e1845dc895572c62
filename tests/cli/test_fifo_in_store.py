"""A FIFO planted in a store directory in place of a segment file or LOCK never hangs a reader.

A read-only open of a FIFO waits for a writer forever: a follower's get, `warmup` from that store,
`export`, `verify`, `stats` and `compact` hung there. Each case runs in a child so code that hangs
fails by its timeout instead of hanging the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import ROOT
from support.cli_stores import CAP, items, make_store

TIMEOUT_S = 60


def _child(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _child(f"import sys; import umbp_nvme.cli.main as cli; sys.exit(cli.main({list(args)!r}))")


def _store_with_fifo(tmp_path, name: str) -> tuple[str, dict]:
    a = str(tmp_path / "a")
    data = items(4, 4096)  # 8 objects, all in segment 0
    make_store(a, data)
    os.unlink(os.path.join(a, name))
    os.mkfifo(os.path.join(a, name))
    return a, data


def test_follower_get_from_a_fifo_segment_misses_without_hanging(tmp_path):
    a, data = _store_with_fifo(tmp_path, "seg-00000.dat")
    r = _child(f"""
        import asyncio, numpy as np
        from support.cli_stores import _cfg
        from umbp_nvme.engine import files
        from umbp_nvme.store import PageStore

        async def run():
            s = await PageStore.open({a!r}, _cfg(), readonly=True)
            try:
                keys = {list(data)!r}
                print(await s.get_many(keys, [np.zeros(4096, np.uint8) for _ in keys]))
            finally:
                await s.close()
        asyncio.run(run())
        print("no_direct", len(files.direct_refusals()))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == str([False] * 8)
    assert "seg-00000.dat is not a regular file" in r.stderr
    # the FIFO's EINVAL for O_DIRECT is not taken for the file system refusing O_DIRECT
    assert "O_DIRECT refused" not in r.stderr and "no_direct 0" in r.stdout


def test_warmup_export_and_verify_from_a_store_with_a_fifo_segment_report_it(tmp_path):
    a, data = _store_with_fifo(tmp_path, "seg-00000.dat")
    b = str(tmp_path / "b")
    r = _cli("warmup", "--store", b, *CAP, "--json", a)
    assert r.returncode == 1, r.stderr
    assert '"failed": 8' in r.stdout and "seg-00000.dat is not a regular file" in r.stdout
    r = _cli("export", "--store", a, "--out", str(tmp_path / "x.umbparc"))
    assert r.returncode == 1 and "8 objects failed their checksum" in r.stdout, (r.stdout, r.stderr)
    r = _cli("verify", "--store", a)
    assert r.returncode == 1 and "8 bad" in r.stdout, (r.stdout, r.stderr)
    assert os.path.exists(os.path.join(a, "seg-00000.dat"))  # nothing read from it, nothing removed


def test_a_fifo_lock_file_neither_hangs_stats_nor_compact(tmp_path):
    a, _ = _store_with_fifo(tmp_path, "LOCK")
    r = _cli("stats", "--store", a, "--json")
    assert r.returncode == 0, r.stderr
    assert '"writer_pid": null' in r.stdout and '"objects": 8' in r.stdout
    r = _cli("compact", "--store", a)
    assert r.returncode == 2 and "LOCK is not a regular file" in r.stderr, r.stderr
