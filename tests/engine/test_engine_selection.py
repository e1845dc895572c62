"""open_engine: backend selection, io_uring -> posix fallback logged once; bench smoke test."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import types

import pytest

import umbp_nvme.engine as engine_mod
from umbp_nvme.engine import EngineUnavailable, IoEngine, PosixEngine, open_engine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import umbp_nvme._uring  # noqa: E402,F401 - required: a missing extension fails here, never skips


@pytest.fixture(autouse=True)
def fresh_warning(monkeypatch):
    monkeypatch.delenv(engine_mod.FORCE_NO_URING_ENV, raising=False)
    engine_mod.reset_fallback_warning()
    yield
    engine_mod.reset_fallback_warning()


def _fallback_warnings(caplog):
    return [r for r in caplog.records if r.name == engine_mod.__name__ and r.levelno == logging.WARNING]


async def test_posix_forced():
    eng = await open_engine("posix", queue_depth=16)
    assert isinstance(eng, PosixEngine) and isinstance(eng, IoEngine)
    assert eng.capabilities.queue_depth == 16
    eng.close()


async def test_posix_workers_bound():
    eng = await open_engine("posix", queue_depth=256, workers=3)
    assert eng.capabilities.queue_depth == 3
    eng.close()


async def test_unknown_backend_is_refused_clearly():
    with pytest.raises(ValueError, match="'spdk'"):
        await open_engine("spdk")


@pytest.mark.parametrize("backend", ["auto", "io_uring"])
async def test_forced_uring_failure_falls_back_to_posix_logged_once(backend, monkeypatch, caplog):
    monkeypatch.setenv(engine_mod.FORCE_NO_URING_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=engine_mod.__name__):
        engines = [await open_engine(backend, queue_depth=32) for _ in range(3)]
    assert all(e.capabilities.name == "posix" for e in engines)
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1
    assert engine_mod.FORCE_NO_URING_ENV in warnings[0].getMessage()
    if backend == "io_uring":
        assert "requested" in warnings[0].getMessage()
    for e in engines:
        e.close()


@pytest.mark.parametrize("err", [errno.ENOSYS, errno.EPERM])
async def test_uring_setup_error_falls_back(err, monkeypatch, caplog):
    # What the kernel answers without io_uring (ENOSYS) or under seccomp (EPERM).
    fake = types.ModuleType("umbp_nvme.engine.uring")

    def open_uring_engine(queue_depth):
        raise EngineUnavailable(err, f"io_uring_setup: {os.strerror(err)}")

    fake.open_uring_engine = open_uring_engine
    monkeypatch.setitem(sys.modules, "umbp_nvme.engine.uring", fake)
    with caplog.at_level(logging.WARNING, logger=engine_mod.__name__):
        eng = await open_engine("auto")
    assert eng.capabilities.name == "posix"
    (w,) = _fallback_warnings(caplog)
    assert errno.errorcode[err] in w.getMessage()
    eng.close()


async def test_auto_picks_io_uring_when_it_works(caplog):
    with caplog.at_level(logging.WARNING, logger=engine_mod.__name__):
        eng = await open_engine("auto")
    assert eng.capabilities.name == "io_uring"
    assert not _fallback_warnings(caplog)
    eng.close()


def test_env_makes_real_uring_setup_fail_in_a_fresh_process():
    code = (
        "import asyncio, logging; logging.basicConfig();"
        "from umbp_nvme.engine import open_engine;"
        "e = asyncio.run(open_engine('auto')); print(e.capabilities.name)"
    )
    env = dict(os.environ, **{engine_mod.FORCE_NO_URING_ENV: "1"}, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.stdout.strip() == "posix", r.stderr
    assert r.stderr.count("io_uring unavailable") == 1


# -- benchmark smoke test ----------------------------------------------------------------------

ROW_KEYS = {
    "bench": str,
    "system": str,
    "op": str,
    "object_bytes": int,
    "queue_depth": int,
    "gbps": float,
    "iops": float,
    "cpu_us_per_op": float,
    "runs": int,
    "buffers": str,
}


def test_bench_engine_smoke(tmp_path):
    out = tmp_path / "rows.json"
    systems = "umbp_uring,umbp_posix,preadv_threads,fio"
    cmd = [
        sys.executable, "-m", "umbp_nvme.bench", "engine", "--quick",
        "--dir", str(tmp_path), "--file-size", "8m", "--sizes", "4k,64k", "--qd", "1,4",
        "--runs", "2", "--duration", "0.03", "--buffers", "4k", "--systems", systems,
        "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "GB/s" in r.stdout
    rows = json.loads(out.read_text())
    got = {row["system"] for row in rows}
    assert {"umbp_posix", "preadv_threads"} <= got
    assert len(rows) == 2 * 2 * 2 * len(got)  # ops x sizes x depths x systems
    for row in rows:
        for key, typ in ROW_KEYS.items():
            assert isinstance(row[key], typ), (key, row)
        assert row["bench"] == "engine" and row["op"] in ("read", "write")
        assert row["object_bytes"] in (4096, 65536) and row["queue_depth"] in (1, 4)
        # CPU time is tick-granular on some kernels: a tiny, slow cell can measure 0.
        assert row["gbps"] > 0 and row["iops"] > 0 and row["cpu_us_per_op"] >= 0 and row["runs"] == 2
        assert row["gbps_min"] <= row["gbps"] <= row["gbps_max"]
        if "fio" in got and not row["system"].startswith("fio"):
            assert row["vs_fio"] > 0
    assert not list(tmp_path.glob("*.dat"))  # the test file is removed


def test_bench_dispatcher_rejects_unknown_benchmark():
    r = subprocess.run(
        [sys.executable, "-m", "umbp_nvme.bench", "nope"], capture_output=True, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO), timeout=60,
    )  # fmt: skip
    assert r.returncode != 0 and "unknown benchmark" in r.stderr
