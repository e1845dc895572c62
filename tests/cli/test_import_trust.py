"""What the CLI's import and replay paths take from the operator and the sources is checked before
it is used: absurd throttles and timeouts are clear rc-2 errors, not a run that never ends or a
traceback (umbp_nvme/cli/warmup.py, replay.py, main.py)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import select
import socket
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import ROOT
from support.cli_stores import CAP, items, make_store, read_store, run_cli
from support.virtual_time import run_virtual

import umbp_nvme.cli.main as cli
from umbp_nvme.cli.archive import ArchiveReader, ArchiveWriter
from umbp_nvme.keybytes import printable_key
from umbp_nvme.cli.warmup import TokenBucket


def _cli(*args: str, timeout: float = 60, stdin=None) -> subprocess.CompletedProcess:
    """The command in a child: code that hangs fails the test by its timeout instead of hanging it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "umbp_nvme.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=stdin)


# --- --max-gbps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", ["1e-300", "5e-324", "0.000999", "1e7", "inf"])
def test_max_gbps_outside_its_range_is_a_clear_rc2_error(tmp_path, rate):
    a = str(tmp_path / "a")
    make_store(a, items(2, 4096))
    b = str(tmp_path / "b")
    # the old code slept ~1e290 s on 1e-300: _cli's timeout fails it, no bound on elapsed time here
    r = _cli("warmup", "--store", b, *CAP, "--max-gbps", rate, a)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--max-gbps must be between 0.001 GB/s (1 MB/s) and 1e+06 GB/s" in r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(os.path.join(b, "MANIFEST.json"))  # refused before anything was opened


def test_max_gbps_at_the_floor_is_taken(tmp_path, capsys):
    a = str(tmp_path / "a")
    data = items(1, 4096)  # 2 objects, 8 KiB: inside the 0.25 s burst at 1 MB/s
    make_store(a, data)
    b = str(tmp_path / "b")
    rc, out, err = run_cli(capsys, "warmup", "--store", b, *CAP, "--max-gbps", "0.001", "--json", a)
    assert rc == 0, err
    assert json.loads(out)["imported"] == 2 and read_store(b, list(data)) == data


def test_one_wait_is_never_longer_than_its_bytes_take_at_the_rate():
    t = [0.0]
    b = TokenBucket(1000.0, burst_s=0.5, clock=lambda: t[0])
    assert b.delay_for(10_000) == pytest.approx(9.5)  # past the burst
    # that wait was cut short (Ctrl-C, a cancelled task): the old bucket charged its whole debt again
    # (9.6 s for 100 bytes); 100 bytes at 1000 B/s take 0.1 s
    assert b.delay_for(100) <= 0.1 + 1e-12
    t[0] += 0.1
    assert b.delay_for(100) <= 0.1 + 1e-12
    t[0] += 1000.0  # idle: the balance refills only up to the burst
    assert b.delay_for(500) == 0.0 and b.delay_for(1000) == pytest.approx(1.0)


def test_a_throttle_wait_ends_soon_after_stop():
    """On virtual time (the bucket on the loop's clock): what is asserted is the wait's own steps."""
    stop = threading.Event()

    async def run(loop) -> float:
        b = TokenBucket(1000.0, clock=loop.time)
        loop.call_later(0.1, stop.set)
        t0 = loop.time()
        await b.take(1_000_000, stop)  # a 1000 s wait
        return loop.time() - t0

    took = run_virtual(run)
    assert 0.1 <= took <= 0.1 + 0.2 + 1e-9  # ended at its first look after stop (it looks every 0.2 s)


