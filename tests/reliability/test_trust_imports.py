"""Issue 10, defects 7 (export side), 8 and 9: nothing an archive, a HiCacheFile directory or a
server sends is trusted before it is checked.

Each test drives the real CLI (in a subprocess where a crash, a hang, memory or stdin matter) and
asserts the exact bytes stored, the counts in the summary, the exit code and the message.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import io
import json
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, payload
from support.cli_stores import make_store, read_store

import umbp_nvme.cli.main as cli
from umbp_nvme.cli.archive import REC, REC_TAG, U32, ArchiveError, ArchiveReader, ArchiveWriter, crc32c_impl
from umbp_nvme.cli.hicache_files import file_read
from umbp_nvme.sglang.keys import KeyScheme

MiB = 1 << 20
CFG = '{"ssd_segment_size_bytes": 1048576, "ssd_durability_mode": "relaxed"}'
CAP = ["--capacity", "64m", "--config", CFG]
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}

# Runs the CLI and then reports the process's peak RSS on stderr's last line: a test can bound
# what a lying size made the command allocate. VmHWM belongs to this address space alone
# (ru_maxrss would carry the parent's peak across fork and exec).
_CLI_RSS = (
    "import sys\n"
    "import umbp_nvme.cli.main as cli\n"
    "try:\n"
    "    rc = cli.main(sys.argv[1:])\n"
    "finally:\n"
    "    sys.stdout.flush()\n"
    "    hwm = [ln.split()[1] for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0]\n"
    "    print('maxrss_kib', hwm, file=sys.stderr)\n"
    "sys.exit(rc)\n"
)


def cli_proc(*argv, stdin=None, input_=None, timeout=90):
    """The CLI in a fresh interpreter: (rc, stdout bytes, stderr text, peak RSS in MiB)."""
    p = subprocess.run([sys.executable, "-c", _CLI_RSS, *argv], input=input_, stdin=stdin, capture_output=True,
                       timeout=timeout, env=ENV)
    err = p.stderr.decode("utf-8", "backslashreplace")
    last = err.strip().splitlines()[-1] if err.strip() else ""
    rss = int(last.split()[1]) / 1024 if last.startswith("maxrss_kib") else None
    return p.returncode, p.stdout, err, rss


def kv(n: int, size: int = 12 * 1024, tag: str = "t") -> dict[str, bytes]:
    keys = KeyScheme().v1_keys([hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)])
    return {k: payload(k, size).tobytes() for k in keys}


def archive_bytes(records, namespace=None) -> bytes:
    f = io.BytesIO()
    with ArchiveWriter(f, namespace or {}) as w:
        for k, v in records:
            w.add(k, v)
    return f.getvalue()


def raw_record(key: bytes, data: bytes, *, length: int | None = None) -> bytes:
    """A record with a valid frame checksum for any key bytes and any declared length."""
    c = crc32c_impl()
    fixed = REC.pack(REC_TAG, len(key), len(data) if length is None else length, c(data))
    return fixed + U32.pack(c(fixed + key)) + key + data


def record_offsets(data: bytes) -> list[int]:
    """Byte offset of each record in a well-formed archive."""
    r = ArchiveReader(io.BytesIO(data))
    offs = []
    while True:
        at = r.offset
        h = r.next()
        if h is None:
            return offs
        offs.append(at)
        r.skip()


def summary_json(out: bytes) -> dict:
    return json.loads(out.decode())


# --- defect 8: archive import ----------------------------------------------------------------


def test_export_to_stdout_piped_into_warmup_from_stdin_is_byte_identical(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    items = kv(8)
    make_store(src, items)
    exp = subprocess.Popen([sys.executable, "-m", "umbp_nvme.cli", "export", "--store", src, "--out", "-"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    rc, out, err, _ = cli_proc("warmup", "--store", dst, *CAP, "--json", "-", stdin=exp.stdout)
    exp.stdout.close()
    assert exp.wait(timeout=60) == 0, exp.stderr.read()
    assert rc == 0, err
    s = summary_json(out)
    assert (s["imported"], s["failed"], s["bytes_imported"]) == (16, 0, 16 * 12 * 1024)
    assert read_store(dst, list(items)) == items
    assert b"exported 16 objects" in exp.stderr.read()


CUTS = ["inside_header_of_record_3", "inside_key_of_record_3", "inside_bytes_of_record_3", "at_record_3",
        "before_trailer", "inside_trailer"]


@pytest.mark.parametrize("via", ["file", "pipe"])
def test_truncated_archive_imports_every_intact_record_and_exits_1(tmp_path, via):
    recs = list(kv(3, size=8192).items())  # 6 records of 8 KiB
    data = archive_bytes(recs)
    offs = record_offsets(data)
    r3 = offs[2]
    trailer = len(data) - 32
    cut_at = {"inside_header_of_record_3": r3 + 10, "inside_key_of_record_3": r3 + 30,
              "inside_bytes_of_record_3": offs[3] - 100, "at_record_3": r3, "before_trailer": trailer,
              "inside_trailer": trailer + 20}
    for name in CUTS:
        dst = str(tmp_path / f"dst_{name}")
        blob = data[: cut_at[name]]
        intact = 6 if name in ("before_trailer", "inside_trailer") else 2
        if via == "file":
            p = tmp_path / f"{name}.umbparc"
            p.write_bytes(blob)
            rc, out, err, _ = cli_proc("warmup", "--store", dst, *CAP, "--json", str(p))
        else:
            rc, out, err, _ = cli_proc("warmup", "--store", dst, *CAP, "--json", "-", input_=blob)
        assert rc == 1, (name, err)
        assert "Traceback" not in err, (name, err)
        s = summary_json(out)
        assert s["imported"] == intact and s["failed"] == 1, (name, s)
        assert "truncated" in s["errors"][-1] and f"the {intact} records before it are intact" in s["errors"][-1], (name, s)
        got = read_store(dst, [k for k, _ in recs])
        assert got == {k: (v if i < intact else None) for i, (k, v) in enumerate(recs)}, name


def test_record_with_a_damaged_frame_fails_alone_and_the_rest_is_imported(tmp_path):
    recs = list(kv(3).items())
    data = bytearray(archive_bytes(recs))
    offs = record_offsets(bytes(data))
    data[offs[1] + 8] ^= 0x40  # record 2's declared length: its frame checksum no longer matches
    p = tmp_path / "a.umbparc"
    p.write_bytes(bytes(data))
    rc, out, err, _ = cli_proc("warmup", "--store", str(tmp_path / "dst"), *CAP, "--json", str(p))
    assert rc == 1 and "Traceback" not in err, err
    s = summary_json(out)
    assert (s["imported"], s["failed"]) == (5, 1), s
    assert f"record header checksum mismatch at byte {offs[1]}" in s["errors"][0]
    assert f"next intact frame at byte {offs[2]}" in s["errors"][0]
    got = read_store(str(tmp_path / "dst"), [k for k, _ in recs])
    assert got == {k: (None if i == 1 else v) for i, (k, v) in enumerate(recs)}


def test_non_utf8_key_bytes_round_trip_through_an_archive():
    key = b"odd\xff\xfe\x80_0_k".decode("utf-8", "surrogateescape")
    data = archive_bytes([("a_0_k", b"1" * 100), (key, b"2" * 100), ("b_0_k", b"3" * 100)])
    assert b"odd\xff\xfe\x80_0_k" in data  # the key's own bytes, not an escape
    got = list(ArchiveReader(io.BytesIO(data)))
    assert got == [("a_0_k", b"1" * 100, True), (key, b"2" * 100, True), ("b_0_k", b"3" * 100, True)]
    assert got[1][0].encode("utf-8", "surrogateescape") == b"odd\xff\xfe\x80_0_k"


def test_non_utf8_key_in_an_archive_does_not_abort_the_import_and_prints_unambiguously(tmp_path):
    good = list(kv(1).items())
    head = archive_bytes([])[:-32]  # header only; records and no trailer: truncated at the end
    bad_crc = bytearray(raw_record(b"odd\xff_0_k", b"z" * 4096))
    bad_crc[-1] ^= 1  # its bytes fail their CRC: reported with the key, printed as \xff
    blob = head + raw_record(good[0][0].encode(), good[0][1]) + bytes(bad_crc) + raw_record(good[1][0].encode(), good[1][1])
    p = tmp_path / "a.umbparc"
    p.write_bytes(blob)
    rc, out, err, _ = cli_proc("warmup", "--store", str(tmp_path / "dst"), *CAP, str(p))
    assert rc == 1 and "Traceback" not in err, err
    text = out.decode("utf-8")  # strict: the table holds no lone surrogate
    assert "record odd\\xff_0_k fails its CRC32C" in text
    assert read_store(str(tmp_path / "dst"), [k for k, _ in good]) == dict(good)


def test_empty_and_over_long_keys_fail_alone(tmp_path):
    good = list(kv(1).items())
    head = archive_bytes([])[:-32]
    blob = (head + raw_record(good[0][0].encode(), good[0][1]) + raw_record(b"", b"e" * 4096)
            + raw_record(b"k" * 600 + b"_0_k", b"l" * 4096) + raw_record(good[1][0].encode(), good[1][1]))
    p = tmp_path / "a.umbparc"
    p.write_bytes(blob)
    rc, out, err, _ = cli_proc("warmup", "--store", str(tmp_path / "dst"), *CAP, "--json", str(p))
    assert rc == 1 and "Traceback" not in err, err
    s = summary_json(out)
    assert (s["imported"], s["failed"]) == (2, 3), s  # empty key, long key, missing trailer
    assert any("has an empty key" in e for e in s["errors"]), s
    assert any("over the store's limit of 511" in e for e in s["errors"]), s
    assert read_store(str(tmp_path / "dst"), [k for k, _ in good]) == dict(good)


@pytest.mark.parametrize("declared", [512 * MiB, 1 << 40])
def test_declared_size_is_checked_before_anything_is_allocated(tmp_path, declared):
    head = archive_bytes([])[:-32]
    blob = head + raw_record(b"k_0_k", b"", length=declared) + b"x" * 10
    p = tmp_path / "lie.umbparc"
    p.write_bytes(blob)
    rc, out, err, rss = cli_proc("warmup", "--store", str(tmp_path / "dst"), *CAP, "--json", str(p))
    assert rc == 1 and "Traceback" not in err, err
    s = summary_json(out)
    assert (s["imported"], s["failed"]) == (0, 1)
    assert f"declares {declared} bytes but only 10 remain" in s["errors"][0]
    assert rss is not None and rss < 300, f"peak RSS {rss:.0f} MiB for a {len(blob)}-byte archive"


def test_declared_size_over_the_store_limit_fails_alone_on_a_pipe(tmp_path):
    good = list(kv(1).items())[0]
    head = archive_bytes([])[:-32]
    # a pipe has no size to check against: the store's largest object (1 MiB segments) bounds it
    blob = head + raw_record(b"huge_0_k", b"h" * (2 * MiB)) + raw_record(good[0].encode(), good[1])
    rc, out, err, _ = cli_proc("warmup", "--store", str(tmp_path / "dst"), *CAP, "--json", "-", input_=blob)
    assert rc == 1 and "Traceback" not in err, err
    s = summary_json(out)
    assert (s["imported"], s["failed"]) == (1, 2), s  # the huge record, then the missing trailer
    # one segment less the 4 KiB its records keep (issue 34): an object of one segment has no slot
    assert s["errors"][0] == f"<stdin>: record huge_0_k is 2097152 bytes, over the largest object this store takes ({MiB - 4096} bytes)"
    assert read_store(str(tmp_path / "dst"), [good[0]]) == {good[0]: good[1]}


# --- defect 8: HiCacheFile directories -------------------------------------------------------

SUFFIX = "_m_0_1"


def test_odd_hicachefile_entries_are_refused_one_by_one_without_blocking_or_reading_them(tmp_path):
    d = tmp_path / "hicache"
    d.mkdir()
    pages = {hashlib.sha256(f"g{i}".encode()).hexdigest(): payload(f"g{i}", 16384).tobytes() for i in range(3)}
    for h, b in pages.items():
        (d / f"{h}{SUFFIX}.bin").write_bytes(b)
    first = sorted(pages)[0]
    os.mkfifo(d / f"0fifo{SUFFIX}.bin")  # sorts first: opening it for reading would block forever
    (d / f"0dir{SUFFIX}.bin").mkdir()
    os.symlink(d / f"{first}{SUFFIX}.bin", d / f"0link{SUFFIX}.bin")
    with open(d / f"+sparse{SUFFIX}.bin", "wb") as f:  # 1 TiB of nothing; "+" sorts first, so it would set the page size
        f.truncate(1 << 40)
    with open(os.path.join(os.fsencode(d), b"0bad\xff" + f"{SUFFIX}.bin".encode()), "wb") as f:
        f.write(b"x" * 16384)
    rc, out, err, rss = cli_proc("warmup", "--store", str(tmp_path / "dst"), *CAP, "--model", "m", "--json", str(d),
                                 timeout=60)
    assert rc == 1 and "Traceback" not in err, err
    s = summary_json(out)
    assert (s["imported"], s["refused_files"], s["failed"]) == (6, 5, 0), s
    errs = "\n".join(s["errors"])
    assert f"+sparse{SUFFIX}.bin is 1099511627776 bytes, larger than the largest page this store takes ({2 * (MiB - 4096)} bytes); not read" in errs
    assert f"0fifo{SUFFIX}.bin is a FIFO, not a regular file" in errs
    assert f"0dir{SUFFIX}.bin is a directory, not a regular file" in errs
    assert f"0link{SUFFIX}.bin is a symbolic link, not a regular file; not imported (not followed)" in errs
    assert f"0bad\\xff{SUFFIX}.bin has a name that is not UTF-8" in errs
    assert rss < 300, rss
    keys = KeyScheme().v1_keys(list(pages))
    got = read_store(str(tmp_path / "dst"), keys)
    want = {}
    for h, b in pages.items():
        k, v = KeyScheme().v1_keys([h])
        want[k], want[v] = b[:8192], b[8192:]
    assert got == want


def test_file_read_never_blocks_on_a_fifo_or_follows_a_symlink_swapped_in_after_the_listing(tmp_path):
    fifo = str(tmp_path / "p")
    os.mkfifo(fifo)
    mv = memoryview(bytearray(4096))
    got = []
    t = threading.Thread(target=lambda: got.append(file_read(fifo)(mv)), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "opening a FIFO blocked"
    assert got == [f"{fifo} became a FIFO while being imported; not read"]
    target = tmp_path / "t"
    target.write_bytes(b"s" * 4096)
    os.symlink(target, tmp_path / "l")
    assert file_read(str(tmp_path / "l"))(mv) == f"{tmp_path / 'l'} became a symbolic link while being imported; not followed"
    big = tmp_path / "grown"
    big.write_bytes(b"g" * 8192)  # grew after its size was checked: never read past what was sized
    assert file_read(str(big))(mv) == f"{big} is now 8192 bytes, not 4096; it changed while being imported"
    assert bytes(mv) == bytes(4096)


# --- defect 9: --replay trusts the server ----------------------------------------------------

VALID = {"text": "x", "meta_info": {"prompt_tokens": 10, "cached_tokens": 4}}
REPLIES = {
    "list": b"[1]",
    "meta_str": b'{"meta_info": "x"}',
    "inf": b"1e999",
    "tokens_inf": b'{"meta_info": {"prompt_tokens": 1e999}}',
    "not_json": b"this is not json",
    "html": b"<html><body><h1>502 Bad Gateway</h1></body></html>",
    "empty": b"",
    "huge": None,  # 200 MiB of JSON-looking bytes, streamed
    "ok": json.dumps(VALID).encode(),
}


class _Liar(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        n = int(self.headers.get("Content-Length", 0))
        which = json.loads(self.rfile.read(n))["text"]
        body = REPLIES[which]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if body is None:
            chunk = b" " * MiB
            self.send_header("Content-Length", str(200 * MiB + 2))
            self.end_headers()
            try:
                self.wfile.write(b"[")
                for _ in range(200):
                    self.wfile.write(chunk)
                self.wfile.write(b"]")
            except OSError:  # the client stops reading at its limit
                pass
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@contextlib.contextmanager
def _loopback_server(handler):
    """An HTTP server on 127.0.0.1 with ``handler``; yields its URL, stops it afterwards."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_replay_counts_malformed_replies_as_failed_and_never_reads_more_than_the_limit(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(k) + "\n" for k in REPLIES))
    with _loopback_server(_Liar) as url:
        rc, out, err, rss = cli_proc("warmup", "--replay", str(prompts), "--server", url, "--concurrency", "1",
                                     "--json", timeout=120)
    assert rc == 1 and "Traceback" not in err, err
    s = summary_json(out)
    bad = len(REPLIES) - 1
    assert (s["sent"], s["ok"], s["failed"], s["malformed"]) == (len(REPLIES), 1, bad, bad), s
    assert (s["prompt_tokens"], s["cached_tokens"]) == (10, 4)
    errs = "\n".join(s["errors"])
    assert "reply larger than 16 MiB" in errs
    assert "reply is a JSON int, not an object" in errs  # [1]
    assert "meta_info is a JSON str, not an object" in errs
    assert "reply is a JSON float, not an object" in errs  # 1e999
    assert "meta_info.prompt_tokens is 'inf', not a token count" in errs
    assert "reply is not JSON" in errs and "<html>" in errs
    assert rss < 250, f"peak RSS {rss:.0f} MiB with one 200 MiB reply"


