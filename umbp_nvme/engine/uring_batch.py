"""One batch of the io_uring engine (engine/uring.py): its descriptor arrays, per-op results
(``done``: bytes so far, or -errno once failed), the files' facts it was handed, and the
decisions taken per op on the completion path (may a short op continue, which ops still run).

``user_data`` of op i = (slot << SLOT_SHIFT) | i, so a completion scatters straight into
``done`` (native reap_batches)."""

from __future__ import annotations

import logging

import numpy as np

from .base import ADDR_DTYPE, RESULT_DTYPE
from .files import FileFacts

log = logging.getLogger(__name__)

SLOT_SHIFT = 32


class Batch:
    __slots__ = (
        "op", "n", "fds", "facts", "offs", "addrs", "lens", "done", "next", "left", "fut", "slot",
        "idx_map", "n_total", "abandoned", "drained", "retries", "crc", "arbiter",
    )  # fmt: skip

    def __init__(self, op, slot, fds, facts: FileFacts, offs, addrs, lens, fut, idx_map, n_total, n=None):
        self.op = op
        self.slot = slot
        self.fds, self.offs, self.addrs, self.lens = fds, offs, addrs, lens  # fds: int or int32[]
        self.facts = facts  # of the batch's files, as the caller handed them (files.Files)
        self.n = len(lens) if n is None else n
        self.done = np.zeros(self.n, dtype=RESULT_DTYPE)  # bytes so far, or -errno once failed
        self.next = 0  # first op not yet submitted
        self.left = self.n  # ops without a final result
        self.fut = fut
        self.idx_map = idx_map  # compact index -> caller index, when zero-length ops were dropped
        self.n_total = n_total
        self.abandoned = False
        self.drained = None  # future set when left reaches 0 after a cancelled await
        self.retries = None  # {op index: count}, only on the rare retry path
        self.crc = None  # (crc_lens, crc_out) int64: CRCs the native reap computes as ops finish
        self.arbiter = None  # told a read is in flight until finish_read returns (start_read_crc)

    def results(self) -> np.ndarray:
        if self.idx_map is None:
            return self.done
        out = np.zeros(self.n_total, dtype=RESULT_DTYPE)
        out[self.idx_map] = self.done
        return out

    def fd(self, i: int) -> int:
        f = self.fds
        return f if type(f) is int else int(f[0] if len(f) == 1 else f[i])

    def fds_slice(self, s: int, e: int):
        f = self.fds
        return f if type(f) is int or len(f) == 1 else f[s:e]

    def remainder(self, i: int, d: int):
        """(offsets, addrs, lengths) of op i's last len - d bytes, as 1-op arrays for ring.submit."""
        return (
            np.array([self.offs[i] + d], dtype=np.int64),
            np.array([int(self.addrs[i]) + d], dtype=ADDR_DTYPE),
            np.array([self.lens[i] - d], dtype=np.int64),
        )

    def final(self, i: int, value: int) -> None:
        """Final result of op i: bytes moved, or -errno."""
        self.done[i] = value
        self.left -= 1

    def fail_from(self, s: int, err: int) -> None:
        """Final result -err for ops s.. (none of them submitted)."""
        self.done[s:] = -err
        self.left -= self.n - s
        self.next = self.n

    def running_user_data(self):
        """user_data of the submitted ops not yet complete (uint64[]), or None when there are none."""
        k = self.next
        d = self.done[:k]
        running = np.flatnonzero((d >= 0) & (d < np.asarray(self.lens[:k])))
        if not len(running):
            return None
        return (np.uint64(self.slot) << np.uint64(SLOT_SHIFT)) | running.astype(np.uint64)

    def cancel_running(self, ring) -> None:
        """Best-effort IORING_OP_ASYNC_CANCEL for the submitted ops not yet complete."""
        ud = self.running_user_data()
        if ud is None:
            return
        try:
            ring.cancel(ud)
        except Exception as e:  # noqa: BLE001 - cancelling is an optimisation; the wait is what matters
            log.debug("io_uring: cancel of %d ops failed: %s", len(ud), e)

    def may_continue(self, i: int, done: int) -> bool:
        """A remainder that starts unaligned on an O_DIRECT file would be refused: stop there.

        Decided from the facts the batch's files came with, never a syscall. A batch with a
        page-cache file (or bare fds) takes any remainder: if op i's file is O_DIRECT after all,
        the kernel refuses the remainder with EINVAL and the op keeps the bytes it moved."""
        f = self.facts
        return f.buffered or (
            (int(self.offs[i]) + done) % f.off_align == 0 and (int(self.addrs[i]) + done) % f.mem_align == 0
        )
