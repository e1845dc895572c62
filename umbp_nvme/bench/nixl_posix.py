"""NVIDIA NIXL's POSIX plugin as a baseline on the store's own extents (optional: `pip install nixl`).

The issue's peer figures came from NIXL's POSIX backend moving 256-object batches between DRAM
and O_DIRECT segment files. This runs the same transfers in the same process as the store rows,
so anyone with `nixl` installed can reproduce the ratios. A batch is one transfer request made
from the batch's descriptors (as a caller with a new page list each time would), posted, then
polled: every 100 us, so the poll does not bill NIXL for a spinning core it would not need.
"""

from __future__ import annotations

import importlib
import time

import numpy as np

POLL_S = 100e-6


def load_error() -> str | None:
    """Why NIXL cannot run here, or None."""
    try:
        importlib.import_module("nixl._api")
    except Exception as e:  # ImportError, or a missing shared library of the wheel
        return f"{type(e).__name__}: {e}"
    return None


class NixlPosix:
    """One NIXL agent with the POSIX backend; DRAM ranges and segment files registered once."""

    def __init__(self) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = "umbp-nvme-bench"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
        self.agent.create_backend("POSIX", {})
        self._files: set[int] = set()

    def register_dram(self, address: int, nbytes: int) -> None:
        self.agent.register_memory([(int(address), int(nbytes), 0, "")], "DRAM", backends=["POSIX"])

    def register_files(self, fds, file_bytes: int) -> None:
        new = [int(fd) for fd in np.unique(np.asarray(fds)).tolist() if int(fd) not in self._files]
        if new:
            self.agent.register_memory([(0, int(file_bytes), fd, "") for fd in new], "FILE", backends=["POSIX"])
            self._files.update(new)

    def _transfer(self, op: str, fds, offs, addrs, lens) -> None:
        n = len(lens)
        dram = np.stack([np.asarray(addrs, np.uint64), np.asarray(lens, np.uint64), np.zeros(n, np.uint64)], 1)
        files = np.stack([np.asarray(offs, np.uint64), np.asarray(lens, np.uint64), np.asarray(fds, np.uint64)], 1)
        local = self.agent.get_xfer_descs(dram, "DRAM")
        remote = self.agent.get_xfer_descs(files, "FILE")
        handle = self.agent.initialize_xfer(op, local, remote, self.name, backends=["POSIX"])
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                time.sleep(POLL_S)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL POSIX {op} of {n} ops ended {state}")
        finally:
            handle.release()

    def read_many(self, fds, offs, addrs, lens) -> None:
        self._transfer("READ", fds, offs, addrs, lens)

    def write_many(self, fds, offs, addrs, lens) -> None:
        self._transfer("WRITE", fds, offs, addrs, lens)
