"""Room for LMDB's write map: the serving writer's index commits write their pages straight into
the map (``writemap``), which halves a commit of random keys (no page copies handed to pwrite at
the commit). LMDB sizes such a file to its whole map, sparse, and a page written into a hole that
the file system cannot fill kills the process with SIGBUS, where a pwrite would have failed the
commit with ENOSPC. So the blocks every commit may write are allocated ahead (``posix_fallocate``,
in steps), and a commit with no room fails as a pwrite would have. Only on file systems whose
fallocated blocks take any number of overwrites without allocating (ext4, XFS, tmpfs); on the
rest (copy-on-write btrfs and ZFS, network and overlay file systems) the index is not mapped
writable.

State: an fd of the index file and how far its blocks are allocated (per environment, index.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

import lmdb

# statfs f_type of file systems where a fallocated block is overwritten in place
_IN_PLACE = {0xEF53: "ext4", 0x58465342: "xfs", 0x01021994: "tmpfs"}
_STEP_BYTES = 64 << 20  # allocated ahead at each growth, at most: an eighth of the need, at least 1 MiB
_PAGES_PER_OP = 27  # a put or delete copies its path (depth <= 12 at 511-byte keys) and may split it
_ENTRY_BYTES = 1800  # a new entry's share of new leaf and branch pages: 3x the largest (511-byte key)
_SLACK_PAGES = 64  # meta, free-list and main-database pages of one commit


def _statfs_type(path: str) -> int | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type first
    if libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return int.from_bytes(buf.raw[: ctypes.sizeof(ctypes.c_long)], "little")


def in_place_fs(directory: str) -> str | None:
    """The name of the file system under ``directory`` when it overwrites fallocated blocks in place."""
    return _IN_PLACE.get(_statfs_type(directory))


class MapRoom:
    """The blocks of a writemap index file allocated ahead of LMDB's last page."""

    def __init__(self, path: str, ident: tuple[int, int] | None):
        self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(self._fd)
        if (st.st_dev, st.st_ino) != ident:  # not the file LMDB mapped: never allocate in another
            os.close(self._fd)
            raise OSError(errno.ESTALE, f"{path} was replaced while it was being opened")
        self._psize = 0
        self._end = 0  # bytes [0, _end) are allocated

    def ensure(self, env: lmdb.Environment, ops: int, puts: int = 0) -> None:
        """Allocate the blocks a commit of ``ops`` puts and deletes (``puts`` of them puts) may write;
        OSError (ENOSPC) when the file system has no room for them."""
        info = env.info()
        psize = self._psize = self._psize or env.stat()["psize"]
        used = info["last_pgno"] + 1
        pages = used + min(ops * _PAGES_PER_OP, used) + puts * _ENTRY_BYTES // psize + used // 256 + _SLACK_PAGES
        need = min(pages * psize, info["map_size"])  # LMDB never writes past its map
        if need <= self._end:
            return
        end = min(need + min(max(need // 8, 1 << 20), _STEP_BYTES), info["map_size"])
        try:
            os.posix_fallocate(self._fd, self._end, end - self._end)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            end = need  # the room ahead is a saving, the need is not
            os.posix_fallocate(self._fd, self._end, end - self._end)
        self._end = end

    def close(self, env: lmdb.Environment) -> None:
        """Give back the blocks past LMDB's last page once ``env`` (still open) commits no more: the
        file a closed writer leaves is as long as its pages, as without writemap. Readers map no
        page past the last one a commit named."""
        if self._fd < 0:
            return
        try:
            used = (env.info()["last_pgno"] + 1) * (self._psize or env.stat()["psize"])
            if os.fstat(self._fd).st_size > used:
                os.ftruncate(self._fd, used)
        except (OSError, lmdb.Error):  # the file keeps its room: a longer file, nothing lost
            pass
        finally:
            os.close(self._fd)
            self._fd = -1