class _Dripper(http.server.BaseHTTPRequestHandler):
    """A valid reply, one byte every 50 ms: 20 s for the whole body."""

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"meta_info": {"prompt_tokens": 1, "cached_tokens": 0}, "pad": " " * 300}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            for b in body:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def log_message(self, *a):
        pass


def test_replay_timeout_bounds_a_reply_that_drips_in(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"a"\n')
    with _loopback_server(_Dripper) as url:
        rc, out, err, _ = cli_proc("warmup", "--replay", str(prompts), "--server", url, "--timeout", "1", "--json",
                                   timeout=60)
    # a socket timeout alone (it restarts with every byte) reads the whole ~17 s reply and counts it
    # ok: the counts and the message tell, with no bound on elapsed time that a loaded machine could miss
    assert rc == 1 and "Traceback" not in err, err
    s = summary_json(out)
    assert (s["sent"], s["ok"], s["failed"], s["malformed"]) == (1, 0, 1, 0), s
    assert "timed out (the reply was not complete after 1 s)" in s["errors"][0]


def test_parse_reply_accepts_only_generate_replies():
    from umbp_nvme.cli.replay import BadReply, parse_reply

    for raw in (b"[1]", b'{"meta_info":"x"}', b"1e999", b"\xff\xfe", b"[]", b'{"meta_info":{"cached_tokens":true}}',
                b"[" * 100000 + b"]" * 100000, b'{"meta_info":{"prompt_tokens":' + b"9" * 4000 + b"}}",
                b'{"meta_info":{"prompt_tokens":-1}}'):
        with pytest.raises(BadReply):
            parse_reply(raw)
    assert parse_reply(b'[{"meta_info": {"prompt_tokens": 7, "cached_tokens": 2}}]') == (7, 2)
    assert parse_reply(b'{"text": "x"}') == (0, 0)


# --- defect 7, export side -------------------------------------------------------------------


def test_export_temp_file_is_private_unpredictable_and_never_follows_a_planted_symlink(tmp_path, capsys):
    src = str(tmp_path / "src")
    items = kv(2)
    make_store(src, items)
    victim = tmp_path / "victim"
    victim.write_bytes(b"do not touch")
    out = tmp_path / "cache.umbparc"
    # the name the exporter used to write: a symlink planted there must not be followed
    os.symlink(victim, tmp_path / f".cache.umbparc.partial.{os.getpid()}")
    old = os.umask(0o022)
    try:
        rc = cli.main(["export", "--store", src, "--out", str(out)])
    finally:
        os.umask(old)
    assert rc == 0, capsys.readouterr().err
    assert victim.read_bytes() == b"do not touch"
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    assert [(k, v) for k, v, ok in ArchiveReader.open(str(out))] == list(items.items())
    leftovers = sorted(n for n in os.listdir(tmp_path) if n.startswith(".cache.umbparc.partial."))
    assert leftovers == [f".cache.umbparc.partial.{os.getpid()}"]  # only the planted link


def test_export_temp_names_differ_and_are_created_exclusively(tmp_path):
    from umbp_nvme.cli.export import open_for_write

    out = str(tmp_path / "x.umbparc")
    f1, t1 = open_for_write(out)
    f2, t2 = open_for_write(out)
    try:
        assert t1 != t2 and os.path.dirname(t1) == str(tmp_path)
        assert stat.S_IMODE(os.fstat(f1.fileno()).st_mode) == 0o600
    finally:
        f1.close()
        f2.close()


# --- the reader under random damage ----------------------------------------------------------


def test_reader_under_random_damage_never_crashes_and_never_returns_wrong_bytes():
    """Truncation at every record boundary and inside records, flipped bytes in frames and payloads,
    lying sizes: the reader either returns records whose CRC verifies with exactly the bytes written
    under that key, or stops with ArchiveError. Never another exception, never a wrong byte."""
    import random

    rng = random.Random(10)
    recs = [(f"k{i:03d}_0_k", rng.randbytes(rng.choice([0, 1, 100, 4096, 5000]))) for i in range(12)]
    recs.append((b"odd\xff_0_v".decode("utf-8", "surrogateescape"), b"o" * 77))
    truth = dict(recs)
    data = archive_bytes(recs, {"model": "m"})
    offs = record_offsets(data)
    cases = [data[:n] for n in offs + [len(data) - 32, len(data) - 1]]  # every boundary
    cases += [data[: o + d] for o in offs for d in (3, 11, 28, 30)]  # inside frames and keys
    for _ in range(300):
        b = bytearray(data)
        kind = rng.randrange(3)
        if kind == 0:  # flipped bytes anywhere after the header
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(offs[0], len(b))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # a lying length with a valid frame checksum
            i = rng.randrange(len(offs))
            end = offs[i + 1] if i + 1 < len(offs) else len(data) - 32
            key = bytes(b[offs[i] + 24 : offs[i] + 24 + REC.unpack_from(b, offs[i])[1]])
            lie = rng.choice([0, 1, 1 << 20, 512 * MiB, 1 << 40, (1 << 64) - 1])
            fixed = bytearray(REC.pack(REC_TAG, len(key), lie, REC.unpack_from(b, offs[i])[3]))
            b[offs[i] : offs[i] + 24] = fixed + U32.pack(crc32c_impl()(bytes(fixed) + key))
            assert end > offs[i]
        else:  # a random cut
            del b[rng.randrange(offs[0], len(b)) :]
        cases.append(bytes(b))
    Pipe = _ShortReads  # no size, no seek, short reads

    seen_ok = 0
    for blob in cases:
        for f in (io.BytesIO(blob), io.BufferedReader(Pipe(blob), 4096)):
            try:
                r = ArchiveReader(f, max_object_bytes=1 << 20)
                for k, v, ok in r:
                    if ok:
                        assert truth.get(k) == v, f"wrong bytes under {k!r}"
                        seen_ok += 1
            except ArchiveError:
                pass
    assert len(cases) >= 300 and seen_ok > 2000


def test_export_onto_a_directory_is_a_clear_error_and_leaves_no_temp_file(tmp_path):
    src = str(tmp_path / "src")
    make_store(src, kv(1))
    (tmp_path / "out").mkdir()
    rc, out, err, _ = cli_proc("export", "--store", src, "--out", str(tmp_path / "out"))
    assert rc == 2 and "Traceback" not in err, err
    assert "umbp-nvme export: error: [Errno 21] Is a directory" in err
    assert sorted(os.listdir(tmp_path)) == ["out", "src"] and os.listdir(tmp_path / "out") == []


def test_a_source_with_thousands_of_bad_records_keeps_20_messages_and_counts_the_rest(tmp_path):
    head = archive_bytes([])[:-32]
    bad = []
    for i in range(30):
        r = bytearray(raw_record(f"bad{i:02d}_0_k".encode(), b"b" * 100))
        r[-1] ^= 1  # its bytes fail their CRC
        bad.append(bytes(r))
    recs = [("good_0_k", b"g" * 100)]
    blob = head + b"".join(bad) + archive_bytes(recs)[len(head):]
    p = tmp_path / "a.umbparc"
    p.write_bytes(blob)
    rc, out, err, _ = cli_proc("warmup", "--store", str(tmp_path / "dst"), *CAP, "--json", str(p))
    assert rc == 1, err
    s = summary_json(out)
    # 30 CRC failures; the trailer counts 1 record where the stream held 31: one more failure
    assert (s["imported"], s["failed"], len(s["errors"]), s["more_errors"]) == (1, 31, 20, 11), s
    assert err.count("WARNING") == 20
    rc, out, err, _ = cli_proc("warmup", "--store", str(tmp_path / "dst2"), *CAP, str(p))
    assert "  ! ... and 21 more (--json lists the first 20)" in out.decode()


def test_inspect_refuses_a_key_with_no_byte_form_alone_and_clearly(tmp_path, capsys):
    src = str(tmp_path / "src")
    make_store(src, kv(1))
    for bad, why in (("", "empty key"), ("x\ud800_0_k", "lone surrogate at 1 ('\\ud800')")):
        rc = cli.main(["inspect", "--store", src, "fine_0_k", bad])
        err = capsys.readouterr().err
        assert rc == 2, err
        assert why in err and "cannot be a store key" in err, err


def test_archive_header_nested_a_million_deep_is_damage_not_a_crash():
    import struct

    blob = b"[" * 1_000_000 + b"]" * 1_000_000
    c = crc32c_impl()
    head = b"UMBPARCH" + struct.pack("<HHI", 1, 0, len(blob)) + blob
    with pytest.raises(ArchiveError, match="header is not valid JSON"):
        ArchiveReader(io.BytesIO(head + U32.pack(c(head))), "deep.umbparc")
    head = b"UMBPARCH" + struct.pack("<HHI", 1, 0, 3) + b"[1]"
    with pytest.raises(ArchiveError, match="header is not a JSON object"):
        ArchiveReader(io.BytesIO(head + U32.pack(c(head))), "list.umbparc")


@pytest.mark.parametrize("via", ["file", "pipe"])
def test_resync_passes_over_bytes_crafted_to_look_like_frames_up_to_a_record_at_the_very_end(via):
    data = archive_bytes([("a_0_k", b"x" * 10)])
    first = data.index(REC_TAG)
    fake = REC.pack(REC_TAG, 1024, 5, 0)[:8]  # a tag and a key length, over and over
    blob = data[:first] + REC_TAG + b"\xff" * 24 + fake * (MiB // 8) + b"END\0" + data[first:]
    f = io.BytesIO(blob) if via == "file" else io.BufferedReader(_ShortReads(blob), 4096)
    r = ArchiveReader(f)
    h = r.next()
    assert (h.key, h.length) == ("a_0_k", 10)
    skipped = len(blob) - len(data)
    assert r.resync_notes == [f"<archive>: implausible key length 4294967295 at byte {first}; skipped {skipped} "
                              f"bytes to the next intact frame at byte {first + skipped} (the records in between are lost)"]
    buf = bytearray(10)
    assert r.read_into(buf) and bytes(buf) == b"x" * 10
    assert r.next() is None and r.complete and r.damaged == 1


class _ShortReads(io.RawIOBase):
    def __init__(self, b):
        self._b = io.BytesIO(b)

    def readable(self):
        return True

    def readinto(self, mv):
        chunk = self._b.read(min(len(mv), 1000))
        mv[: len(chunk)] = chunk
        return len(chunk)
