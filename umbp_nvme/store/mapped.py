"""Is a range a caller registers mapped readable and writable in this process (``/proc/self/maps``)?

A registered range is trusted from then on: puts checksum it and copy from it, gets copy into it,
in native code. A range that is not mapped, or not readable or writable, would kill the process
with SIGSEGV at the first put or get inside it, so ``register_memory`` refuses it up front (read
once per registration, never on the data path). Memory unmapped or protected after it was
registered is the caller's use-after-free and is not caught here.
"""

from __future__ import annotations


def range_problem(address: int, nbytes: int, maps_path: str = "/proc/self/maps") -> str | None:
    """Why [address, address + nbytes) cannot be registered, or None. Without procfs the range is
    trusted as before."""
    end = address + nbytes
    try:
        with open(maps_path, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    spans = []
    for line in lines:
        parts = line.split(None, 2)
        if len(parts) < 2 or "-" not in parts[0]:
            continue
        try:
            lo, hi = (int(x, 16) for x in parts[0].split("-", 1))
        except ValueError:
            continue
        if hi > address and lo < end:
            spans.append((lo, hi, parts[1]))
    spans.sort()
    at = address
    for lo, hi, perms in spans:
        if lo > at:
            break
        if "r" not in perms or "w" not in perms:
            return f"bytes from {at:#x} are mapped without read and write access ({perms[:3]})"
        at = max(at, hi)
        if at >= end:
            return None
    return f"bytes from {at:#x} to {end:#x} are not mapped in this process"


def check_registrable(address, nbytes) -> None:
    """Raise ValueError naming the range when it is ints but not usable memory (register_memory;
    other argument errors are left to memory.Ranges.add)."""
    from .memory import int_arg

    a, n = int_arg(address), int_arg(nbytes)
    if a is None or n is None or a <= 0 or n <= 0:
        return
    why = range_problem(a, n)
    if why is not None:
        raise ValueError(f"register_memory({a:#x}, {n}): {why}; register memory the process owns and may write")
