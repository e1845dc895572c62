"""Issue 29: what cost a newcomer the first hour, each now one clear line (and never a traceback).

Every test runs the exact command a user typed (in a child process where the environment,
the user or the terminal matter) and asserts the exit code and the message.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

import umbp_nvme.cli.main as cli
from umbp_nvme.bench import BENCHES

ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_cli(*argv, env=None, cwd=None, timeout=180):
    p = subprocess.run([sys.executable, "-m", "umbp_nvme.cli", *argv], capture_output=True, text=True,
                       timeout=timeout, env={**ENV, **(env or {})}, cwd=cwd or ROOT)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("demo") / "kept")
    p = run_cli("demo", "--keep", d)
    assert p.returncode == 0, p.stderr
    return d, p.stdout


# --- demo --keep, and the directory the user gave ------------------------------------------------


def test_demo_keep_makes_the_store_in_the_directory_given_and_says_so(demo_store):
    d, out = demo_store
    assert os.path.isfile(os.path.join(d, "MANIFEST.json"))
    assert f"the store is kept in {d}" in out and f"umbp-nvme stats --store {d}" in out
    p = run_cli("stats", "--store", d)
    assert p.returncode == 0 and p.stdout.startswith(f"store        {d}")
    assert "objects      512" in p.stdout  # 2 x 128 pages x (K, V)


def test_demo_keep_runs_again_on_its_own_store_and_refuses_a_directory_of_other_files(demo_store, tmp_path):
    d, _ = demo_store
    again = run_cli("demo", "--keep", d)
    assert again.returncode == 0 and "result: OK" in again.stdout
    (tmp_path / "notes.txt").write_text("mine")
    p = run_cli("demo", "--keep", str(tmp_path))
    assert p.returncode == 2
    assert p.stderr.strip() == (f"umbp-nvme demo: error: --keep {tmp_path} is a directory that holds other files "
                                "and no store; give a new or empty directory (the demo makes its store there)")
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_a_directory_holding_a_store_one_level_down_names_it(demo_store, tmp_path):
    d, _ = demo_store
    shutil.copytree(d, tmp_path / "store")
    p = run_cli("stats", "--store", str(tmp_path))
    assert p.returncode == 2
    assert p.stderr.strip().endswith(f"it holds a store one level down: --store {tmp_path / 'store'}")


# --- paths: a file, ~, permissions -------------------------------------------------------------------


@pytest.mark.parametrize("cmd", [["stats"], ["doctor", "--no-probe"], ["verify"], ["compact"], ["warmup", "SRC"]])
def test_a_store_path_that_is_a_file_is_named_as_a_file(tmp_path, cmd):
    f = tmp_path / "afile"
    f.write_text("x")
    argv = [a if a != "SRC" else str(tmp_path) for a in cmd]
    p = run_cli(argv[0], "--store", str(f), *argv[1:])
    assert p.returncode == 2
    assert p.stderr.strip() == (f"umbp-nvme {cmd[0]}: error: --store {f} is a file, not a directory; give the "
                                "store's directory (one rank's ssd_storage_dir), or a new path for a writing "
                                "command to create")


def test_a_quoted_tilde_is_the_home_directory_not_a_directory_named_tilde(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    p = run_cli("demo", "--keep", "~/kv", env={"HOME": str(home)}, cwd=str(work))
    assert p.returncode == 0, p.stderr
    assert os.path.isfile(home / "kv" / "MANIFEST.json") and os.listdir(work) == []
    s = run_cli("stats", "--store", "~/kv", "--json", env={"HOME": str(home)}, cwd=str(work))
    assert s.returncode == 0 and f'"store": "{home / "kv"}"' in s.stdout


# Root ignores file modes through CAP_DAC_OVERRIDE; without it (and CAP_DAC_READ_SEARCH) root meets
# them like any owner, so the test sees what a user sees.
_AS_A_USER = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
class Hdr(ctypes.Structure): _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure): _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
hdr, data = Hdr(0x20080522, 0), (Data * 2)()
assert libc.capget(ctypes.byref(hdr), data) == 0
for d in data:
    d.eff &= ~0b110; d.perm &= ~0b110; d.inh &= ~0b110
assert libc.capset(ctypes.byref(hdr), data) == 0
from umbp_nvme.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_read_only_store_directory_names_owner_mode_and_the_fix(demo_store, tmp_path):
    d, _ = demo_store
    store = tmp_path / "store"
    shutil.copytree(d, store)
    for root, dirs, files in os.walk(store):  # chmod -R a-w, as a user would make it read-only
        for f in files:
            os.chmod(os.path.join(root, f), 0o400)
    os.chmod(store, 0o500)
    try:
        p = subprocess.run([sys.executable, "-c", _AS_A_USER, "compact", "--store", str(store)], capture_output=True,
                           text=True, timeout=120, env=ENV)
        assert "Traceback" not in p.stderr and p.returncode == 2, p.stderr
        uid = os.geteuid()
        assert p.stderr.strip() == (
            f"umbp-nvme compact: error: permission denied: {store}/LOCK ({store}: owner uid {uid}, mode 500; "
            f"this process runs as uid {uid}). The store directory must be writable by the user who runs umbp-nvme "
            f"(its index lock is written even by stats): chmod -R u+w {store}, or run as its owner")
    finally:
        os.chmod(store, 0o700)


# --- sizes ------------------------------------------------------------------------------------------


def test_sizes_are_binary_and_a_decimal_looking_unit_is_refused_with_the_exact_spellings(demo_store):
    d, _ = demo_store
    p = run_cli("stats", "--store", d, "--capacity", "10GB")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        "umbp-nvme stats: error: argument --capacity: '10GB' is ambiguous (decimal or binary?); sizes here are "
        "binary: write 10GiB or 10g (10737418240 bytes = 10 GiB), or give bytes")
    for spelled in ("1g", "1GiB", "1073741824", "0.5T"):
        s = run_cli("stats", "--store", d, "--capacity", spelled, "--json")
        assert s.returncode == 0 and '"capacity_bytes": ' + str(cli.parse_size(spelled)) in s.stdout
    assert cli.parse_size("0.5T") == 1 << 39
    c = run_cli("stats", "--store", d, "--config", '{"ssd_capacity_bytes": "10GB"}')
    assert c.returncode == 2 and "extra_config['ssd_capacity_bytes']: '10GB' is ambiguous" in c.stderr


# --- a capacity the file system cannot hold ---------------------------------------------------------


def test_a_capacity_past_the_file_system_is_a_warning_naming_both_numbers(demo_store, tmp_path):
    from umbp_nvme.store.fs_room import capacity_shortfall

    d, _ = demo_store
    free = shutil.disk_usage(tmp_path).free
    assert capacity_shortfall(str(tmp_path / "new"), 1 << 20) is None
    msg = capacity_shortfall(str(tmp_path / "new"), 1 << 50)
    assert msg.startswith(f"capacity {1 << 50} bytes = 1 PiB is more than the file system under {tmp_path / 'new'} "
                          "can hold (") and " free" in msg and "Lower ssd_capacity_bytes (--capacity)" in msg
    held = int(msg.split("can hold (")[1].split(" bytes")[0])
    assert abs(held - free) < 256 << 20  # the free space, as statvfs says (other writers move it a little)
    p = run_cli("warmup", "--store", str(tmp_path / "big"), "--capacity", "1p",
                "--config", '{"ssd_segment_size_bytes": "256m"}', d)
    assert p.returncode == 0, p.stderr
    warn = [ln for ln in p.stderr.splitlines() if "WARNING" in ln]
    assert len(warn) == 1 and f"capacity {1 << 50} bytes = 1 PiB is more than the file system" in warn[0]


def test_the_sglang_backend_warns_at_open_when_the_capacity_cannot_fit(tmp_path, caplog):
    from support.standin_pools import Config, FakeMHAPool

    os.environ["UMBP_NVME_NO_SGLANG"] = "1"  # the stand-in base class: no SGLang needed
    try:
        spec = importlib.util.spec_from_file_location(
            "umbp_nvme.sglang._backend_first_hour", os.path.join(ROOT, "umbp_nvme", "sglang", "backend.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    finally:
        del os.environ["UMBP_NVME_NO_SGLANG"]
        sys.modules.pop("umbp_nvme.sglang._backend_first_hour", None)
    cfg = Config(str(tmp_path / "s"))
    cfg.extra_config.update(ssd_capacity_bytes="1PiB", ssd_segment_size_bytes="256MiB")
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.store"):
        backend = mod.UMBPNvmeStore(cfg, FakeMHAPool())
    try:
        warn = [r.getMessage() for r in caplog.records if "more than the file system" in r.getMessage()]
        assert len(warn) == 1 and warn[0].startswith(f"capacity {1 << 50} bytes = 1 PiB is more than")
    finally:
        backend.close()


# --- bench -------------------------------------------------------------------------------------------


def test_bench_options_reach_the_benchmark_without_a_double_dash(monkeypatch):
    from umbp_nvme import bench

    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "store", "--roots", "D0,D1,D2,D3", "--stall", "3"]) == 0
    assert cli.main(["-v", "bench", "--quick"]) == 0
    assert seen == [["store", "--roots", "D0,D1,D2,D3", "--stall", "3"], ["engine", "--quick"]]


def test_bench_help_of_a_benchmark_lists_its_own_options_and_an_unknown_one_is_one_line():
    p = run_cli("bench", "store", "--help")
    assert p.returncode == 0 and "--dir DIR" in p.stdout and "--keep" in p.stdout and "--roots" in p.stdout
    u = run_cli("bench", "stor")
    assert u.returncode == 2 and u.stderr.strip() == (
        "umbp-nvme bench: error: unknown benchmark 'stor'; expected one of: " + ", ".join(BENCHES) +
        " (`umbp-nvme bench NAME --help` lists its options)")


def _bench_store(*argv, verbose=False):
    p = run_cli(*(["-v"] if verbose else []), "bench", "store", "--smoke", "--buffers", "4k", *argv, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return p


def test_bench_store_says_where_it_writes_and_removes_only_what_it_made(tmp_path):
    d = tmp_path / "bench"
    d.mkdir()
    (d / "mine.txt").write_text("the user's")
    p = _bench_store("--dir", str(d), "--ops", "put,rebuild")
    assert f"bench store: writing under {d}; what this run makes there is removed at the end" in p.stdout
    assert os.listdir(d) == ["mine.txt"]
    # the deliberate index loss of the rebuild measurement is logged at INFO, not as an ERROR
    assert "index.lmdb is missing" not in p.stderr and "ERROR" not in p.stderr
    assert "NOT MET" not in p.stdout and "bench target: rebuild = " in p.stdout


def test_bench_store_removes_a_directory_it_made_unless_keep(tmp_path):
    p = _bench_store("--dir", str(tmp_path / "made"), "--ops", "rebuild", verbose=True)
    assert not os.path.exists(tmp_path / "made")
    missing = [ln for ln in p.stderr.splitlines() if "index.lmdb is missing" in ln]
    assert missing and all(ln.startswith("umbp-nvme: INFO umbp_nvme.store: ") for ln in missing)  # shown with -v
    p = _bench_store("--dir", str(tmp_path / "kept"), "--ops", "reopen", "--keep")
    assert "kept (--keep)" in p.stdout
    assert [n for n in os.listdir(tmp_path / "kept") if n.startswith("reopen-")]


def test_bench_store_stall_without_the_fake_drives_tool_says_so_before_it_starts(tmp_path):
    p = run_cli("bench", "store", "--roots", f"{tmp_path}/a,{tmp_path}/b", "--stall", "1",
                "--stall-tool", str(tmp_path / "fake-drives"))
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        f"umbp-nvme bench store: error: --stall needs the fake-drives tool to stall a drive, and "
        f"'{tmp_path / 'fake-drives'}' is not on PATH: give --stall-tool PATH or set FAKE_DRIVES (the drives come "
        "from `fake-drives up 4`)")
    assert os.listdir(tmp_path) == []


async def test_the_python_api_warns_at_open_when_the_capacity_cannot_fit(tmp_path, caplog):
    from umbp_nvme import PageStore, StoreConfig

    cfg = StoreConfig(ssd_capacity_bytes=1 << 50, ssd_segment_size_bytes=256 << 20)
    with caplog.at_level(logging.WARNING, logger="umbp_nvme"):
        st = await PageStore.open(str(tmp_path / "s"), cfg)
        await st.close()
    warn = [r.getMessage() for r in caplog.records if "is more than the file system" in r.getMessage()]
    assert len(warn) == 1 and warn[0].startswith(f"capacity {1 << 50} bytes = 1 PiB")
