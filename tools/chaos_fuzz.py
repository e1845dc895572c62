#!/usr/bin/env python3
"""Systematic fuzzers for tools/chaos_report.py (issue 10, "## Tests").

Three families, each counted in the report:

* ``metadata_damage_trials``: every file the store owns except segment data (``index.lmdb``,
  ``index.lmdb-lock``, ``MANIFEST.json``, ``LOCK``) is truncated (each 4 KiB boundary, random
  offsets), zeroed a page at a time, bit-flipped, overwritten with garbage, emptied, removed, or
  (the manifest) given a field out of range; then a follower opens it and reads, ``umbp-nvme
  verify`` runs, the writer opens it, reads, puts and reads back, and a follower reads again.
* ``key_fuzz_cases``: random code points, lone surrogates, NUL, escaped 0xFF/0x80 bytes, over-long,
  empty and non-str keys through put/get/exists/delete/evict and reopen, in batches with good
  keys; and raw key bytes (0xFF, 0x80, invalid UTF-8, NUL) written straight into the index with
  valid records pointing at real data, then read by the writer, a follower, ``verify``, and an
  ``export`` -> ``warmup`` round trip.
* ``archive_fuzz_cases``: an archive written by ``umbp-nvme export``, truncated at every record
  boundary and inside records, with flipped bytes in frames and payloads, lying sizes (with a
  valid frame CRC), non-UTF-8 keys, garbage; imported with ``umbp-nvme warmup`` under an
  address-space limit, then every imported page compared byte for byte.

Every check runs in a child process: a "zygote" (``python tools/chaos_fuzz.py --zygote``) imports
the store once and forks one child per check, so a child costs milliseconds. The zygote reports
how each child ended: exit code, signal, timeout, and whether its stderr holds a traceback.

A child **crashed** when it died of a signal (SIGBUS, SIGSEGV...), printed a traceback (uncaught,
or caught by a catch-all and logged with ``log.exception``), exited with a code outside the
allowed set, raised from an API call that must answer per key, or grew its address space past the
limit. A child **hung** when it outlived its timeout. **wrong_bytes**: any page returned whose
bytes differ from the bytes stored under that key (page content is derived from the key, as in
tests/support/host_pool.py, so every process knows it). Losing pages is allowed: it is a cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
OBJ = 8 * KiB  # object size for the metadata and key fuzzers
SEG = 256 * KiB
NS = {"model": "chaos/fuzz", "dtype": "bfloat16", "layout": "page_first"}
META_FILES = ("index.lmdb", "index.lmdb-lock", "MANIFEST.json", "LOCK")
CHILD_TIMEOUT_S = 30.0
FAILURES_KEPT = 24  # the first failure of each kind (file | damage | op | failure), up to this many
QUICK_TARGETS = {"metadata": 60, "keys": 400, "archive": 80}
FULL_TARGETS = {"metadata_damage_trials": 300, "key_fuzz_cases": 2000, "archive_fuzz_cases": 300}  # issue 10

# =============================================================================================
# page content: derived from the key alone (the same formula as support.host_pool.oracle(key, 0, n))


def content(key, n: int) -> bytes:
    import numpy as np

    k = key if isinstance(key, str) else repr(key)
    seed = int.from_bytes(hashlib.blake2b(f"{k}#0".encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return np.random.Generator(np.random.PCG64(seed)).bytes(n)


def hexkey(i: int, salt: str) -> str:
    return hashlib.sha256(f"{salt}:{i}".encode()).hexdigest()


def arch_len(key: str) -> int:
    """Object length for the archive fuzzer's source store: varied, so boundaries vary."""
    h = int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=4).digest(), "little")
    return (h % 5 + 1) * 1500 + h % 97


# =============================================================================================
# child side (runs in a process forked from the zygote)


def _cfg(capacity: int = 4 * MiB, **kw):
    from umbp_nvme.config import StoreConfig

    return StoreConfig(ssd_capacity_bytes=capacity, ssd_segment_size_bytes=SEG, ssd_queue_depth=64,
                       ssd_io_backend=kw.pop("backend", "io_uring"), io_timeout_s=5.0, ssd_durability_mode=kw.pop("mode", "strict"), **kw)


def _allowed_refusal(e: BaseException) -> bool:
    """A deliberate, explained refusal (not a crash): the store's own error classes."""
    from umbp_nvme.errors import StoreError

    return isinstance(e, StoreError) or (isinstance(e, FileNotFoundError) and "store" in str(e))


async def _get_check(store, keys, lengths, expect=None) -> dict:
    """get_many(keys); every hit compared with content(expect[k] or k). Returns counts and hit indices."""
    import numpy as np

    expect = expect or {}
    bufs = [np.zeros(n, np.uint8) for n in lengths]
    res = await store.get_many(list(keys), bufs)
    out = {"hits": 0, "wrong": 0, "misses": 0, "hit_idx": [], "wrong_keys": []}
    for i, (k, ok, b) in enumerate(zip(keys, res, bufs)):
        if ok:
            out["hits"] += 1
            out["hit_idx"].append(i)
            if b.tobytes() != content(expect.get(k, k), len(b)):
                out["wrong"] += 1
                if len(out["wrong_keys"]) < 5:
                    out["wrong_keys"].append(ascii(k)[:120])
        else:
            out["misses"] += 1
    return out


def _vm_kib(field: str = "VmSize") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def job_selftest(job) -> dict:
    kind = job["kind"]
    if kind == "sigbus":
        os.kill(os.getpid(), signal.SIGBUS)
    elif kind == "raise":
        raise RuntimeError("deliberate uncaught exception (harness self-test)")
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "logged":
        import logging

        try:
            1 / 0
        except ZeroDivisionError:
            logging.getLogger("umbp_nvme.selftest").exception("deliberate logged traceback")
    return {"ok": True}


def job_build(job) -> dict:
    """Create a store holding job["keys"] (objects of job["lengths"] or OBJ bytes)."""
    import asyncio

    import numpy as np
    from umbp_nvme.store import PageStore

    keys = job["keys"]
    lengths = job.get("lengths") or [OBJ] * len(keys)
    payload_of = job.get("payload_of") or {}

    async def run():
        s = await PageStore.open(job["path"], _cfg(job.get("capacity", 4 * MiB)), namespace=NS)
        ok = 0
        try:
            for i in range(0, len(keys), 16):
                ks = keys[i : i + 16]
                bufs = [np.frombuffer(content(payload_of.get(k, k), n), np.uint8).copy() for k, n in zip(ks, lengths[i : i + 16])]
                ok += sum(await s.put_many(ks, bufs))
        finally:
            await s.close()
        return ok

    return {"stored": asyncio.run(run())}


def job_open(job) -> dict:
    """Open as writer (job["readonly"] False) or follower; read job["keys"]; a writer also puts and reads back."""
    import asyncio

    import numpy as np
    from umbp_nvme.store import PageStore

    keys = job.get("keys", [])
    lengths = job.get("lengths") or [OBJ] * len(keys)
    expect = job.get("expect") or {}
    out: dict = {"opened": False, "raised": []}

    async def run():
        try:
            if job["readonly"]:
                s = await PageStore.open(job["path"], _cfg(job.get("capacity", 4 * MiB)), readonly=True)
            else:
                s = await PageStore.open(job["path"], _cfg(job.get("capacity", 4 * MiB)), namespace=job.get("namespace", NS))
        except Exception as e:  # noqa: BLE001
            if _allowed_refusal(e):
                out["refused"] = f"{type(e).__name__}: {e}"[:300]
                return
            raise
        out["opened"] = True
        try:
            if keys:
                g = await _get_check(s, keys, lengths, expect)
                out.update(hits=g["hits"], wrong=g["wrong"], misses=g["misses"], wrong_keys=g["wrong_keys"],
                           hit_idx=g["hit_idx"])
                try:
                    ex = s.exists_many_nowait(list(keys))
                    out["exists"] = sum(bool(x) for x in ex)
                except Exception as e:  # noqa: BLE001
                    out["raised"].append(f"exists_many: {type(e).__name__}: {e}"[:200])
            if not job["readonly"] and job.get("fresh"):
                fresh = [hexkey(i, f"fresh-{time.time_ns()}") for i in range(job["fresh"])]
                bufs = [np.frombuffer(content(k, OBJ), np.uint8).copy() for k in fresh]
                r = await s.put_many(fresh, bufs)
                out["fresh_put"] = sum(r)
                g = await _get_check(s, fresh, [OBJ] * len(fresh))
                out["fresh_hits"] = g["hits"]
                out["wrong"] = out.get("wrong", 0) + g["wrong"]
        finally:
            await s.close()

    asyncio.run(run())
    return out


