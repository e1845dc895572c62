"""Shared store-test fixtures."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from umbp_nvme.config import StoreConfig  # noqa: E402

SGLANG_MISSING = "sglang is not installed (tools/install_sglang.sh installs sglang==0.5.23; .ci/run does)"


class _TestsFolderIsNotSglang:
    """``import sglang`` on a machine without the wheel fails as it would outside the tests.

    tests/ is on sys.path (pytest puts the conftest's folder there), so without the wheel
    ``import sglang`` finds the test folder tests/sglang/ as a namespace package and succeeds:
    ``pytest.importorskip("sglang")`` then runs a test that fails deep inside instead of skipping
    (issue 35). A spec with no origin keeps ``importlib.util.find_spec`` answering as it did
    (bench/sglang_pools.sglang_installed checks the origin); loading it raises ModuleNotFoundError.
    """

    folder = os.path.join(ROOT, "tests", "sglang")

    def find_spec(self, name, path=None, target=None):
        if name != "sglang" or path is not None:
            return None
        import importlib.machinery

        # what the other finders would import
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)
        if spec is None or spec.origin is not None:
            return None  # absent, or the real package: the usual finders answer
        places = [os.path.realpath(p) for p in spec.submodule_search_locations or ()]
        if places and all(p == os.path.realpath(self.folder) for p in places):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ModuleNotFoundError(f"No module named 'sglang': {SGLANG_MISSING}", name="sglang")


sys.meta_path.insert(0, _TestsFolderIsNotSglang())


def pytest_terminal_summary(terminalreporter):
    """Say once, at the end, how many skips were for want of the sglang wheel (a test file that
    needs it throughout skips as one)."""
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = (str(getattr(r, "longrepr", "")).lower() for r in skipped)
    n = sum(1 for why in reasons if "sglang" in why and "not installed" in why)  # not: "0.5.22 has no X"
    if n:
        terminalreporter.write_line(f"{n} skips (a test, or a whole test file) because {SGLANG_MISSING}")

KiB, MiB = 1 << 10, 1 << 20


def small_config(**kw) -> StoreConfig:
    base = dict(
        ssd_capacity_bytes=16 * MiB,
        ssd_segment_size_bytes=1 * MiB,
        ssd_durability_mode="relaxed",
        ssd_io_backend="auto",
        ssd_queue_depth=64,
        io_timeout_s=20.0,
    )
    base.update(kw)
    return StoreConfig(**base)


def open_direct(path, flags=os.O_RDWR | os.O_CREAT) -> int:
    """os.open with O_DIRECT; skips the test where the file system refuses it (tmpfs)."""
    try:
        return os.open(path, flags | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            pytest.skip(f"O_DIRECT unsupported on {path} (tmpfs?)")
        raise


_NO_MEMLOCK_PRELUDE = textwrap.dedent(
    """
    import ctypes, resource
    libc = ctypes.CDLL(None, use_errno=True)
    class Hdr(ctypes.Structure): _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure): _fields_ = [("eff", ctypes.c_uint32), ("perm", ctypes.c_uint32), ("inh", ctypes.c_uint32)]
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) == 0:
        for d in data:  # drop CAP_IPC_LOCK (14) so RLIMIT_MEMLOCK applies, as for a normal user
            d.eff &= ~(1 << 14); d.perm &= ~(1 << 14); d.inh &= ~(1 << 14)
        libc.capset(ctypes.byref(hdr), data)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
    """
)


def run_without_memlock(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a child Python as a normal user pins memory: CAP_IPC_LOCK dropped and
    RLIMIT_MEMLOCK at 1 MiB; the checkout is on its PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", _NO_MEMLOCK_PRELUDE + code], capture_output=True, text=True, env=env, timeout=60
    )


def damage_object(store_dir, st, key: str, at: int, data: bytes) -> None:
    """Overwrite ``data`` at byte ``at`` of ``key``'s extent on disk, durably, and drop the page
    cache of its segment, so the next read comes from the damaged disk bytes."""
    from umbp_nvme.store.segments import segment_name

    seg, off = st.locate([key])[0][:2]
    path = os.path.join(store_dir, segment_name(seg))
    with open(path, "r+b") as f:
        f.seek(off + at)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def payload(key: str, nbytes: int) -> np.ndarray:
    """Deterministic bytes per key, so any mix-up between keys shows."""
    seed = int.from_bytes(hashlib.blake2b(f"{key}/{nbytes}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


async def key_set_ready(st, wait_s: float = 30.0) -> None:
    """Until a follower answers exists from its key set (store/follower_keys.py): its first exists
    starts the build (a follower that never asks builds none). ``wait_s`` guards a hang only."""
    import asyncio
    import time

    await st.exists_many(["any"])
    end = time.monotonic() + wait_s
    while st.stats()["key_set"] != "ready":
        assert time.monotonic() < end, f"the follower's key set is still {st.stats()['key_set']}"
        await asyncio.sleep(0.005)


@pytest.fixture
def store_dir(tmp_path):
    return str(tmp_path / "store")


# -- SGLang backend fixtures (the sglang tests import tests/support/sglang_env.py, which skips without it)


@pytest.fixture
def root(tmp_path):
    return str(tmp_path / "l3")


@pytest.fixture
def hybrid(root):
    """A backend on an MHA KV pool with an `swa` and a Mamba side pool registered."""
    from support import sglang_env as E

    kv, swa, mamba = E.mha_pool(), E.swa_pool(), E.mamba_pool()
    backend = E.load_backend(E.storage_config(root), kv.host, {"swa": swa.host, "mamba": mamba.host})
    yield backend, kv, swa, mamba
    backend.close()


def mount_tmpfs(path: str, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path``; the reason it could not, or None."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return "needs root and mount(8)"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True, text=True)
    return None if r.returncode == 0 else f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"
