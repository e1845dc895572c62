"""The serving writer's index is mapped writable (index_room.py): its commits write into the map,
with the blocks they may write allocated ahead, so a full file system fails a commit (StoreError,
nothing committed lost) instead of killing the process with SIGBUS; a closed writer's file is as
long as its pages; where the file system cannot take it, or no room can be allocated at open, the
index is written as before."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from umbp_nvme.errors import StoreError
from umbp_nvme.store import index as index_mod
from umbp_nvme.store import index_room
from umbp_nvme.store.index import INDEX_FILE, REC_DTYPE, Index
from umbp_nvme.store.index_check import used_bytes
from umbp_nvme.store.index_room import in_place_fs
from umbp_nvme.store.layout import record_slots
from umbp_nvme.store.sync import SyncPageStore

from conftest import mount_tmpfs, small_config

MAP = 1 << 30
pytestmark = pytest.mark.skipif(in_place_fs("/tmp") is None, reason="needs /tmp on ext4, XFS or tmpfs")


def _rec(tag: int) -> bytes:
    r = np.zeros(1, REC_DTYPE)
    r["generation"], r["length"], r["depth"] = tag, 4096, -1  # the generation names the batch
    return r.tobytes()


def _puts(n: int, tag: int) -> list[tuple[bytes, bytes]]:
    # every key's value names its batch: a commit that half-landed would show
    return [(f"{i:064x}_k".encode(), _rec(tag)) for i in range(n)]


def _open(path, **kw) -> Index:
    return Index(str(path / INDEX_FILE), readonly=False, map_size=MAP, durable=False, writemap=True, **kw)


def test_a_writemap_index_allocates_ahead_and_shrinks_back_at_close(tmp_path):
    ix = _open(tmp_path)
    ix.commit(_puts(20000, 1))
    st = os.stat(ix.path)
    used = used_bytes(ix.path)
    assert st.st_size == MAP  # mapped writable: LMDB sizes the file to its map, sparse
    assert used > 20000 * 64 and st.st_blocks * 512 >= used + (1 << 20)  # its pages and room ahead
    assert st.st_blocks * 512 < MAP // 4
    assert ix.get_records([b"%064x_k" % 7]) == [_rec(1)]
    ix.close()
    assert os.path.getsize(tmp_path / INDEX_FILE) == used  # as long as its pages again
    ro = Index(str(tmp_path / INDEX_FILE), readonly=True, map_size=MAP, durable=False)
    assert ro.count() == 20000 and ro.get_records([b"%064x_k" % 19999]) == [_rec(1)]
    ro.close()


def test_no_room_fails_the_commit_and_keeps_what_was_committed(tmp_path, monkeypatch):
    ix = _open(tmp_path)
    ix.commit(_puts(100, 1))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(index_room.os, "posix_fallocate", full)
    with pytest.raises(StoreError, match="no room to grow store index"):
        ix.commit(_puts(200000, 2))  # more than the room allocated so far
    ix.commit(_puts(10, 3))  # a commit the room already holds still lands
    assert ix.count() == 100
    assert ix.get_records([b"%064x_k" % 9, b"%064x_k" % 10]) == [_rec(3), _rec(1)]
    ix.close()


def test_no_room_at_open_writes_the_index_as_before(tmp_path, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(index_room.os, "posix_fallocate", full)
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.index"):
        ix = _open(tmp_path)
    assert "not mapped writable" in caplog.text
    ix.commit(_puts(1000, 4))
    assert os.path.getsize(ix.path) < MAP  # written with pwrite: the file grows with its pages
    assert ix.count() == 1000
    ix.close()


def test_a_file_system_that_copies_on_write_is_not_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(index_mod, "in_place_fs", lambda directory: None)  # as on btrfs or NFS
    ix = _open(tmp_path)
    ix.commit(_puts(1000, 5))
    assert os.path.getsize(ix.path) < MAP
    assert ix.get_records([b"%064x_k" % 999]) == [_rec(5)]
    ix.close()


def test_a_killed_writers_map_sized_file_is_judged_by_its_pages(tmp_path):
    ix = _open(tmp_path)
    ix.commit(_puts(1000, 6))
    ix.close()
    used = used_bytes(ix.path)
    os.truncate(ix.path, MAP)  # as a writer killed while mapped leaves it
    assert used_bytes(ix.path) == used  # not the map: the background-open threshold sees the pages
    with open(ix.path, "r+b") as f:
        f.write(b"\0" * 8192)  # meta pages gone: the blocks written, not the sparse map
    assert used_bytes(ix.path) <= os.stat(ix.path).st_blocks * 512 < MAP


def test_a_store_writer_maps_its_index_and_reopens_with_every_page(tmp_path):
    cfg = small_config(ssd_capacity_bytes=8 << 20, ssd_segment_size_bytes=4 << 20)
    n = min(200, record_slots(4 << 20, 4096))
    st = SyncPageStore(str(tmp_path), cfg)
    keys = [f"p{i}" for i in range(n)]
    vals = [bytes([i % 251]) * 4096 for i in range(n)]
    assert all(st.put_many(keys, vals))
    assert os.path.getsize(tmp_path / INDEX_FILE) > used_bytes(str(tmp_path / INDEX_FILE))  # mapped
    st.close()
    st = SyncPageStore(str(tmp_path), cfg)
    bufs = [bytearray(4096) for _ in range(n)]
    assert all(st.get_many(keys, bufs)) and bufs == vals
    st.close()


_FILL = """
import sys
import numpy as np
from umbp_nvme.errors import StoreError
from umbp_nvme.store.index import REC_DTYPE, Index
rec = np.zeros(1, REC_DTYPE)
rec["length"], rec["depth"] = 4096, -1
ix = Index(sys.argv[1], readonly=False, map_size=1 << 30, durable=False, writemap=True)
n = 0
try:
    for b in range(1000):
        ix.commit([(b"%064x_k" % (b * 2000 + i), rec.tobytes()) for i in range(2000)])
        n += 2000
except StoreError as e:
    print("FULL", n, e)
ix.close()
"""


def test_a_full_file_system_fails_commits_not_the_process(tmp_path):
    mnt = str(tmp_path / "small")
    why = mount_tmpfs(mnt, "8m")
    if why:
        pytest.skip(why)
    try:
        ipath = os.path.join(mnt, INDEX_FILE)
        p = subprocess.run([sys.executable, "-c", _FILL, ipath], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, (p.returncode, p.stderr[-2000:])  # -7 would be the SIGBUS
        assert p.stdout.startswith("FULL ") and "no room to grow store index" in p.stdout, p.stdout
        n = int(p.stdout.split()[1])
        assert n >= 2000
        ro = Index(ipath, readonly=True, map_size=1 << 30, durable=False)
        assert ro.count() == n  # every commit that returned is there, the failed one is not
        ro.close()
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True)