def job_cli(job) -> dict:
    """umbp-nvme ARGV in this child; the exit code is the CLI's. Optionally check a store afterwards."""
    import umbp_nvme.cli.main as cli

    if job.get("rlimit_as"):
        import resource

        lim = _vm_kib() * 1024 + int(job["rlimit_as"])
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (lim if hard == resource.RLIM_INFINITY else min(lim, hard), hard))
    vm0 = _vm_kib()
    rc = cli.main(list(job["argv"]))
    out = {"rc": rc, "vm_growth_mib": round((_vm_kib("VmPeak") - vm0) / 1024, 1)}
    chk = job.get("check")
    if chk:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        if os.path.exists(os.path.join(chk["path"], "MANIFEST.json")):
            c = job_open(dict(chk, readonly=True))
            out["check"] = c
        else:
            out["check"] = {"opened": False, "hits": 0, "wrong": 0, "hit_idx": []}
    out["_exit"] = rc
    return out


def _fuzz_key(rng: random.Random, i: int):
    """A hostile key and its category."""
    base = hexkey(i, "kf")
    c = rng.randrange(14)
    if c == 0:
        return "codepoints", "".join(chr(rng.randrange(0x110000)) for _ in range(rng.randint(1, 24)))
    if c == 1:
        return "bmp", "".join(chr(rng.randrange(0x20, 0x10000)) for _ in range(rng.randint(1, 40)))
    if c == 2:
        return "lone_surrogate", base[: rng.randint(0, 64)] + chr(rng.choice([0xD800, 0xDBFF, 0xDC00, 0xDC7F, 0xDFFF])) + base[:8]
    if c == 3:
        return "escaped_ff", base[: rng.randint(0, 64)] + "\udcff" + base[:rng.randint(0, 8)]
    if c == 4:
        return "escaped_80", base[: rng.randint(0, 64)] + "\udc80" + base[:rng.randint(0, 8)]
    if c == 5:
        return "alias_escape", base[:32] + rng.choice(["\udcc3\udca9", "\udce2\udc82\udcac", "\udcc3"])  # bytes of é / € / partial
    if c == 6:
        j = rng.randint(0, 64)
        return "nul", base[:j] + "\0" + base[j:]
    if c == 7:
        return "overlong", (base * 2000)[: rng.choice([400, 511, 512, 513, 1000, 5000, 70000])]
    if c == 8:
        return "empty", ""
    if c == 9:
        return "unicode", base[:16] + rng.choice(["é", "€", "漢字", "😀", "\u200b", "\ufeff", "\U0010ffff"])
    if c == 10:
        return "pathlike", rng.choice(["../" * 3 + base[:8], "a/b/" + base[:8], " ", "\n", "\t" + base[:4], "."])
    if c == 11:
        return "non_str", rng.choice([base.encode(), 12345, None, (1, 2)])
    if c == 12:
        return "surrogate_pair_str", base[:8] + "\ud83d\ude00"  # a UTF-16 pair as two lone surrogates
    return "escaped_mixed", base[:8] + "".join(chr(0xDC80 + rng.randrange(128)) for _ in range(rng.randint(1, 6)))


def job_keys_api(job) -> dict:
    """Batches of good keys with hostile keys through put/get/exists/delete, eviction and reopen."""
    import asyncio

    import numpy as np
    from umbp_nvme.store import PageStore

    rng = random.Random(job["seed"])
    out = {"cases": 0, "wrong": 0, "isolation": 0, "raised": [], "by_category": {}, "stored_fuzz": 0,
           "refused_fuzz": 0, "reopens": 0, "evictions": 0, "examples": [], "exists_mismatch": 0}
    alive: dict = {}  # str key -> True (acknowledged, not deleted)

    def note(what):
        if len(out["examples"]) < 8:
            out["examples"].append(what[:300])

    async def call(name, coro_fn, default):
        try:
            return await coro_fn()
        except Exception as e:  # noqa: BLE001 - an API that must answer per key raised
            out["raised"].append(f"{name}: {type(e).__name__}: {e}"[:300])
            return default

    async def run():
        cfg = _cfg(job.get("capacity", 2 * MiB))
        s = await PageStore.open(job["path"], cfg, namespace=NS)
        try:
            for b in range(job["batches"]):
                good = [hexkey(rng.randrange(10**9), "g") for _ in range(6)]
                fuzz = [_fuzz_key(rng, rng.randrange(10**6)) for _ in range(2)]
                keys = good + [k for _, k in fuzz]
                order = list(range(len(keys)))
                rng.shuffle(order)
                keys = [keys[i] for i in order]
                for c, _ in fuzz:
                    out["by_category"][c] = out["by_category"].get(c, 0) + 1
                out["cases"] += len(fuzz)
                bufs = [np.frombuffer(content(k, OBJ), np.uint8).copy() for k in keys]
                res = await call("put_many", lambda: s.put_many(keys, bufs), [False] * len(keys))
                if not isinstance(res, list) or len(res) != len(keys):
                    out["raised"].append(f"put_many returned {type(res).__name__}")
                    res = [False] * len(keys)
                goodset = set(good)
                bad_good = [k for k, r in zip(keys, res) if k in goodset and not r]
                if bad_good:
                    out["isolation"] += 1
                    note(f"put_many batch with {[ascii(k)[:40] for _, k in fuzz]}: {len(bad_good)} good keys failed")
                for k, r in zip(keys, res):
                    if r and isinstance(k, str):
                        alive[k] = True
                        if k not in goodset:
                            out["stored_fuzz"] += 1
                    elif not r and k not in goodset:
                        out["refused_fuzz"] += 1
                # read back every key of the batch
                gb = [np.zeros(OBJ, np.uint8) for _ in keys]
                gr = await call("get_many", lambda: s.get_many(keys, gb), [False] * len(keys))
                for k, r, g in zip(keys, gr or [], gb):
                    if r and g.tobytes() != content(k, OBJ):
                        out["wrong"] += 1
                        note(f"get {ascii(k)[:80]} returned another key's bytes")
                bad_get = [k for k, r, g in zip(keys, res, gr or []) if k in goodset and r and not g]
                if bad_get:
                    out["isolation"] += 1
                    note(f"get_many batch with {[ascii(k)[:40] for _, k in fuzz]}: {len(bad_get)} good keys missed")
                try:
                    ex = s.exists_many_nowait(keys)
                    out["exists_mismatch"] += sum(1 for k, r, e in zip(keys, res, ex) if r and not e)
                    s.exists_prefix_nowait(keys)
                except Exception as e:  # noqa: BLE001
                    out["raised"].append(f"exists: {type(e).__name__}: {e}"[:300])
                # delete one fuzz key (when stored) and one good key
                victims = [k for _, k in fuzz if isinstance(k, str) and alive.get(k)][:1] + good[:1]
                dr = await call("delete_many", lambda: s.delete_many(victims), [False] * len(victims))
                for k, r in zip(victims, dr or []):
                    if r:
                        alive.pop(k, None)
                if victims:
                    gb2 = [np.zeros(OBJ, np.uint8) for _ in victims]
                    gr2 = await call("get_many", lambda: s.get_many(victims, gb2), [False] * len(victims))
                    for k, r, ok in zip(victims, gr2 or [], dr or []):
                        if r and ok:
                            out["wrong"] += 1
                            note(f"deleted key {ascii(k)[:80]} still served")
                if (b + 1) % job.get("reopen_every", 25) == 0:
                    out["evictions"] += int(s.stats().get("evictions", 0) or 0)
                    await s.close()
                    s = await PageStore.open(job["path"], cfg, namespace=NS)
                    out["reopens"] += 1
                    ks = list(alive)
                    rng.shuffle(ks)
                    ks = ks[:64]
                    g = await _get_check(s, ks, [OBJ] * len(ks))
                    out["wrong"] += g["wrong"]
                    for k in g["wrong_keys"]:
                        note(f"after reopen {k} returned another key's bytes")
            out["evictions"] += int(s.stats().get("evictions", 0) or 0)
        finally:
            await s.close()
        out["alive"] = list(alive)[-400:]  # for the export -> warmup round trip (the parent runs it)

    asyncio.run(run())
    return out