# --- warmup --replay ----------------------------------------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["--timeout", "1e300"], "--timeout must be between 0.1 and 86400 seconds, got 1e+300"),  # was OverflowError
    (["--timeout", "inf"], "--timeout must be between 0.1 and 86400 seconds, got inf"),  # was OverflowError
    (["--timeout", "1e-300"], "--timeout must be between 0.1 and 86400 seconds, got 1e-300"),
    (["--concurrency", "0"], "--concurrency must be 1..1024, got 0"),  # was a ValueError traceback
    (["--concurrency", "100000"], "--concurrency must be 1..1024, got 100000"),
])
def test_replay_refuses_absurd_timeouts_and_concurrency_with_rc2(tmp_path, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hello"\n')
    r = _cli("warmup", "--replay", str(prompts), "--server", "http://127.0.0.1:9", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip() == f"umbp-nvme warmup: error: {message}"


# --- HiCacheFile pages written while read ------------------------------------------------------


def test_a_hicachefile_page_rewritten_while_read_is_not_imported_torn(tmp_path, capsys, monkeypatch):
    src = tmp_path / "hicache"
    src.mkdir()
    page = src / f"{'ab' * 32}_m_0_1.bin"
    old, new = b"o" * 16384, b"n" * 16384
    page.write_bytes(old)
    real_readv = os.readv
    calls = []

    def readv_while_rewritten(fd, bufs):
        # the first read gets half the page, then HiCacheFile rewrites it in place (same size), and the
        # next read gets the rest from the new bytes: old K half, new V half
        calls.append(fd)
        if len(calls) > 1:
            return real_readv(fd, bufs)
        n = real_readv(fd, [bufs[0][: len(bufs[0]) // 2]])
        time.sleep(0.05)  # past the file system's timestamp tick
        with open(page, "r+b") as f:
            f.write(new)
        return n

    monkeypatch.setattr(os, "readv", readv_while_rewritten)
    store = str(tmp_path / "store")
    rc, out, err = run_cli(capsys, "warmup", "--store", store, "--model", "m", *CAP, "--json", str(src))
    monkeypatch.setattr(os, "readv", real_readv)
    s = json.loads(out)
    assert len(calls) == 2 and rc == 1, (out, err)
    assert (s["imported"], s["failed"]) == (0, 2)
    assert any("was written while being imported" in e for e in s["errors"])
    keys = [f"{'ab' * 32}_0_k", f"{'ab' * 32}_0_v"]
    assert read_store(store, keys) == {k: None for k in keys}  # the old code stored 'o' * 8192 and 'n' * 8192
    rc, out, err = run_cli(capsys, "warmup", "--store", store, "--model", "m", *CAP, "--json", str(src))
    assert rc == 0 and json.loads(out)["imported"] == 2  # run again: the page as it is now
    assert read_store(store, keys) == {keys[0]: new[:8192], keys[1]: new[8192:]}


# --- JSON the operator passes ----------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--config", "--namespace", "--store"])
def test_json_nested_too_deep_is_a_clear_rc2_error(tmp_path, flag):
    deep = "[" * 100_000  # json raises RecursionError, which the old code let out as a traceback
    a = str(tmp_path / "a")
    make_store(a, items(1, 4096))
    args = {"--config": ["--store", str(tmp_path / "b"), "--config", deep, a],
            "--namespace": ["--store", str(tmp_path / "b"), "--namespace", deep, a],
            "--store": ["--store", deep, a]}[flag]
    r = _cli("warmup", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "umbp-nvme warmup: error: " in r.stderr
    assert ("nor a JSON file" in r.stderr or "not one" in r.stderr) and len(r.stderr) < 1000
    assert not os.path.exists(tmp_path / "b")


# --- export onto a pipe or a device ----------------------------------------------------------------


def test_export_onto_a_fifo_writes_into_it_and_leaves_the_fifo(tmp_path):

    a = str(tmp_path / "a")
    data = items(40, 4096)  # 80 objects, 320 KiB: more than a pipe holds, so the reader must drain it
    make_store(a, data)
    fifo = str(tmp_path / "out.fifo")
    os.mkfifo(fifo)
    rd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader is there: the export's open never waits
    rcs = []
    t = threading.Thread(target=lambda: rcs.append(cli.main(["export", "--store", a, "--out", fifo])))
    t.start()
    got = bytearray()
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            select.select([rd], [], [], 0.2)
            try:
                chunk = os.read(rd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk and not t.is_alive():
                break  # the writer closed (the old code renamed a file over the FIFO and never opened it)
            got += chunk
    finally:
        os.close(rd)
        t.join(60)
    assert rcs == [0]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced by a regular file"
    r = ArchiveReader(io.BytesIO(bytes(got)))
    assert {k: v for k, v, ok in r if ok} == data and r.complete


def test_export_onto_a_device_node_writes_into_it_and_never_replaces_it(tmp_path):

    a = str(tmp_path / "a")
    make_store(a, items(2, 4096))
    null = str(tmp_path / "null")  # a private /dev/null: the old code renamed a regular file over it
    try:
        os.mknod(null, stat.S_IFCHR | 0o600, os.makedev(1, 3))
        with open(null, "wb") as f:
            f.write(b"x")
    except OSError as e:
        pytest.skip(f"cannot make a character device here: {e}")
    assert cli.main(["export", "--store", a, "--out", null]) == 0
    st = os.lstat(null)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert [n for n in os.listdir(tmp_path) if ".partial." in n] == []


@pytest.mark.parametrize("spelling", ["same", "slash", "dotdot", "symlink"])
def test_a_store_imported_into_itself_is_refused_clearly_and_left_as_it_was(tmp_path, spelling):
    a = str(tmp_path / "a")
    data = items(2, 4096)
    make_store(a, data)
    os.symlink(a, tmp_path / "link")
    src = {"same": a, "slash": a + "/", "dotdot": str(tmp_path / "a" / ".." / "a"), "symlink": str(tmp_path / "link")}[spelling]
    r = _cli("warmup", "--store", a, *CAP, src)
    assert r.returncode == 2, r.stderr
    # the old message: "index.lmdb is open read-only in this process; close those handles ..."
    assert r.stderr.strip() == (f"umbp-nvme warmup: error: SOURCE {src} is the store being filled (--store); "
                                "it holds every key already")
    assert read_store(a, list(data)) == data


# --- list files the operator names -----------------------------------------------------------------


def test_a_keys_file_without_line_ends_is_refused_not_read_into_memory(tmp_path):
    a = str(tmp_path / "a")
    make_store(a, items(1, 4096))
    # /dev/zero: one endless line (the old code read it until MemoryError or the OOM killer)
    r = subprocess.run(f"ulimit -v 4000000; exec {sys.executable} -m umbp_nvme.cli warmup --store {tmp_path / 'b'} "
                       f"--keys /dev/zero {a}", shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == ("umbp-nvme warmup: error: the keys file /dev/zero has a line of 64 KiB or more; "
                                "it must list one key per line")


def test_a_prompts_file_with_bytes_that_are_not_utf8_names_the_line(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'"ok"\n"\xff\xfe"\n')
    r = _cli("warmup", "--replay", str(prompts), "--server", "http://127.0.0.1:9")
    assert r.returncode == 2, r.stderr  # the old message named neither the file nor the line
    assert r.stderr.startswith(f"umbp-nvme warmup: error: {prompts}:2: not valid JSON (")


def test_a_prompts_file_without_line_ends_is_refused_not_read_into_memory(tmp_path):
    r = subprocess.run(f"ulimit -v 4000000; exec {sys.executable} -m umbp_nvme.cli warmup --replay /dev/zero "
                       "--server http://127.0.0.1:9", shell=True, cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip() == "umbp-nvme warmup: error: /dev/zero:1: a line over 64 MiB; each line must be one prompt"


@pytest.mark.parametrize("digits", [400, 5000])
def test_a_size_with_hundreds_of_digits_is_a_clear_rc2_error(tmp_path, digits):
    # float('9' * 400) is inf: int() of it was an OverflowError traceback out of argparse
    a = str(tmp_path / "a")
    make_store(a, items(1, 4096))
    r = _cli("stats", "--store", a, "--capacity", "9" * digits)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    if digits == 400:  # parsed exactly, then refused by the config's own check
        assert r.stderr.startswith("umbp-nvme stats: error: ") and "holds more than 16777216 segments" in r.stderr
    else:  # past Python's int digit limit: refused by the parser, the value cut short
        assert "argument --capacity: '999" in r.stderr and "is not a size" in r.stderr and len(r.stderr) < 1000
    assert cli.parse_size("9" * 30 + "k") == int("9" * 30) * 1024  # exact, not rounded through a float


def test_a_source_that_is_a_socket_or_block_device_is_named_for_what_it_is(tmp_path):
    sock_path = str(tmp_path / "s.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(sock_path)
    try:
        r = _cli("warmup", "--store", str(tmp_path / "b"), *CAP, sock_path, str(tmp_path / "missing"))
    finally:
        s.close()
    assert r.returncode == 2  # the old message said the socket "does not exist"
    assert r.stderr.strip() == (f"umbp-nvme warmup: error: warm-up source {sock_path} is a socket; give a "
                                "HiCacheFile directory, a store directory or an archive")
    blk = str(tmp_path / "blk")
    try:
        os.mknod(blk, stat.S_IFBLK | 0o600, os.makedev(7, 200))  # a loop device node: never opened
    except OSError as e:
        pytest.skip(f"cannot make a block device node here: {e}")
    r = _cli("warmup", "--store", str(tmp_path / "b"), *CAP, blk)
    assert r.returncode == 2 and f"warm-up source {blk} is a block device;" in r.stderr, r.stderr
    r = _cli("warmup", "--store", str(tmp_path / "b"), *CAP, str(tmp_path / "missing"))
    assert r.returncode == 2 and f"warm-up source {tmp_path / 'missing'} does not exist;" in r.stderr, r.stderr
    assert not os.path.exists(tmp_path / "b")


def test_an_archive_namespace_too_large_for_a_manifest_is_refused_before_the_store_is_made(tmp_path):
    arc = str(tmp_path / "x.umbparc")
    with open(arc, "wb") as f, ArchiveWriter(f, {"model": "m", "pad": "x" * (2 << 20)}) as w:
        w.add("k1", np.ones(4096, np.uint8))
    b = str(tmp_path / "b")
    r = _cli("warmup", "--store", b, *CAP, arc)
    # the old import succeeded and wrote a 2 MiB MANIFEST.json that stats and every reader refused as damaged
    assert r.returncode == 2, r.stdout
    assert "namespace of 2097" in r.stderr and "is over the 65536 a store manifest records" in r.stderr
    assert not os.path.exists(os.path.join(b, "MANIFEST.json"))
    small = str(tmp_path / "small.umbparc")
    with open(small, "wb") as f, ArchiveWriter(f, {"model": "m", "pad": "x" * 60_000}) as w:
        w.add("k1", np.ones(4096, np.uint8))
    r = _cli("warmup", "--store", b, *CAP, small)
    assert r.returncode == 0, r.stderr
    assert _cli("stats", "--store", b).returncode == 0


# --- names and keys in messages ----------------------------------------------------------------------


def test_control_characters_in_keys_and_names_are_escaped_in_messages():
    assert printable_key("a\nb\x1b[31m\x7f") == "a\\x0ab\\x1b[31m\\x7f"
    assert printable_key("k\u2028\x85é\udcff") == "k\\u2028\\x85é\\xff"
    assert printable_key("0123abcd_0_k") == "0123abcd_0_k"


def test_a_hicachefile_name_with_a_newline_cannot_forge_a_line_of_the_summary(tmp_path, capsys):
    src = tmp_path / "hicache"
    src.mkdir()
    forged = "\numbp-nvme: all 1000000 pages imported\x1b[2K"
    (src / f"ab{forged}_m_0_1.bin").write_bytes(b"x" * 100)  # not the 8192-byte page: refused, named
    (src / f"{'cd' * 32}_m_0_1.bin").write_bytes(b"y" * 8192)
    rc, out, err = run_cli(capsys, "warmup", "--store", str(tmp_path / "store"), "--model", "m", *CAP,
                           "--page-bytes", "8192", str(src))
    assert rc == 1
    text = out + err
    assert "\x1b" not in text and not any(ln.startswith("umbp-nvme: all") for ln in text.splitlines())
    assert "\\x0aumbp-nvme: all 1000000 pages imported\\x1b[2K_m_0_1.bin is 100 bytes" in text


def test_export_of_several_drives_onto_a_device_is_refused_not_written_beside_it(tmp_path):
    d0, d1 = str(tmp_path / "d0"), str(tmp_path / "d1")
    make_store(d0, items(1, 4096))
    make_store(d1, items(1, 4096, tag="q"))
    null = str(tmp_path / "null")
    try:
        os.mknod(null, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except OSError as e:
        pytest.skip(f"cannot make a character device here: {e}")
    r = _cli("export", "--store", f"{d0},{d1}", "--out", null)
    assert r.returncode == 2, (r.stdout, r.stderr)  # the old code wrote null.d0 and null.d1 beside the device
    assert f"give --out PATH of a new or regular file, not {null} (a pipe or device)" in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["d0", "d1", "null"]


# --- an object the store's segments cannot take ----------------------------------------------------


def test_warmup_of_an_object_too_large_for_the_segments_refuses_it_and_evicts_nothing(tmp_path, capsys):
    """Issue 34: a source object between (segment - 4 KiB) and one segment. Before, warmup put it,
    the put evicted the whole store and failed, and the summary still said "imported 600" of a
    store left with 0; now it is refused before any put, counted as too large, and named."""
    from umbp_nvme.config import StoreConfig
    from umbp_nvme.store import PageStore

    src = str(tmp_path / "src")
    small = items(300, 12 * 1024)  # 600 objects: a K and a V per page
    big = items(1, (1 << 20) - 100, tag="big")  # 2

    async def make_source():  # segments of 4 MiB take the big object; the 1 MiB of the target cannot
        s = await PageStore.open(src, StoreConfig(ssd_capacity_bytes=64 << 20, ssd_segment_size_bytes=4 << 20))
        try:
            for part in (small, big):
                assert all(await s.put_many(list(part), [np.frombuffer(bytearray(v), np.uint8) for v in part.values()]))
        finally:
            await s.close()

    asyncio.run(make_source())
    dest = str(tmp_path / "dest")
    rc, out, err = run_cli(capsys, "warmup", "--store", dest, *CAP, "--json", src)
    s = json.loads(out)
    assert rc == 1, (out, err)
    assert (s["imported"], s["failed"], s["too_large"]) == (600, 2, 2), s
    assert any(f"{(1 << 20) - 100} bytes" in e and "1044480" in e for e in s["errors"]), s["errors"]
    assert read_store(dest, list(small)) == small  # all 600 still there, byte-exact
    assert read_store(dest, list(big)) == {k: None for k in big}


def test_an_import_larger_than_the_store_says_how_many_objects_it_evicted_again(tmp_path, capsys, caplog):
    """The summary's imported count what was stored; when the import overflows the store, the summary says how
    many objects were evicted meanwhile, and the store holds only what fits."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    data = items(40, 12 * 1024)  # 2 objects per item, ~1 MiB in all
    make_store(a, data)
    small = ["--capacity", "4m", "--config", '{"ssd_segment_size_bytes": 1048576, "ssd_durability_mode": "relaxed"}']
    big = items(400, 12 * 1024, tag="big")  # 800 objects, ~9.6 MiB: more than the 4 MiB store takes
    make_store(c, big)
    caplog.set_level(logging.INFO, logger="umbp_nvme")
    rc, out, err = run_cli(capsys, "warmup", "--store", b, *small, "--json", c)
    s = json.loads(out)
    held = sum(v is not None for v in read_store(b, list(big)).values())
    assert s["evicted"] > 0 and s["imported"] == len(big) and held == s["imported"] - s["evicted"], (s, held)
    warned = [r.getMessage() for r in caplog.records if "during the import" in r.getMessage()]
    assert len(warned) == 1 and f"evicted {s['evicted']} objects" in warned[0], warned
    rc, out, err = run_cli(capsys, "warmup", "--store", str(tmp_path / "f"), *small, c)
    assert "evicted meanwhile" in out and "the store is smaller than what was imported" in out, out
    caplog.clear()
    # one that fits evicts nothing and says nothing about it
    rc, out, err = run_cli(capsys, "warmup", "--store", str(tmp_path / "d"), *CAP, "--json", a)
    s = json.loads(out)
    assert rc == 0 and s["evicted"] == 0 and s["imported"] == len(data)
    assert not [r for r in caplog.records if "during the import" in r.getMessage()]
    rc, out, err = run_cli(capsys, "warmup", "--store", str(tmp_path / "e"), *CAP, a)
    assert rc == 0 and "evicted meanwhile" not in out
