"""A RAM-backed block device for benchmarks: tmpfs file -> loop device -> ext4 -> mount.

On it the device is not the bottleneck (memory copies at several GB/s), so what a benchmark
measures there is the software's cost per object: the store against the raw engine, NIXL and fio
on the same file system. Root only (mount, losetup). Everything set up is torn down in reverse
order when the ``with`` block ends, by an exception or Ctrl-C too; SIGTERM is turned into the same
unwinding while the device exists. A step that fails to tear down is reported with what is left
and the command that removes it, never silently left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile

TOOLS = ("mount", "umount", "losetup", "mkfs.ext4")
TMPFS_SLACK_BYTES = 64 << 20  # the tmpfs is a little larger than its one file


class RamDeviceError(RuntimeError):
    """The RAM device cannot be set up here (the message says why and what to do)."""


def why_not() -> str | None:
    """Why a RAM device cannot be set up on this machine, or None."""
    if os.geteuid() != 0:
        return ("--device ram needs root: it mounts a tmpfs, attaches a loop device (losetup) and mounts "
                "ext4 on it; run it as root (sudo), or give --dir on a real drive instead")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"--device ram needs {', '.join(missing)} on PATH (util-linux, e2fsprogs)"
    return None


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RamDeviceError(f"{' '.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p.stdout.strip()


class RamDevice:
    """``with RamDevice(nbytes) as dev:`` -> ``dev.mount`` is an empty ext4 directory on RAM.

    ``nbytes``: the file system's size (taken from RAM only as it is written)."""

    def __init__(self, nbytes: int):
        if nbytes < (64 << 20):
            raise ValueError(f"RAM device of {nbytes} bytes; at least 64 MiB")
        self.nbytes = int(nbytes)
        self.base = self.tmpfs = self.mount = self.loop = None
        self._undo: list[tuple[str, list[str]]] = []  # (what, command) in set-up order
        self._old_term = None

    def __enter__(self) -> "RamDevice":
        why = why_not()
        if why:
            raise RamDeviceError(why)
        self._old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _setup(self) -> None:
        self.base = tempfile.mkdtemp(prefix="umbp-ramdev-")
        self.tmpfs, self.mount = os.path.join(self.base, "tmpfs"), os.path.join(self.base, "mnt")
        os.mkdir(self.tmpfs)
        os.mkdir(self.mount)
        _run(["mount", "-t", "tmpfs", "-o", f"size={self.nbytes + TMPFS_SLACK_BYTES}", "tmpfs", self.tmpfs])
        self._undo.append(("tmpfs", ["umount", self.tmpfs]))
        image = os.path.join(self.tmpfs, "disk.img")
        with open(image, "wb") as f:
            f.truncate(self.nbytes)
        self.loop = _run(["losetup", "--find", "--show", image])
        self._undo.append(("loop device", ["losetup", "-d", self.loop]))
        # lazy init off: no background thread zeroing tables while we measure
        _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", self.loop])
        _run(["mount", self.loop, self.mount])
        self._undo.append(("ext4 mount", ["umount", self.mount]))

    def close(self) -> None:
        """Undo every step taken, last first; raise RamDeviceError naming what is left, if any."""
        left = []
        while self._undo:
            what, cmd = self._undo.pop()
            try:
                _run(cmd)
            except RamDeviceError as e:
                if cmd[0] == "umount":  # a file still open in it (a crashed run): detach it lazily
                    try:
                        _run(["umount", "-l", cmd[1]])
                        continue
                    except RamDeviceError:
                        pass
                left.append(f"{what} ({e}; remove it with: {' '.join(cmd)})")
        if self.base and not left:
            shutil.rmtree(self.base, ignore_errors=True)
            self.base = None
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None
        if left:
            raise RamDeviceError("RAM device not fully torn down: " + "; ".join(left))


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