RAW_KEY_SHAPES = (
    b"\xff", b"\x80", b"\xc3(", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x00", b"\xc0\xaf", b"\xfe\xff",
    b"\xe2\x82", b"\xff\xff\xff\xff", b"\x7f", b"\xf0\x9f\x98\x80",
)


def raw_keys(rng: random.Random, n: int, salt: str) -> list[bytes]:
    out = []
    for i in range(n):
        base = hexkey(i, salt).encode()
        shape = rng.choice(RAW_KEY_SHAPES)
        where = rng.choice(("end", "start", "mid", "only"))
        if where == "end":
            out.append(base + shape)
        elif where == "start":
            out.append(shape + base)
        elif where == "mid":
            j = rng.randrange(1, len(base))
            out.append(base[:j] + shape + base[j:])
        else:
            out.append(shape * rng.randint(1, 3) + str(i).encode())
    return list(dict.fromkeys(out))


def job_inject(job) -> dict:
    """Rename index records of placeholder keys to raw key bytes, straight in LMDB (the store is closed)."""
    import lmdb
    import numpy as np
    from umbp_nvme.store.index import REC_DTYPE, key_crcs

    env = lmdb.open(os.path.join(job["path"], "index.lmdb"), subdir=False, max_dbs=4, lock=True, map_size=1 << 30)
    done = 0
    try:
        db = env.open_db(b"objects", create=False)
        with env.begin(write=True, db=db) as txn:
            if job.get("swap"):
                # swap the records of the first two keys, each re-stamped with its new key's
                # checksum: a swap the store itself cannot detect, so only the harness's byte
                # comparison can see it
                a, b = (bytes.fromhex(x) for x in job["raw_hex"][:2])
                ra, rb = (np.frombuffer(txn.get(k), REC_DTYPE).copy() for k in (a, b))
                ra["key_crc"], rb["key_crc"] = key_crcs([b, a])
                txn.put(a, rb.tobytes())
                txn.put(b, ra.tobytes())
                return {"injected": 2}
            for ph, raw in zip(job["placeholders"], job["raw_hex"]):
                rec = txn.get(ph.encode())
                if rec is None:
                    continue
                txn.delete(ph.encode())
                # stamped as a writer would have stamped a record of that key
                rec = np.frombuffer(rec, REC_DTYPE).copy()
                rec["key_crc"] = key_crcs([bytes.fromhex(raw)])
                txn.put(bytes.fromhex(raw), rec.tobytes())
                done += 1
    finally:
        env.close()
    return {"injected": done}


def job_fill(job) -> dict:
    """Writer: put many fresh pages (forcing eviction of everything older), then delete job["delete"]."""
    import asyncio

    import numpy as np
    from umbp_nvme.store import PageStore

    out = {"raised": [], "put": 0, "deleted": 0}

    async def run():
        s = await PageStore.open(job["path"], _cfg(job.get("capacity", 4 * MiB)), namespace=NS)
        try:
            if job.get("delete"):
                try:
                    out["deleted"] = sum(await s.delete_many(job["delete"]))
                except Exception as e:  # noqa: BLE001
                    out["raised"].append(f"delete_many: {type(e).__name__}: {e}"[:300])
            for b in range(job.get("batches", 0)):
                ks = [hexkey(i, f"fill-{b}") for i in range(16)]
                bufs = [np.frombuffer(content(k, OBJ), np.uint8).copy() for k in ks]
                try:
                    out["put"] += sum(await s.put_many(ks, bufs))
                except Exception as e:  # noqa: BLE001
                    out["raised"].append(f"put_many: {type(e).__name__}: {e}"[:300])
            out["evictions"] = int(s.stats().get("evictions", 0) or 0)
        finally:
            await s.close()

    asyncio.run(run())
    return out


JOBS = {
    "selftest": job_selftest,
    "build": job_build,
    "open": job_open,
    "cli": job_cli,
    "keys_api": job_keys_api,
    "inject": job_inject,
    "fill": job_fill,
}


def _child(job: dict, res_path: str, out_path: str, err_path: str) -> None:
    """In the forked child: redirect stdio, run the job, write its result, _exit."""
    code = 0
    try:
        fo = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        fe = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        fi = os.open(job.get("stdin") or os.devnull, os.O_RDONLY)
        os.dup2(fi, 0)
        os.dup2(fo, 1)
        os.dup2(fe, 2)
        for fd in (fi, fo, fe):
            os.close(fd)
        import io

        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), line_buffering=True)
        import logging

        root = logging.getLogger()
        for h in list(root.handlers):
            root.removeHandler(h)
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
        result = JOBS[job["op"]](job)
        code = int(result.pop("_exit", 0) or 0)
        with open(res_path, "w") as f:
            json.dump(result, f)
    except SystemExit as e:  # what the interpreter does with it: the code, no traceback
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - an uncaught exception: print it like Python would
        traceback.print_exc()
        code = 70
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def _wait(pid: int, timeout: float):
    """(status, timed_out). Kills the child at the timeout."""
    try:
        pfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pfd = None
    timed_out = False
    if pfd is not None:
        r, _, _ = select.select([pfd], [], [], timeout)
        os.close(pfd)
        if not r:
            timed_out = True
    else:  # pragma: no cover
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p, st = os.waitpid(pid, os.WNOHANG)
            if p:
                return st, False
            time.sleep(0.005)
        timed_out = True
    if timed_out:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, st = os.waitpid(pid, 0)
    return st, timed_out


