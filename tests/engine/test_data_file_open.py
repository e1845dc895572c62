"""open_data_file: O_DIRECT probe and buffered fallback, alignment, safe creation, preallocation."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import subprocess
import tempfile

import numpy as np
import pytest

from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.engine import files as files_mod
from umbp_nvme.engine import open_data_file
from umbp_nvme.engine.posix import PosixEngine

MiB = 1 << 20


@pytest.fixture(autouse=True)
def fresh_probe_cache():
    files_mod.forget_direct_refusals()
    yield
    files_mod.forget_direct_refusals()


def _flags(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_creates_0600_cloexec_direct_file(tmp_path):
    old = os.umask(0)
    try:
        f = open_data_file(tmp_path / "seg", create=True)
    finally:
        os.umask(old)
    st = os.fstat(f.fd)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert fcntl.fcntl(f.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    assert f.direct and _flags(f.fd) & os.O_DIRECT  # ext4 under /tmp takes O_DIRECT
    assert f.align >= 512 and f.align & (f.align - 1) == 0
    f.close()
    f.close()  # idempotent
    assert f.closed


def test_buffered_when_asked(tmp_path):
    f = open_data_file(tmp_path / "seg", create=True, direct=False)
    assert not f.direct and not _flags(f.fd) & os.O_DIRECT
    f.close()


def test_preallocates_size(tmp_path):
    f = open_data_file(tmp_path / "seg", create=True, size=8 * MiB)
    st = os.fstat(f.fd)
    assert st.st_size == 8 * MiB
    assert st.st_blocks * 512 >= 8 * MiB  # blocks reserved, not a sparse file
    f.close()
    # Reopening with a smaller size never truncates.
    f = open_data_file(tmp_path / "seg", size=1 * MiB)
    assert os.fstat(f.fd).st_size == 8 * MiB
    f.close()


def test_missing_file_without_create_is_enoent(tmp_path):
    with pytest.raises(OSError) as e:
        open_data_file(tmp_path / "nope")
    assert e.value.errno == errno.ENOENT and "nope" in str(e.value)


def test_never_follows_a_symlink(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"secret")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError) as e:
        open_data_file(tmp_path / "link", create=True, size=4096)
    assert e.value.errno == errno.ELOOP and "symlink" in str(e.value)
    assert target.read_bytes() == b"secret"


def test_readonly_open(tmp_path):
    open_data_file(tmp_path / "seg", create=True, size=4096).close()
    f = open_data_file(tmp_path / "seg", readonly=True)
    assert f.readonly and _flags(f.fd) & os.O_ACCMODE == os.O_RDONLY
    f.close()
    with pytest.raises(ValueError, match="readonly"):
        open_data_file(tmp_path / "seg", readonly=True, create=True)


def test_directory_is_refused(tmp_path):
    with pytest.raises(OSError):
        open_data_file(tmp_path)


def test_dio_alignment_from_statx(tmp_path):
    f = open_data_file(tmp_path / "seg", create=True)
    mem, off = files_mod.dio_alignment(f.fd)
    if mem == 0:
        pytest.skip("statx STATX_DIOALIGN not reported here (kernel < 6.1 or file system)")
    assert f.align == max(mem, off)
    f.close()


def _refuse_o_direct(monkeypatch):
    real_open = os.open
    attempts = []

    def fake_open(path, flags, mode=0o777, **kw):
        if flags & os.O_DIRECT:
            attempts.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(files_mod.os, "open", fake_open)
    return attempts


def test_o_direct_refusal_falls_back_to_buffered_logged_once(tmp_path, monkeypatch, caplog):
    attempts = _refuse_o_direct(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=files_mod.__name__):
        a = open_data_file(tmp_path / "a", create=True, size=MiB)
        b = open_data_file(tmp_path / "b", create=True, size=MiB)
    assert not a.direct and not b.direct
    assert len(attempts) == 1  # the refusal is remembered for the file system
    warnings = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(warnings) == 1 and str(tmp_path) in warnings[0].getMessage()
    a.close()
    b.close()


def test_other_open_errors_are_not_mistaken_for_a_refusal(tmp_path, monkeypatch):
    def fake_open(path, flags, mode=0o777, **kw):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(files_mod.os, "open", fake_open)
    with pytest.raises(OSError) as e:
        open_data_file(tmp_path / "a", create=True)
    assert e.value.errno == errno.EACCES


@pytest.fixture
def tmpfs_dir():
    """A small tmpfs mount when root, else /dev/shm."""
    if os.geteuid() == 0:
        d = tempfile.mkdtemp(prefix="umbp-tmpfs-")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", d], capture_output=True)
        if r.returncode == 0:
            yield d
            subprocess.run(["umount", d], check=False)
            os.rmdir(d)
            return
        os.rmdir(d)
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no tmpfs available")
    d = tempfile.mkdtemp(prefix="umbp-tmpfs-", dir="/dev/shm")
    yield d
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)


async def test_round_trip_on_tmpfs(tmpfs_dir):
    # tmpfs refused O_DIRECT (EINVAL) before Linux 6.6 and accepts it since: either way it works.
    f = open_data_file(os.path.join(tmpfs_dir, "seg"), create=True, size=MiB)
    eng = PosixEngine(8)
    with AlignedBuffer(8192) as src, AlignedBuffer(8192) as dst:
        src.array[:] = np.arange(8192) % 251
        assert (await eng.write_many(f.fd, [4096], [src.address], [8192])).tolist() == [8192]
        assert (await eng.read_many(f.fd, [4096], [dst.address], [8192])).tolist() == [8192]
        assert np.array_equal(src.array, dst.array)
    eng.close()
    f.close()


async def test_tmpfs_refusing_o_direct_gives_a_working_buffered_file(tmpfs_dir, monkeypatch, caplog):
    _refuse_o_direct(monkeypatch)  # what tmpfs does on kernels before 6.6
    with caplog.at_level(logging.WARNING, logger=files_mod.__name__):
        f = open_data_file(os.path.join(tmpfs_dir, "seg"), create=True, size=MiB)
    assert not f.direct
    assert sum("O_DIRECT refused" in r.getMessage() for r in caplog.records) == 1
    eng = PosixEngine(8)
    src = np.frombuffer(b"unaligned payload", dtype=np.uint8).copy()
    dst = np.zeros_like(src)
    assert (await eng.write_many(f.fd, [3], [src.ctypes.data], [src.nbytes])).tolist() == [src.nbytes]
    assert (await eng.read_many(f.fd, [3], [dst.ctypes.data], [dst.nbytes])).tolist() == [dst.nbytes]
    assert bytes(dst) == b"unaligned payload"
    eng.close()
    f.close()
