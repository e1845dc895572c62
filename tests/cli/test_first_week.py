"""Issue 35: what stood between an operator's pilot and a rollout, each now said plainly.

Every test here failed on the code before issue 35 (each commit message says how it was checked).
Commands run as the user typed them, in a child process where the environment matters.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
NO_SGLANG = os.path.join(ROOT, "tests", "support", "no_sglang")


# --- make test on a machine without sglang -----------------------------------------------------------


def test_the_sglang_tests_skip_and_say_so_on_a_machine_without_sglang():
    """The README's test command on a fresh machine: every test that needs the sglang wheel skips
    with the reason, none fails (tests/sglang/ is not the sglang package)."""
    env = {**ENV, "PYTHONPATH": NO_SGLANG + os.pathsep + ENV["PYTHONPATH"]}
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('sglang'))"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert probe.stdout.strip() == "None", probe.stdout + probe.stderr  # the wheel is out of sight
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        "tests/engine/test_bench_mixed.py", "-k", "sglang",
                        "tests/sglang/test_backend_on_real_wheel.py", "tests/sglang/test_key_contract.py"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert " failed" not in out and " error" not in out, out[-3000:]
    skips = [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]
    assert len(skips) >= 3 and all("sglang" in ln for ln in skips), skips
    assert any(ln.endswith("skips (a test, or a whole test file) because sglang is not installed "
                           "(tools/install_sglang.sh installs sglang==0.5.23; .ci/run does)")
               for ln in out.splitlines()), out[-2000:]


# --- the extra_config key table ------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_extra_config_table_is_generated_from_the_code_and_lists_every_key():
    from umbp_nvme import config, config_doc
    from umbp_nvme.sglang import kv_events, seam

    path = os.path.join(ROOT, "docs", "sglang.md")
    text = open(path, encoding="utf-8").read()
    assert config_doc.replaced(text) == text, "stale: run python -m umbp_nvme.config_doc --write docs/sglang.md"
    table = text.split(config_doc.BEGIN)[1].split(config_doc.END)[0]
    listed = {k for ln in table.splitlines()[2:] for k in re.findall(r"`([^`]+)`", ln.split(" | ")[0])}
    every = ({f.name for f in dataclasses.fields(config.StoreConfig)} | set(config.ACCEPTED_KEYS)
             | set(seam.BACKEND_KEYS) | set(kv_events.KEYS) | config.LOADER_KEYS | config.DISTRIBUTED_ONLY_KEYS)
    assert every - listed == set() and len(every) > 60
    row = next(ln for ln in table.splitlines() if ln.startswith("| `ssd_capacity_bytes` |"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1:5] == ["`UMBP_SSD_CAPACITY`", "size", "32 GiB", "bytes"] and "**per rank**" in cells[5]
    row = next(ln for ln in table.splitlines() if ln.startswith("| `ssd_io_backend` |"))
    assert "`posix`, `io_uring`, `auto`" in row and "`UMBP_SSD_IO_BACKEND`" in row
    # the check the docs name: 0 on the file, 1 with the fix on a stale copy
    stale = os.path.join(os.path.dirname(path), ".stale-sglang.md")
    try:
        with open(stale, "w", encoding="utf-8") as f:
            f.write(text.replace("| `ssd_queue_depth` |", "| `ssd_queue_depth_old` |"))
        ok = subprocess.run([sys.executable, "-m", "umbp_nvme.config_doc", "--check", path], env=ENV,
                            capture_output=True, text=True, timeout=60)
        bad = subprocess.run([sys.executable, "-m", "umbp_nvme.config_doc", "--check", stale], env=ENV,
                             capture_output=True, text=True, timeout=60)
    finally:
        os.unlink(stale)
    assert ok.returncode == 0 and bad.returncode == 1
    assert bad.stderr.strip().endswith("the config table is stale; run python -m umbp_nvme.config_doc --write "
                                       + stale)


def test_a_setting_without_a_meaning_cannot_be_left_out_of_the_table():
    from umbp_nvme import config_doc

    Bare = dataclasses.make_dataclass("Bare", [("ssd_new_knob_bytes", int, dataclasses.field(default=1))])
    with pytest.raises(ValueError, match=r"Bare\.ssd_new_knob_bytes says nothing of what it means"):
        config_doc.rows(Bare)


def test_the_readme_links_the_key_table_and_says_the_capacity_is_per_rank():
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    link = re.search(r"\]\((docs/sglang\.md)#([\w-]+)\)", readme)
    assert link, "the README links docs/sglang.md's key table"
    headings = [ln.lstrip("#").strip() for ln in open(os.path.join(ROOT, link.group(1)), encoding="utf-8")
                if ln.startswith("## ")]
    target = next(h for h in headings if _slug(h) == link.group(2))
    assert target == "9. `extra_config` keys"
    assert "**`ssd_capacity_bytes` is per rank, as in UMBP**" in readme and "asks the drive for 4 TiB" in readme


# --- the capacity a store really runs with -----------------------------------------------------------


def run_cli(*argv, env=None, timeout=180):
    p = subprocess.run([sys.executable, "-m", "umbp_nvme.cli", *argv], capture_output=True, text=True,
                       timeout=timeout, env={**ENV, **(env or {})}, cwd=ROOT)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def _sized_store(path: str, capacity_bytes: int, n: int = 8) -> int:
    """A store opened with ``capacity_bytes`` and holding n objects of 256 KiB in its first 64 MiB
    segment (its segment files say 64-128 MiB, its manifest the capacity); returns the slot bytes used."""
    from umbp_nvme import PageStore, StoreConfig

    async def run():
        cfg = StoreConfig(ssd_capacity_bytes=capacity_bytes, ssd_segment_size_bytes=64 << 20,
                          ssd_durability_mode="relaxed")
        async with await PageStore.open(path, cfg) as st:
            keys = [f"{i:064x}_0_k" for i in range(n)]
            assert all(await st.put_many(keys, [np.full(256 << 10, i, np.uint8) for i in range(n)]))

    asyncio.run(run())
    return n * (256 << 10)


def test_stats_prometheus_and_doctor_report_the_capacity_the_manifest_records(tmp_path):
    d = str(tmp_path / "s")
    used = _sized_store(d, 2 << 30)
    s = json.loads(run_cli("stats", "--store", d, "--json").stdout)
    assert s["capacity_bytes"] == 2 << 30 and s["recorded_capacity_bytes"] == 2 << 30
    assert s["capacity_source"] == "recorded in MANIFEST.json: the capacity its writer runs with"
    assert s["fill"] == round(used / (2 << 30), 4) and s["segment_files"] <= 2  # the files alone say 128 MiB
    text = run_cli("stats", "--store", d).stdout
    assert "capacity     2.00 GiB (recorded in MANIFEST.json: the capacity its writer runs with)" in text
    assert "GiB in slots (0.1 %)" in text
    prom = run_cli("stats", "--store", d, "--prometheus").stdout
    assert re.search(r"^umbp_nvme_capacity_bytes\{[^}]*\} 2\.147483648e\+09$", prom, re.M), prom[:2000]
    what_if = json.loads(run_cli("stats", "--store", d, "--capacity", "4g", "--json").stdout)
    assert what_if["capacity_bytes"] == 4 << 30 and what_if["capacity_source"].startswith("given: --capacity")
    doc = json.loads(run_cli("doctor", "--store", d, "--no-probe", "--json").stdout)
    fs = doc["items"]["filesystem"]
    assert fs["capacity_bytes"] == 2 << 30 and fs["capacity_source"].startswith("recorded in MANIFEST.json")
    assert any(f["message"].startswith("capacity 2147483648 bytes = 2 GiB (recorded in MANIFEST.json") and
               "per store directory: each rank of an SGLang server has its own" in f["message"]
               for f in doc["findings"]) or fs["free_bytes"] < 2 << 30


# --- silent zeros and empty successes ----------------------------------------------------------------


def test_a_capacity_of_0_is_refused_not_read_as_the_default(tmp_path):
    d = str(tmp_path / "s")
    _sized_store(d, 256 << 20, n=1)
    for argv in (["stats", "--store", d, "--capacity", "0"], ["warmup", "--store", str(tmp_path / "new"),
                                                               "--capacity", "0k", d]):
        p = run_cli(*argv)
        assert p.returncode == 2, p.stdout
        assert p.stderr.strip().splitlines()[-1].endswith(
            "is 0 bytes; give a size above 0 (e.g. 500g), or leave the option out: an existing store keeps the "
            "capacity it records, a new one gets UMBP_SSD_CAPACITY or 32 GiB")
    assert not os.path.exists(tmp_path / "new")
    b = run_cli("warmup", "--store", str(tmp_path / "new"), "--batch-size", "0", d)
    assert b.returncode == 2 and "argument --batch-size: '0' is 0 bytes" in b.stderr


def test_warmup_of_a_directory_without_this_ranks_page_files_fails_and_creates_nothing(tmp_path):
    src = tmp_path / "hicache"
    src.mkdir()
    p = run_cli("warmup", "--store", str(tmp_path / "s"), str(src))
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip() == (
        f"umbp-nvme warmup: error: SOURCE {src} holds no page files of this rank (names ending '__0_1.bin'); it is "
        "empty. Check --model / --tp-rank / --tp-size / --pp-* / --mla against the server that wrote them. Nothing "
        "was imported and the store was not opened")
    (src / f"{'a' * 64}_other-model_0_1.bin").write_bytes(b"\0" * 8192)
    p = run_cli("warmup", "--store", str(tmp_path / "s"), "--model", "mine", str(src))
    assert p.returncode == 2 and "names ending '_mine_0_1.bin'); it holds 1 other file (" in p.stderr
    assert not os.path.exists(tmp_path / "s")


def test_export_into_a_missing_directory_names_the_directory_and_the_fix(tmp_path):
    d = str(tmp_path / "s")
    _sized_store(d, 256 << 20, n=1)
    out = tmp_path / "nowhere" / "cache.umbparc"
    p = run_cli("export", "--store", d, "--out", str(out))
    assert p.returncode == 2
    assert p.stderr.strip() == (
        f"umbp-nvme export: error: cannot write the archive {out}: its directory {out.parent} does not exist; "
        f"create it first (mkdir -p {out.parent}) or write the archive into an existing directory")
    assert ".partial." not in p.stderr and sorted(os.listdir(tmp_path)) == ["s"]


def test_warmup_into_a_store_a_writer_holds_says_what_to_do_instead_of_opening_read_only(tmp_path):
    src, d = str(tmp_path / "src"), str(tmp_path / "s")
    _sized_store(src, 256 << 20, n=2)
    _sized_store(d, 256 << 20, n=0)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({os.path.join(d, 'LOCK')!r}, os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.pwrite(fd, b'%d\\n' % os.getpid(), 0)\n"
        "print('held', flush=True); sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        p = run_cli("warmup", "--store", d, src)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert p.returncode == 2 and "read-only" not in p.stderr
    assert p.stderr.strip() == (
        f"umbp-nvme warmup: error: warmup writes into {d}, but a writer (pid {holder.pid}) holds it; a store has one "
        "writer at a time. Stop that process (or the SGLang server using this directory) and run warmup again, or "
        "warm the running server instead: umbp-nvme warmup --replay PROMPTS.jsonl --server URL sends it prompts and "
        "it writes the pages itself")


@pytest.fixture
def small_fs(tmp_path):
    """A 48 MiB file system: one 64 MiB segment cannot fit (root and mount(8); skips otherwise)."""
    from conftest import mount_tmpfs

    mnt = str(tmp_path / "small")
    why = mount_tmpfs(mnt, "48m")
    if why:
        pytest.skip(f"a small file system: {why}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def test_a_full_drive_is_one_line_with_its_cause_in_warmup_not_one_per_batch(tmp_path, small_fs):
    src = str(tmp_path / "src")
    _sized_store(src, 256 << 20, n=16)
    p = run_cli("warmup", "--store", os.path.join(small_fs, "s"), "--capacity", "1g", "--batch-size", "512k",
                "--config", '{"ssd_segment_size_bytes": "64m"}', "--json", src)
    assert p.returncode == 1, p.stderr
    warns = [ln for ln in p.stderr.splitlines() if "WARNING" in ln]
    assert not [ln for ln in warns if "keys failed" in ln], warns  # 8 batches: no line per batch
    cause = [ln for ln in warns if "this store can hold nothing" in ln]
    assert len(cause) == 2, warns  # the store's one line, and warm-up's summary of what it could not store
    assert "no room for segment 0 of 67108864 bytes = 64 MiB (ENOSPC; " in cause[0] and " free)" in cause[0]
    s = json.loads(p.stdout)
    # stopped once a batch found the store can hold nothing (the next one was already read: double buffering)
    assert s["imported"] == 0 and 0 < s["failed"] <= 4 and len(s["errors"]) == 1
    assert s["errors"][0].startswith(f"{s['failed']} objects were not stored (") and s["errors"][0].endswith(
        "; the import stopped, since nothing more can be stored")
    assert s["errors"][0].count("Free space on the drive, or make the store anew (a new directory) with a smaller "
                                "ssd_segment_size_bytes") == 1


async def test_a_full_drive_is_one_warning_for_many_put_batches(small_fs, caplog):
    from umbp_nvme import PageStore, StoreConfig

    cfg = StoreConfig(ssd_capacity_bytes=1 << 30, ssd_segment_size_bytes=64 << 20, ssd_durability_mode="relaxed")
    with caplog.at_level(logging.WARNING, logger="umbp_nvme"):
        async with await PageStore.open(os.path.join(small_fs, "s"), cfg) as st:
            for b in range(6):
                keys = [f"{b:032x}{i:032x}_0_k" for i in range(4)]
                assert await st.put_many(keys, [np.full(64 << 10, i, np.uint8) for i in range(4)]) == [False] * 4
            failed, shortage = st.stats()["put_failed"], getattr(st, "space_shortage", lambda: None)()
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in msgs if "keys failed" in m], msgs
    assert len([m for m in msgs if "this store can hold nothing, so every put answers False" in m]) == 1, msgs
    assert failed == 24 and shortage in msgs  # counted; and said once more to a caller that asks (warm-up)


# --- capacity per rank, said at the SGLang backend's open ---------------------------------------------


def _standin_backend():
    """The backend module on SGLang's stand-in base class (no sglang needed), loaded afresh."""
    import importlib.util

    os.environ["UMBP_NVME_NO_SGLANG"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(
            "umbp_nvme.sglang._backend_first_week", os.path.join(ROOT, "umbp_nvme", "sglang", "backend.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    finally:
        del os.environ["UMBP_NVME_NO_SGLANG"]
        sys.modules.pop("umbp_nvme.sglang._backend_first_week", None)
    return mod


def test_each_rank_says_its_store_and_capacity_and_ranks_past_the_file_system_are_warned(tmp_path, caplog):
    """TP 4 with a per-rank capacity that one drive holds once but not four times: one INFO line per
    rank (directory, capacity, per store directory), and the total past the file system warned with
    the per-rank value that fits (each store alone fits: the single-store check stays quiet)."""
    from support.standin_pools import Config, FakeMHAPool

    from umbp_nvme.sizes import format_bytes

    mod = _standin_backend()
    root = str(tmp_path / "hicache")
    vfs = os.statvfs(tmp_path)
    seg = 64 << 20
    cap = max(seg, int(vfs.f_bavail * vfs.f_frsize * 0.4) // seg * seg)  # 4 of them: 1.6x the free space
    backends = []
    with caplog.at_level(logging.INFO, logger="umbp_nvme"):
        try:
            for r in range(4):
                cfg = Config(root, tp_rank=r, tp_size=4)
                cfg.extra_config.update(ssd_capacity_bytes=cap, ssd_segment_size_bytes=seg)
                backends.append(mod.UMBPNvmeStore(cfg, FakeMHAPool()))
        finally:
            for b in backends:
                b.close()
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records]
    for r in range(4):
        line = (f"umbp_nvme: tp rank {r} writes store {root}/tp{r} with capacity {format_bytes(cap)} (ssd_capacity_bytes "
                "from extra_config['ssd_capacity_bytes']; per store directory: each rank has its own)")
        assert any(lv == logging.INFO and m.startswith(line) for lv, m in msgs), (line, msgs)
    total = [m for lv, m in msgs if lv == logging.WARNING and m.startswith(
        f"the 4 stores under {root} (tp0, tp1, tp2, tp3) ask {format_bytes(4 * cap)} together, more than its file "
        "system can hold (")]
    assert len(total) == 1 and "ssd_capacity_bytes is per store directory" in total[0], msgs
    fit = int(total[0].split("Set ssd_capacity_bytes to at most ")[1].split(" bytes")[0])
    assert cap > fit >= cap // 2  # about the room divided by 4
    assert not [m for lv, m in msgs if "is more than the file system under" in m]  # each one alone fits


def test_a_store_that_runs_with_the_default_directory_or_capacity_says_so_at_open(tmp_path, caplog):
    from support.standin_pools import Config, FakeMHAPool

    mod = _standin_backend()
    cfg = Config(str(tmp_path / "kv"))
    del cfg.extra_config["ssd_capacity_bytes"]
    with caplog.at_level(logging.INFO, logger="umbp_nvme"):
        mod.UMBPNvmeStore(cfg, FakeMHAPool()).close()
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (f"umbp_nvme: ssd_capacity_bytes is not set (extra_config or UMBP_SSD_CAPACITY), so {tmp_path / 'kv'} "
            "runs with the default 34359738368 bytes = 32 GiB. Set it per rank: the drive's room divided by the ranks "
            "that share it") in msgs
    assert not [m for m in msgs if "ssd_storage_dir is not set" in m]
    # the default directory: said before anything is made there (the announcement alone, no store opened)
    from umbp_nvme.config import config_sources, load_config
    from umbp_nvme.sglang.keys import KeyScheme
    from umbp_nvme.sglang.seam import Seam
    from umbp_nvme.sglang.startup import announce

    caplog.clear()
    env = {}
    seam = Seam(config=load_config({}, env), storage_config=Config("unused"), scheme=KeyScheme(), interface_v1=True,
                follower=False, store_dirs=["/tmp/umbp_ssd"], private_dirs=[], settings_from=config_sources({}, env))
    with caplog.at_level(logging.INFO, logger="umbp_nvme"):
        announce(seam)
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert ("umbp_nvme: ssd_storage_dir is not set (extra_config or UMBP_SSD_DIR), so the store is in the default "
            "/tmp/umbp_ssd: /tmp is often memory (tmpfs) or the root disk, and may be emptied at reboot. Set "
            "ssd_storage_dir to a directory on the NVMe drive") in msgs
    assert len(msgs) == 2  # and the capacity
    assert config_sources({"ssd_capacity_bytes": "1g"}, {"UMBP_SSD_DIR": "/x", "UMBP_SSD_CAPACITY": "2g"}) == {
        "ssd_storage_dir": "UMBP_SSD_DIR", "ssd_capacity_bytes": "extra_config['ssd_capacity_bytes']"}