def zygote_main(work: str) -> None:
    """Read one job per line (JSON) on stdin; fork a child per job; answer one line per job."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy  # noqa: F401
    import lmdb  # noqa: F401
    import umbp_nvme.cli.archive  # noqa: F401
    import umbp_nvme.cli.export  # noqa: F401
    import umbp_nvme.cli.main  # noqa: F401
    import umbp_nvme.cli.maintenance  # noqa: F401
    import umbp_nvme.store  # noqa: F401
    import umbp_nvme.cli.replay  # noqa: F401
    import umbp_nvme.cli.warmup  # noqa: F401

    os.makedirs(work, exist_ok=True)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    n = 0
    for line in sys.stdin:
        job = json.loads(line)
        n += 1
        res_path, out_path, err_path = (os.path.join(work, f"z{os.getpid()}-{n}.{x}") for x in ("res", "out", "err"))
        sys.stdout.flush()
        sys.stderr.flush()
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(job, res_path, out_path, err_path)
        st, timed_out = _wait(pid, float(job.get("timeout", CHILD_TIMEOUT_S)))
        reply = {"seconds": round(time.monotonic() - t0, 3), "timed_out": timed_out, "rc": None, "signal": None}
        if os.WIFSIGNALED(st):
            reply["signal"] = os.WTERMSIG(st)
        else:
            reply["rc"] = os.WEXITSTATUS(st)
        try:
            with open(res_path) as f:
                reply["result"] = json.load(f)
        except (OSError, ValueError):
            reply["result"] = None
        try:
            with open(err_path, errors="replace") as f:
                err = f.read()
        except OSError:
            err = ""
        reply["traceback"] = "Traceback (most recent call last)" in err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        reply["last_stderr"] = lines[-1][:300] if lines else ""
        if reply["traceback"]:
            i = max(i for i, ln in enumerate(lines) if ln.startswith("Traceback"))
            reply["traceback_text"] = "\n".join(lines[i:])[-1500:]
            names = []  # the exception of every traceback in stderr, first (usually the cause) first
            for j, ln in enumerate(lines):
                if ln.startswith("Traceback (most recent call last)"):
                    exc = next((x for x in lines[j + 1 :] if not x[:1].isspace()), "")
                    name = exc.split(":")[0].strip()[:80]
                    if name and name not in names:
                        names.append(name)
            reply["exceptions"] = names[:6]
            reply["exception"] = names[0] if names else ""
        for p in (res_path, out_path, err_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        proto.write(json.dumps(reply) + "\n")


# =============================================================================================
# parent side


class Zygote:
    """One preloaded process that forks a child per job (restarted if it ever dies itself)."""

    def __init__(self, work: str):
        self.work = work
        self.p = None
        self.lock = threading.Lock()

    def _start(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["OPENBLAS_NUM_THREADS"] = "1"
        env["UMBP_NVME_NO_SGLANG"] = "1"
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--zygote", self.work],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)

    def run(self, job: dict) -> dict:
        with self.lock:
            for attempt in range(2):
                if self.p is None or self.p.poll() is not None:
                    self._start()
                try:
                    self.p.stdin.write(json.dumps(job) + "\n")
                    self.p.stdin.flush()
                    line = self.p.stdout.readline()
                except (BrokenPipeError, OSError):
                    line = ""
                if line:
                    return json.loads(line)
                self.p = None
            return {"rc": None, "signal": None, "timed_out": False, "result": None, "traceback": False,
                    "last_stderr": "zygote died", "zygote_died": True}

    def close(self):
        if self.p is not None and self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


class Tally:
    """Counts of one family, and the first few failures with what it takes to reproduce them."""

    def __init__(self, family: str):
        self.family = family
        self.cases = 0
        self.children = 0
        self.crashes = 0
        self.hangs = 0
        self.wrong_bytes = 0
        self.isolation_failures = 0
        self.refused = 0
        self.crash_kinds: dict = {}
        self.failures: list = []
        self.signatures: dict = {}  # "file | damage | op | failure" -> how many times
        self.notes: dict = {}
        self.lock = threading.Lock()

    def bump(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.notes[name] = self.notes.get(name, 0) + n

    def fail(self, kind: str, case: dict, reply: dict | None = None, **more) -> None:
        where = case.get("where")
        if where:
            where = re.sub(r"\d+", "N", where)
        sig = " | ".join(str(x) for x in (case.get("file"), case.get("damage"), where, case.get("op"), case.get("step"), kind)
                         if x is not None)
        with self.lock:
            first = sig not in self.signatures
            self.signatures[sig] = self.signatures.get(sig, 0) + 1
            if first and len(self.failures) < FAILURES_KEPT:
                f = dict(case, failure=kind, **more)
                if reply is not None:
                    f.update(exit=reply.get("rc"), signal=_signame(reply.get("signal")),
                             last_stderr=reply.get("last_stderr", ""))
                    if reply.get("traceback_text"):
                        f["traceback"] = reply["traceback_text"][-600:]
                        f["exceptions"] = reply.get("exceptions")
                self.failures.append(f)

    def child(self, reply: dict, case: dict, allowed_rc=(0,)) -> str:
        """Classify how a child ended: 'ok', 'crash' or 'hang' (counted here)."""
        with self.lock:
            self.children += 1
        kind = None
        if reply.get("timed_out"):
            with self.lock:
                self.hangs += 1
            self.fail("hang", case, reply)
            return "hang"
        if reply.get("signal"):
            kind = f"signal {_signame(reply['signal'])}"
        elif reply.get("traceback"):
            kind = f"traceback {reply.get('exception') or ''}".strip()
        elif reply.get("rc") not in allowed_rc:
            kind = f"exit {reply.get('rc')}"
        elif reply.get("result") is None:
            kind = "no result"
        res = reply.get("result") or {}
        raised = res.get("raised") or []
        if kind is None and raised:
            kind = "raised from an API call"
        if kind is not None:
            with self.lock:
                self.crashes += 1
                self.crash_kinds[kind] = self.crash_kinds.get(kind, 0) + 1
            self.fail(kind, case, reply, **({"raised": raised[:3]} if raised else {}))
            return "crash"
        return "ok"

    def as_dict(self) -> dict:
        return {"cases": self.cases, "children": self.children, "crashes": self.crashes, "hangs": self.hangs,
                "wrong_bytes": self.wrong_bytes, "isolation_failures": self.isolation_failures,
                "refused": self.refused, "crash_kinds": self.crash_kinds, "notes": self.notes,
                "failure_signatures": dict(sorted(self.signatures.items(), key=lambda kv: -kv[1])),
                "failures": self.failures}


def _signame(sig) -> str | None:
    if not sig:
        return None
    try:
        return f"{signal.Signals(sig).name}({-sig})"
    except ValueError:
        return str(-sig)


def _pmap(zygotes: list[Zygote], fn, items: list) -> list:
    """fn(zygote, item) over items, one thread per zygote; results in item order."""
    out = [None] * len(items)
    it = iter(range(len(items)))
    lock = threading.Lock()

    def worker(z):
        while True:
            with lock:
                i = next(it, None)
            if i is None:
                return
            out[i] = fn(z, items[i])

    ts = [threading.Thread(target=worker, args=(z,)) for z in zygotes]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def _copy_store(src: str, dst: str) -> None:
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


# --- metadata damage ------------------------------------------------------------------------


MANIFEST_FIELD_DAMAGE = (
    ("layout.segment_bytes", 0), ("layout.segment_bytes", 4097), ("layout.segment_bytes", "abc"),
    ("layout.segment_bytes", -262144), ("layout.segment_bytes", 1 << 62), ("ssd_capacity_bytes", 0),
    ("ssd_capacity_bytes", -1), ("ssd_capacity_bytes", "x"), ("ssd_capacity_bytes", 1e999),
    ("format_version", 99), ("format_version", "1"), ("namespace", "not a dict"), ("namespace", None),
    ("layout", None), ("layout", []), ("", []), ("", "str"), ("", None),
)


def _set_field(obj, path: str, value):
    if not path:
        return value
    parts = path.split(".")
    cur = obj
    for p in parts[:-1]:
        if not isinstance(cur.get(p), dict):
            cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = value
    return obj


def metadata_plan(pristine: str, rng: random.Random, target: int) -> list[dict]:
    """Damage cases: each 4 KiB truncation, zeroed page, field, plus random truncations/flips to target."""
    sizes = {f: os.path.getsize(os.path.join(pristine, f)) for f in META_FILES if os.path.exists(os.path.join(pristine, f))}
    plan: list[dict] = []
    for f, size in sizes.items():
        plan.append(dict(file=f, damage="missing"))
        plan.append(dict(file=f, damage="empty"))
        plan.append(dict(file=f, damage="garbage", size=size, seed=rng.randrange(1 << 30)))
        plan.append(dict(file=f, damage="garbage", size=rng.randint(1, max(2, 2 * size)), seed=rng.randrange(1 << 30)))
        for off in range(4096, size, 4096):
            plan.append(dict(file=f, damage="truncate", size=off))
        for pg in range(0, max(1, -(-size // 4096))):
            plan.append(dict(file=f, damage="zero_page", page=pg))
        if f == "index.lmdb":
            plan.append(dict(file=f, damage="extend", size=size + 1 * MiB))
            plan.append(dict(file=f, damage="meta_pages_swapped"))
    import copy

    with open(os.path.join(pristine, "MANIFEST.json")) as fh:
        manifest = json.load(fh)
    for path, value in MANIFEST_FIELD_DAMAGE:
        m = _set_field(copy.deepcopy(manifest), path, value)
        plan.append(dict(file="MANIFEST.json", damage="field", field=path or "(whole)", value=repr(value)[:40],
                         text=json.dumps(m)))
    files = list(sizes)
    while len(plan) < target:
        f = rng.choice(files)
        size = sizes[f]
        r = rng.random()
        if r < 0.3:
            plan.append(dict(file=f, damage="truncate", size=rng.randrange(1, max(2, size))))
        else:
            flips = []
            for _ in range(rng.choice((1, 1, 2, 4, 8, 32))):
                # index: half of the flips in the two meta pages, where LMDB trusts last_pgno and the roots
                hi = min(size, 8192) if (f == "index.lmdb" and rng.random() < 0.5) else size
                flips.append((rng.randrange(max(1, hi)), rng.randrange(8)))
            plan.append(dict(file=f, damage="flip", flips=flips))
    return plan


def apply_damage(d: str, case: dict) -> None:
    p = os.path.join(d, case["file"])
    kind = case["damage"]
    if kind == "missing":
        os.unlink(p)
    elif kind == "empty":
        os.truncate(p, 0)
    elif kind == "garbage":
        with open(p, "wb") as f:
            f.write(random.Random(case["seed"]).randbytes(case["size"]))
    elif kind in ("truncate", "extend"):
        os.truncate(p, case["size"])
    elif kind == "zero_page":
        with open(p, "r+b") as f:
            f.seek(case["page"] * 4096)
            f.write(bytes(4096))
        os.truncate(p, max(os.path.getsize(p), 0))
    elif kind == "flip":
        with open(p, "r+b") as f:
            for off, bit in case["flips"]:
                f.seek(off)
                b = f.read(1)
                if not b:
                    continue
                f.seek(off)
                f.write(bytes([b[0] ^ (1 << bit)]))
    elif kind == "meta_pages_swapped":
        with open(p, "r+b") as f:
            a = f.read(4096)
            b = f.read(4096)
            f.seek(0)
            f.write(b + a)
    elif kind == "field":
        with open(p, "w") as f:
            f.write(case["text"])
    else:  # pragma: no cover
        raise ValueError(kind)


def run_metadata(zs: list[Zygote], work: str, rng: random.Random, target: int, tally: Tally, log,
                 only_case: int | None = None) -> dict:
    pristine = os.path.join(work, "meta-pristine")
    keys = [hexkey(i, "meta") for i in range(160)]
    r = zs[0].run(dict(op="build", path=pristine, keys=keys))
    if tally.child(r, dict(op="build")) != "ok" or (r["result"] or {}).get("stored") != len(keys):
        raise RuntimeError(f"cannot build the metadata fuzzer's store: {r}")
    plan = metadata_plan(pristine, rng, target)
    if len(plan) > target:  # quick mode: a stratified sample, one of each (file, kind) first
        seen, first, rest = set(), [], []
        for c in plan:
            (rest if (c["file"], c["damage"]) in seen else first).append(c)
            seen.add((c["file"], c["damage"]))
        rng.shuffle(rest)
        plan = (first + rest)[: max(target, 0)]
    sample = keys

    def trial(z: Zygote, case: dict):
        i = case["i"]
        d = os.path.join(work, f"meta-{i % 4}-{threading.get_ident() % 1000}")
        _copy_store(pristine, d)
        if case.get("damage") != "none":
            apply_damage(d, case)
        desc = {k: v for k, v in case.items() if k not in ("text", "i")}
        desc["case"] = i
        steps = (
            ("follower open+get", dict(op="open", path=d, readonly=True, keys=sample), (0,)),
            ("umbp-nvme verify", dict(op="cli", argv=["verify", "--store", d]), (0, 1, 2)),
            ("writer open+get+put+get", dict(op="open", path=d, readonly=False, keys=sample, fresh=8), (0,)),
            ("follower open+get after the writer", dict(op="open", path=d, readonly=True, keys=sample), (0,)),
        )
        for name, job, allowed in steps:
            reply = z.run(job)
            c = dict(desc, op=name, store=d)
            if job["op"] == "cli":
                c["command"] = "umbp-nvme " + " ".join(job["argv"])
            outcome = tally.child(reply, c, allowed)
            res = reply.get("result") or {}
            if res.get("wrong"):
                with tally.lock:
                    tally.wrong_bytes += res["wrong"]
                tally.fail("wrong bytes", c, reply, wrong_keys=res.get("wrong_keys"))
            if outcome == "ok":
                if res.get("refused"):
                    with tally.lock:
                        tally.refused += 1
                    tally.bump(f"refused: {name}")
                    if job["op"] == "open" and not job["readonly"]:
                        tally.bump("writer refused to serve")
                        tally.fail(f"writer refused to serve ({res['refused'].split(':')[0]})", c, reply,
                                   refused=res["refused"])
                if job["op"] == "open" and not job["readonly"] and res.get("opened"):
                    if res.get("fresh_put", 0) < job["fresh"] or res.get("fresh_hits", 0) < job["fresh"]:
                        tally.bump("writer opened but did not cache")
                    if res.get("hits", 0) < len(sample):
                        tally.bump("writer lost pages (allowed)")
                if job["op"] == "cli" and reply.get("rc") == 2:
                    tally.bump("verify exit 2")
        with tally.lock:
            tally.cases += 1
        if only_case is None:
            shutil.rmtree(d, ignore_errors=True)

    # control: the undamaged store must pass every step
    ctl = Tally("metadata-control")
    _copy_store(pristine, os.path.join(work, "meta-control"))
    for name, job in (("follower", dict(op="open", path=os.path.join(work, "meta-control"), readonly=True, keys=keys)),
                      ("verify", dict(op="cli", argv=["verify", "--store", os.path.join(work, "meta-control")])),
                      ("writer", dict(op="open", path=os.path.join(work, "meta-control"), readonly=False, keys=keys, fresh=8))):
        reply = zs[0].run(job)
        ok = ctl.child(reply, dict(op=name), (0,))
        res = reply.get("result") or {}
        if ok != "ok" or res.get("refused") or res.get("wrong") or (job["op"] == "open" and res.get("hits") != len(keys)):
            ctl.fail("control failed", dict(op=name), reply, result=res)
    for i, c in enumerate(plan):
        c["i"] = i
    if only_case is not None:
        plan = [c for c in plan if c["i"] == only_case]
    t0 = time.monotonic()
    _pmap(zs, trial, plan)
    log(f"metadata: {len(plan)} trials in {time.monotonic() - t0:.1f} s")
    return {"control_ok": not ctl.failures, "control_failures": ctl.failures,
            "damage_kinds": _count(plan, lambda c: f"{c['file']}:{c['damage']}")}


def _count(items, key) -> dict:
    out: dict = {}
    for x in items:
        k = key(x)
        out[k] = out.get(k, 0) + 1
    return out


# --- keys -----------------------------------------------------------------------------------


def run_keys(zs: list[Zygote], work: str, rng: random.Random, target: int, tally: Tally, log,
             only_case: int | None = None) -> dict:
    t0 = time.monotonic()
    info: dict = {"by_category": {}, "stored_fuzz": 0, "refused_fuzz": 0, "evictions": 0, "raw_injected": 0}
    # 1. the API: chunks of batches, each chunk one child (a crash loses only its chunk)
    api_cases = int(target * 0.8)
    per_chunk = 2 * 60  # 60 batches of 2 hostile keys
    chunks = [dict(op="keys_api", path=os.path.join(work, f"keys-api-{i}"), seed=rng.randrange(1 << 30),
                   batches=per_chunk // 2, reopen_every=20, timeout=120)
              for i in range(max(1, -(-api_cases // per_chunk)))]

    def api(z, job):
        reply = z.run(job)
        res = reply.get("result") or {}
        case = dict(op="keys_api (put/get/exists/delete/reopen)", case=job["case"], seed=job["seed"], batches=job["batches"])
        tally.child(reply, case)
        with tally.lock:
            tally.cases += res.get("cases", job["batches"] * 2)
            tally.wrong_bytes += res.get("wrong", 0)
            tally.isolation_failures += res.get("isolation", 0)
            info["stored_fuzz"] += res.get("stored_fuzz", 0)
            info["refused_fuzz"] += res.get("refused_fuzz", 0)
            info["evictions"] += res.get("evictions", 0)
            for k, v in (res.get("by_category") or {}).items():
                info["by_category"][k] = info["by_category"].get(k, 0) + v
        if res.get("wrong") or res.get("isolation"):
            tally.fail("wrong bytes" if res.get("wrong") else "batch isolation", case, reply,
                       examples=res.get("examples", [])[:4])
        alive = res.get("alive") or []
        if os.path.exists(os.path.join(job["path"], "MANIFEST.json")):
            # the hostile keys that were stored, through export -> warmup into a new store
            arch, dest = job["path"] + ".umbparc", job["path"] + "-warm"
            for name, j, allowed in (
                ("umbp-nvme export", dict(op="cli", argv=["export", "--store", job["path"], "--out", arch]), (0, 1)),
                ("umbp-nvme warmup + check", dict(op="cli", argv=["warmup", "--store", dest, arch, "--capacity", "4m",
                                                                 "--config", json.dumps({"ssd_segment_size_bytes": SEG})],
                                                  check=dict(path=dest, keys=alive)), (0, 1)),
            ):
                if j["argv"][0] == "warmup" and not os.path.exists(arch):
                    break
                r2 = z.run(j)
                c2 = dict(case, step=name, command="umbp-nvme " + " ".join(j["argv"]))
                tally.child(r2, c2, allowed)
                chk = (r2.get("result") or {}).get("check") or {}
                if chk.get("wrong"):
                    with tally.lock:
                        tally.wrong_bytes += chk["wrong"]
                    tally.fail("wrong bytes", c2, r2, wrong_keys=chk.get("wrong_keys"))
                if j["argv"][0] == "warmup":
                    tally.bump("round trip: keys stored", len(alive))
                    tally.bump("round trip: keys back", chk.get("hits", 0))
            if only_case is None:
                shutil.rmtree(dest, ignore_errors=True)
                try:
                    os.unlink(arch)
                except OSError:
                    pass
        if only_case is None:
            shutil.rmtree(job["path"], ignore_errors=True)

    for i, job in enumerate(chunks):
        job["case"] = i
    if only_case is not None:
        chunks = [j for j in chunks if j["case"] == only_case]
    _pmap(zs, api, chunks)
    # 2. raw key bytes in the index
    rounds = max(1, -(-(target - api_cases) // 40))
    n_chunks = max(1, -(-api_cases // per_chunk))
    items = [(r, rng.randrange(1 << 30)) for r in range(rounds)]
    if only_case is not None:  # raw rounds are numbered after the API chunks
        items = [it for it in items if it[0] + n_chunks == only_case]

    def inject_round(z, item):
        r, seed = item
        rr = random.Random(seed)
        d = os.path.join(work, f"keys-raw-{r}")
        raws = raw_keys(rr, 40, f"raw{r}")
        from umbp_nvme.keybytes import decode_key

        strs = [decode_key(b) for b in raws]
        good = [hexkey(i, f"rawgood{r}") for i in range(40)]
        placeholders = [f"placeholder-{r}-{i}" for i in range(len(raws))]
        # interleave so that a shift by one lands on a neighbour
        keys = good + placeholders
        payload_of = dict(zip(placeholders, strs))
        case = dict(op="raw index keys", case=r + n_chunks, round=r, seed=seed, raw_examples=[b.hex() for b in raws[:3]])
        reply = z.run(dict(op="build", path=d, keys=keys, payload_of=payload_of, capacity=4 * MiB))
        if tally.child(reply, dict(case, step="build")) != "ok":
            return
        reply = z.run(dict(op="inject", path=d, placeholders=placeholders, raw_hex=[b.hex() for b in raws]))
        if tally.child(reply, dict(case, step="inject")) != "ok":
            return
        with tally.lock:
            tally.cases += len(raws)
            info["raw_injected"] += (reply["result"] or {}).get("injected", 0)
        allk = good + strs
        arch = os.path.join(work, f"keys-raw-{r}.umbparc")
        dest = os.path.join(work, f"keys-raw-{r}-warm")
        steps = (
            ("follower open+get", dict(op="open", path=d, readonly=True, keys=allk), (0,)),
            ("umbp-nvme verify", dict(op="cli", argv=["verify", "--store", d]), (0, 1)),
            ("umbp-nvme export", dict(op="cli", argv=["export", "--store", d, "--out", arch]), (0, 1)),
            ("umbp-nvme warmup + check", dict(op="cli", argv=["warmup", "--store", dest, arch,
                                                             "--capacity", "4m", "--config", json.dumps({"ssd_segment_size_bytes": SEG})],
                                             check=dict(path=dest, keys=allk)), (0, 1)),
            ("writer open+get+put+get", dict(op="open", path=d, readonly=False, keys=allk, fresh=8), (0,)),
            ("writer evicts and deletes them", dict(op="fill", path=d, delete=strs[::2], batches=40), (0,)),
            ("writer reopen+get", dict(op="open", path=d, readonly=False, keys=allk, fresh=8), (0,)),
        )
        for name, job, allowed in steps:
            if job["op"] == "cli" and job["argv"][0] == "warmup" and not os.path.exists(arch):
                continue
            reply = z.run(job)
            c = dict(case, step=name)
            if job["op"] == "cli":
                c["command"] = "umbp-nvme " + " ".join(job["argv"])
            tally.child(reply, c, allowed)
            res = reply.get("result") or {}
            wrong = res.get("wrong", 0) + (res.get("check") or {}).get("wrong", 0)
            if wrong:
                with tally.lock:
                    tally.wrong_bytes += wrong
                tally.fail("wrong bytes", c, reply,
                           wrong_keys=res.get("wrong_keys") or (res.get("check") or {}).get("wrong_keys"))
            if job["op"] == "cli" and job["argv"][0] == "verify" and reply.get("rc") == 0 and res is not None:
                pass
            if job["op"] == "open" and res.get("refused"):
                with tally.lock:
                    tally.refused += 1
                tally.bump(f"refused: {name}")
        if only_case is None:
            for p in (d, dest):
                shutil.rmtree(p, ignore_errors=True)
            try:
                os.unlink(arch)
            except OSError:
                pass

    _pmap(zs, inject_round, items)
    log(f"keys: {tally.cases} cases in {time.monotonic() - t0:.1f} s")
    return info


# --- archives -------------------------------------------------------------------------------

_REC = struct.Struct("<4sIQI")


def parse_archive(data: bytes) -> dict:
    """Offsets of an intact archive: header end, each record (start, frame end, key end, data end), trailer."""
    json_len = struct.unpack_from("<I", data, 12)[0]
    pos = 16 + json_len + 4
    header_end = pos
    recs = []
    while data[pos : pos + 4] == b"REC\0":
        _, key_len, length, _crc = _REC.unpack_from(data, pos)
        fe = pos + _REC.size + 4
        ke = fe + key_len
        de = ke + length
        recs.append(dict(start=pos, frame_end=fe, key_end=ke, data_end=de, key=data[fe:ke].decode(), length=length))
        pos = de
    return dict(header_end=header_end, records=recs, trailer=pos, size=len(data))


def _crc32c(b: bytes) -> int:
    from umbp_nvme._uring import crc32c

    return crc32c(b)


def _reframe(data: bytearray, rec: dict, *, key_len=None, length=None, key: bytes | None = None) -> bytearray:
    """Rewrite a record's frame with new fields and a valid head_crc (a lie the frame CRC cannot catch)."""
    s = rec["start"]
    tag, kl, ln, crc = _REC.unpack_from(data, s)
    kb = bytes(data[rec["frame_end"] : rec["key_end"]]) if key is None else key
    kl2 = len(kb) if key_len is None else key_len
    ln2 = ln if length is None else length
    fixed = _REC.pack(tag, kl2, ln2, crc)
    new = fixed + struct.pack("<I", _crc32c(fixed + kb)) + kb
    return data[:s] + new + data[rec["key_end"] :]


