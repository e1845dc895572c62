"""The IoEngine protocol: one batched submit in, one array of per-op results out.

A batch is four parallel arrays (fd, file offset, memory address, length); the fds come as
``files.Files`` (fds and their ``FileFacts``), a ``DataFile``, or bare fds (page-cache files as
far as the engine knows): what an engine knows of a file comes with it. Engines never
see keys or Python buffer objects: the caller resolves those to raw addresses and keeps the
memory alive until the awaited call returns. Results are int64 per op: the number of bytes
transferred (== length on success; less only at end of file) or ``-errno`` for a failed op.
One failed op never fails the batch.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from .files import PAGE_CACHE, FileFacts, Files, split_files

FD_DTYPE = np.int32
OFFSET_DTYPE = np.int64
ADDR_DTYPE = np.uint64
LENGTH_DTYPE = np.int64
RESULT_DTYPE = np.int64

# Hard limits at the engine edge (TigerBeetle style: a bound on everything).
MAX_OP_BYTES = 1 << 30  # one op moves at most 1 GiB (the kernel's per-buffer limit too)
MAX_BATCH_OPS = 1 << 20


class EngineClosed(RuntimeError):
    """Raised into futures still pending when an engine is closed."""


class EngineUnavailable(OSError):
    """An engine cannot be set up on this machine (no io_uring, seccomp, no CUDA...)."""


@dataclass(frozen=True)
class Capabilities:
    name: str  # "io_uring" | "posix" | "kvikio"
    native_async: bool  # completions arrive without a thread per op
    fixed_buffers: bool  # registered buffers are in use for ops inside registered ranges
    thread_safe: bool  # may be called from several event loops / threads
    queue_depth: int  # ops the engine keeps in flight at most
    device_memory: bool = False  # accepts CUDA device addresses (GDS)


@dataclass(frozen=True)
class IoBatch:
    """Validated, contiguous descriptor arrays for one submission."""

    fds: np.ndarray
    offsets: np.ndarray
    addrs: np.ndarray
    lengths: np.ndarray
    facts: FileFacts = PAGE_CACHE  # of the batch's files, as the caller handed them

    @classmethod
    def of(cls, files, offsets, addrs, lengths) -> "IoBatch":
        """``files``: ``Files``, a ``DataFile`` or bare fds (an int, or one per op)."""
        fds, facts = split_files(files)
        n = len(offsets)
        fds_a = np.ascontiguousarray(np.broadcast_to(np.asarray(fds, dtype=FD_DTYPE), (n,)))
        b = cls(
            fds_a,
            np.ascontiguousarray(offsets, dtype=OFFSET_DTYPE),
            np.ascontiguousarray(addrs, dtype=ADDR_DTYPE),
            np.ascontiguousarray(lengths, dtype=LENGTH_DTYPE),
            facts,
        )
        if not (len(b.addrs) == len(b.lengths) == n):
            raise ValueError(
                f"batch arrays differ in length: offsets={n} addrs={len(b.addrs)} lengths={len(b.lengths)}"
            )
        if n > MAX_BATCH_OPS:
            raise ValueError(f"batch of {n} ops exceeds MAX_BATCH_OPS={MAX_BATCH_OPS}")
        if n and (b.lengths.min() < 0 or b.lengths.max() > MAX_OP_BYTES):
            raise ValueError(f"op lengths must be in [0, {MAX_OP_BYTES}], got {b.lengths.min()}..{b.lengths.max()}")
        if n and b.offsets.min() < 0:
            raise ValueError(f"file offsets must be >= 0, got {b.offsets.min()}")
        return b

    def __len__(self) -> int:
        return len(self.offsets)

    def files(self, sel=slice(None)) -> Files:
        """The files of ops ``sel`` with their facts, for handing a part of the batch on."""
        return Files(self.fds[sel], self.facts)


@runtime_checkable
class IoEngine(Protocol):
    capabilities: Capabilities

    async def read_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        """Read each extent into memory; returns int64 bytes-or-negative-errno per op.
        ``files``: ``Files``, a ``DataFile``, or bare fds (see ``IoBatch.of``)."""

    async def write_many(self, files, offsets, addrs, lengths) -> np.ndarray:
        """Write each extent from memory; same result convention as read_many."""

    async def sync(self, fd: int, *, datasync: bool = True) -> None:
        """fdatasync (or fsync) one file; raises OSError on failure."""

    def register_buffers(self, ranges: list[tuple[int, int]]) -> bool:
        """Offer (address, nbytes) ranges for zero-copy fixed-buffer I/O.

        Returns True when the engine now uses them; False (logged once) when it cannot
        (ENOMEM under RLIMIT_MEMLOCK, engine without the feature). Never raises for that.
        """

    def close(self) -> None:
        """Stop the engine; pending awaits fail with EngineClosed. Idempotent."""


def errno_name(res: int) -> str:
    return errno.errorcode.get(-int(res), str(-int(res))) if res < 0 else f"short({res})"