def archive_plan(data: bytes, layout: dict, rng: random.Random, target: int) -> list[dict]:
    recs = layout["records"]
    n = len(recs)
    plan: list[dict] = []

    def trunc(off, where, intact):
        plan.append(dict(damage="truncate", where=where, offset=off, intact=intact, bytes=bytes(data[:off])))

    trunc(0, "empty file", None)
    for off in (4, 8, 12, 16, layout["header_end"] - 4, layout["header_end"] - 1):
        trunc(off, "inside the header", None)
    for i, r in enumerate(recs):
        trunc(r["start"], f"record boundary before record {i}", i)
        for off, where in ((r["start"] + 2, "tag"), (r["start"] + 10, "length"), (r["frame_end"] - 2, "head_crc"),
                           (r["frame_end"], "frame end"), ((r["frame_end"] + r["key_end"]) // 2, "key"),
                           (r["key_end"], "key end"), (r["key_end"] + r["length"] // 2, "payload"),
                           (r["data_end"] - 1, "last payload byte")):
            trunc(off, f"inside record {i} ({where})", i)
    t = layout["trailer"]
    trunc(t, "record boundary before the trailer", n)
    for off in (t + 2, t + 10, t + 20, t + 30, len(data) - 1):
        trunc(off, "inside the trailer", n)

    def flip(off, where, intact, bit=None):
        b = bytearray(data)
        b[off] ^= 1 << (rng.randrange(8) if bit is None else bit)
        plan.append(dict(damage="flip", where=where, offset=off, intact=intact, bytes=bytes(b)))

    for off, where in ((0, "magic"), (8, "version"), (12, "json_len"), (13, "json_len"), (15, "json_len high byte"),
                       (20, "header json"), (layout["header_end"] - 2, "header crc")):
        flip(off, f"header {where}", None)
    for i, r in enumerate(recs):
        s = r["start"]
        for off, where in ((s, "tag"), (s + 4, "key_len"), (s + 7, "key_len high byte"), (s + 8, "length"),
                           (s + 13, "length byte 5"), (s + 15, "length high byte"), (s + 16, "crc"), (s + 20, "head_crc"),
                           (r["frame_end"], "key"), (r["key_end"], "payload first byte"),
                           (r["key_end"] + rng.randrange(max(1, r["length"])), "payload"), (r["data_end"] - 1, "payload last byte")):
            flip(off, f"record {i} {where}", i)
    for k, where in ((0, "tag"), (4, "zero"), (8, "records"), (16, "payload"), (24, "digest"), (28, "crc")):
        flip(t + k, f"trailer {where}", n)
    # lying sizes with a valid frame CRC
    for i in sorted({0, n // 2, n - 1}):
        r = recs[i]
        for what, kw in (("length 512 MiB", dict(length=512 * MiB)), ("length 1 TiB", dict(length=1 << 40)),
                         ("length 1 TiB + 1", dict(length=(1 << 40) + 1)), ("length 2^64-1", dict(length=(1 << 64) - 1)),
                         ("length + 1", dict(length=r["length"] + 1)), ("length - 1", dict(length=max(0, r["length"] - 1))),
                         ("length 0", dict(length=0)), ("key_len 0", dict(key_len=0)),
                         ("key_len 65537", dict(key_len=65537)), ("key_len 2^32-1", dict(key_len=(1 << 32) - 1))):
            plan.append(dict(damage="lying size", where=f"record {i} {what} (valid frame CRC)", intact=i,
                             bytes=bytes(_reframe(bytearray(data), r, **kw))))
        # a non-UTF-8 key with a valid frame CRC: its bytes are still the original key's
        kb = r["key"].encode()
        for bad in (b"\xff", b"\x80", b"\xc3(", b"\x00"):
            nk = kb[:10] + bad + kb[10:]
            from umbp_nvme.keybytes import decode_key

            plan.append(dict(damage="odd key", where=f"record {i} key with {bad.hex()} (valid frame CRC)", intact=i,
                             bytes=bytes(_reframe(bytearray(data), r, key=nk)), forged=[decode_key(nk), r["key"]],
                             intact_after=True))
    # structure: duplicated / swapped records, garbage after the trailer, a second archive appended
    a, b = recs[0], recs[1]
    plan.append(dict(damage="duplicate record", where="record 0 twice", intact=n,
                     bytes=data[: b["start"]] + data[a["start"] : a["data_end"]] + data[b["start"] :]))
    plan.append(dict(damage="swapped records", where="records 0 and 1 swapped", intact=n,
                     bytes=data[: a["start"]] + data[b["start"] : b["data_end"]] + data[a["start"] : a["data_end"]] + data[b["data_end"] :]))
    plan.append(dict(damage="trailing garbage", where="garbage after the trailer", intact=n, bytes=data + rng.randbytes(100)))
    plan.append(dict(damage="garbage", where="random bytes", intact=None, bytes=rng.randbytes(len(data))))
    plan.append(dict(damage="garbage", where="magic then random bytes", intact=None, bytes=data[:8] + rng.randbytes(200)))
    plan.append(dict(damage="stdin", where="intact archive on stdin", intact=n, bytes=data, stdin=True))
    plan.append(dict(damage="stdin", where="archive truncated inside record 2, on stdin", intact=2,
                     bytes=data[: recs[2]["key_end"] + 5], stdin=True))
    while len(plan) < target:
        if rng.random() < 0.5:
            off = rng.randrange(len(data))
            intact = sum(1 for r in recs if r["data_end"] <= off) if off >= layout["header_end"] else None
            trunc(off, "random offset", intact)
        else:
            off = rng.randrange(len(data))
            intact = sum(1 for r in recs if r["data_end"] <= off) if off >= layout["header_end"] else None
            flip(off, "random byte", intact)
    return plan


def run_archive(zs: list[Zygote], work: str, rng: random.Random, target: int, tally: Tally, log, quick: bool,
                only_case: int | None = None) -> dict:
    t0 = time.monotonic()
    src = os.path.join(work, "arch-src")
    keys = [hexkey(i, "arch") for i in range(12)]
    lengths = [arch_len(k) for k in keys]
    r = zs[0].run(dict(op="build", path=src, keys=keys, lengths=lengths))
    if tally.child(r, dict(op="build")) != "ok":
        raise RuntimeError(f"cannot build the archive fuzzer's store: {r}")
    arch = os.path.join(work, "arch.umbparc")
    r = zs[0].run(dict(op="cli", argv=["export", "--store", src, "--out", arch]))
    if tally.child(r, dict(op="umbp-nvme export")) != "ok":
        raise RuntimeError(f"cannot export the archive fuzzer's store: {r}")
    with open(arch, "rb") as f:
        data = f.read()
    layout = parse_archive(data)
    order = [rec["key"] for rec in layout["records"]]  # archive (disk) order
    length_of = dict(zip(keys, lengths))
    plan = archive_plan(data, layout, rng, target)
    if len(plan) > target:
        rng.shuffle(plan)
        keep = [c for c in plan if c["damage"] in ("stdin", "odd key")][: min(4, target)]
        plan = keep + [c for c in plan if not any(c is k for k in keep)][: max(0, target - len(keep))]
    info = {"records": len(order), "archive_bytes": len(data), "contract_violations": 0, "rc": {}, "rc_by_damage": {},
            "max_vm_growth_mib": 0.0, "control": None, "damage_kinds": _count(plan, lambda c: c["damage"])}
    vm_limit_mib = None
    budget = [4 * GiB]  # for the control; then measured

    def one(z, case, tally=tally):
        i = case["i"]
        p = os.path.join(work, f"arch-case-{i}.umbparc")
        with open(p, "wb") as f:
            f.write(case["bytes"])
        dest = os.path.join(work, f"arch-dest-{i}")
        check_keys = list(order)
        expect = {}
        if case.get("forged"):
            check_keys.append(case["forged"][0])
            expect[case["forged"][0]] = case["forged"][1]
        argv = ["warmup", "--store", dest, "-" if case.get("stdin") else p, "--capacity", "4m",
                "--config", json.dumps({"ssd_segment_size_bytes": SEG})]
        job = dict(op="cli", argv=argv, stdin=p if case.get("stdin") else None, rlimit_as=budget[0],
                   check=dict(path=dest, keys=check_keys, lengths=[length_of.get(expect.get(k, k), 0) for k in check_keys],
                              expect=expect))
        reply = z.run(job)
        desc = {k: v for k, v in case.items() if k not in ("bytes", "i")}
        desc.update(case=i, command="umbp-nvme " + " ".join(a if a != p else "ARCHIVE" for a in argv),
                    archive_size=len(case["bytes"]))
        outcome = tally.child(reply, desc, (0, 1, 2))
        res = reply.get("result") or {}
        chk = res.get("check") or {}
        with tally.lock:
            tally.cases += 1
            rc = reply.get("rc")
            info["rc"][str(rc)] = info["rc"].get(str(rc), 0) + 1
            k = f"{case['damage']} | {re.sub(r'[0-9]+', 'N', case.get('where', ''))}"
            by = info["rc_by_damage"].setdefault(k, {})
            ek = "signal" if reply.get("signal") else str(rc)
            by[ek] = by.get(ek, 0) + 1
            info["max_vm_growth_mib"] = max(info["max_vm_growth_mib"], res.get("vm_growth_mib") or 0)
        if chk.get("wrong"):
            with tally.lock:
                tally.wrong_bytes += chk["wrong"]
            tally.fail("wrong bytes", desc, reply, wrong_keys=chk.get("wrong_keys"))
        if outcome == "ok" and vm_limit_mib is not None and (res.get("vm_growth_mib") or 0) > vm_limit_mib:
            with tally.lock:
                tally.crashes += 1
                tally.crash_kinds["memory"] = tally.crash_kinds.get("memory", 0) + 1
            tally.fail("memory", desc, reply, vm_growth_mib=res.get("vm_growth_mib"))
        # the documented contract: damage after the header -> the intact records are imported, exit 1
        intact = case.get("intact")
        if outcome == "ok" and intact is not None and case["damage"] not in ("trailing garbage",):
            hit = set(chk.get("hit_idx") or [])
            missing = [j for j in range(min(intact, len(order))) if j not in hit]
            why = None
            if missing:
                why = f"{len(missing)} of the {intact} intact records before the damage were not imported"
            elif rc == 2:
                why = "exit 2 (could not run) for an archive whose header is intact"
            elif rc == 0 and case["damage"] in ("truncate", "lying size") and intact < len(order):
                why = "exit 0 for a damaged archive"
            if why:
                with tally.lock:
                    info["contract_violations"] += 1
                tally.bump(f"contract: {case['damage']}: {why.split(' for')[0] if 'exit' in why else 'intact records not imported'}")
                tally.fail("contract: " + why, desc, reply)
        if only_case is None:
            os.unlink(p)
            shutil.rmtree(dest, ignore_errors=True)
        return dict(outcome=outcome, rc=reply.get("rc"), hits=len(chk.get("hit_idx") or []), wrong=chk.get("wrong", 0),
                    vm_growth_mib=res.get("vm_growth_mib"), last_stderr=reply.get("last_stderr"))

    # control: the intact archive (from a file and on stdin) imports every record with exit 0;
    # its address-space growth is the yardstick for "sane memory"
    ctl = Tally("archive-control")
    c1 = one(zs[0], dict(damage="none", where="intact archive", intact=len(order), bytes=data, i=-1), ctl)
    # the budget every case gets: what the intact import needed (mostly the LMDB map) + 384 MiB
    budget[0] = int(((c1["vm_growth_mib"] or 0) + 384) * MiB)
    c2 = one(zs[0], dict(damage="none", where="intact archive on stdin", intact=len(order), bytes=data, i=-2,
                         stdin=True), ctl)
    info["rc"] = {}
    info["rc_by_damage"] = {}
    info["contract_violations"] = 0
    tally.notes.clear()
    info["control"] = dict(file=c1, stdin=c2, failures=ctl.failures,
                           ok=bool(c1["outcome"] == "ok" and c1["rc"] == 0 and c1["hits"] == len(order) and not c1["wrong"]))
    vm_limit_mib = (c1["vm_growth_mib"] or 0) + 256
    info["rlimit_as_extra_mib"] = budget[0] // MiB
    info["max_vm_growth_mib"] = 0.0
    info["vm_limit_mib"] = vm_limit_mib
    for i, c in enumerate(plan):
        c["i"] = i
    if only_case is not None:
        plan = [c for c in plan if c["i"] == only_case]
    _pmap(zs, one, plan)
    log(f"archive: {len(plan)} cases in {time.monotonic() - t0:.1f} s")
    return info


# --- harness self-test ----------------------------------------------------------------------


def selftest(z: Zygote, work: str | None = None) -> dict:
    """The harness must count a deliberately crashing, raising, logging and hanging child, and
    see wrong bytes: two index records swapped behind the store's back (their CRCs travel with
    them, so the store cannot tell) must read back as two wrong pages."""
    t = Tally("selftest")
    out = {}
    for kind, timeout in (("ok", 10), ("sigbus", 10), ("raise", 10), ("logged", 10), ("hang", 1.5)):
        reply = z.run(dict(op="selftest", kind=kind, timeout=timeout))
        out[kind] = t.child(reply, dict(op=f"selftest {kind}"))
    expected = {"ok": "ok", "sigbus": "crash", "raise": "crash", "logged": "crash", "hang": "hang"}
    if work is not None:
        d = os.path.join(work, "selftest-swap")
        keys = [hexkey(i, "swap") for i in range(4)]
        r1 = z.run(dict(op="build", path=d, keys=keys))
        r2 = z.run(dict(op="inject", path=d, placeholders=keys[:2], raw_hex=[k.encode().hex() for k in keys[:2]],
                        swap=True))
        r3 = z.run(dict(op="open", path=d, readonly=True, keys=keys))
        out["swapped_records"] = (r3.get("result") or {}).get("wrong")
        expected["swapped_records"] = 2
        shutil.rmtree(d, ignore_errors=True)
        if any(r.get("result") is None for r in (r1, r2, r3)):
            out["swapped_records"] = f"harness error: {[r.get('last_stderr') for r in (r1, r2, r3)]}"
    return {"outcomes": out, "ok": out == expected, "crash_kinds": t.crash_kinds}


# --- entry point for chaos_report.py ---------------------------------------------------------


def run_fuzzers(work: str, *, quick: bool, seed: int = 0, log=None, families=("metadata", "keys", "archive"),
                workers: int | None = None, targets: dict | None = None, only_case: int | None = None) -> dict:
    """Run the families; ``only_case`` (with one family) runs that case alone and keeps its files."""
    log = log or (lambda s: None)
    targets = dict(QUICK_TARGETS if quick else {"metadata": 320, "keys": 2080, "archive": 340}, **(targets or {}))
    workers = workers or max(1, min(2, os.cpu_count() or 1))
    os.makedirs(work, exist_ok=True)
    zs = [Zygote(os.path.join(work, f"zygote-{i}")) for i in range(workers)]
    out: dict = {"seed": seed, "workers": workers}
    tallies: dict = {}
    try:
        out["harness"] = selftest(zs[0], work)
        for fam in families:
            rng = random.Random(f"{seed}:{fam}")
            t = Tally(fam)
            tallies[fam] = t
            t0 = time.monotonic()
            try:
                if fam == "metadata":
                    extra = run_metadata(zs, work, rng, targets["metadata"], t, log, only_case)
                elif fam == "keys":
                    extra = run_keys(zs, work, rng, targets["keys"], t, log, only_case)
                else:
                    extra = run_archive(zs, work, rng, targets["archive"], t, log, quick, only_case)
            except Exception as e:  # noqa: BLE001 - the fuzzer itself broke: say so, run the others
                extra = {"harness_error": f"{type(e).__name__}: {e}"[:1000], "control_ok": False,
                         "control": {"ok": False}}
                log(f"{fam}: the fuzzer failed: {extra['harness_error']}")
            out[fam] = dict(t.as_dict(), seconds=round(time.monotonic() - t0, 1), **extra,
                            repro=f"python tools/chaos_fuzz.py --only {fam} --seed {seed} --target {fam}={targets[fam]} "
                                  "--case CASE --dir /tmp/repro   # CASE: a failure's 'case'")
    finally:
        for z in zs:
            z.close()
    out["figures"] = {
        "metadata_damage_trials": tallies["metadata"].cases if "metadata" in tallies else 0,
        "key_fuzz_cases": tallies["keys"].cases if "keys" in tallies else 0,
        "archive_fuzz_cases": tallies["archive"].cases if "archive" in tallies else 0,
        "crashes": sum(t.crashes for t in tallies.values()),
        "wrong_bytes": sum(t.wrong_bytes for t in tallies.values()),
        "hangs": sum(t.hangs for t in tallies.values()),
        "isolation_failures": sum(t.isolation_failures for t in tallies.values()),
        "refused_to_serve": tallies["metadata"].notes.get("writer refused to serve", 0) if "metadata" in tallies else 0,
    }
    harness_ok = out["harness"]["ok"] and out.get("metadata", {}).get("control_ok", True) \
        and (out.get("archive", {}).get("control") or {}).get("ok", True) \
        and not any("harness_error" in out.get(f, {}) for f in families)
    for fam in ("metadata", "keys", "archive"):  # families not run: empty, so reports keep their shape
        out.setdefault(fam, dict(Tally(fam).as_dict(), seconds=0.0, control_ok=True, control={"ok": True}))
    out["harness_ok"] = bool(harness_ok)
    return out


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zygote", metavar="WORKDIR", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="metadata,keys,archive", help="comma-separated families")
    ap.add_argument("--dir")
    ap.add_argument("--json")
    ap.add_argument("--workers", type=int)
    ap.add_argument("--target", action="append", default=[], metavar="FAMILY=N")
    ap.add_argument("--case", type=int, help="run only this case of the one family in --only (its files are kept in --dir)")
    a = ap.parse_args(argv)
    if a.zygote:
        zygote_main(a.zygote)
        return 0
    import tempfile

    work = a.dir or tempfile.mkdtemp(prefix="umbp-fuzz-")
    try:
        r = run_fuzzers(work, quick=a.quick, seed=a.seed, log=lambda s: print(s, flush=True),
                        families=tuple(a.only.split(",")), workers=a.workers,
                        targets={k: int(v) for k, v in (t.split("=") for t in a.target)}, only_case=a.case)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(r["figures"]))
    if a.case is not None:
        for fam in a.only.split(","):
            for f in r[fam]["failures"]:
                print(json.dumps(f, default=str, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
