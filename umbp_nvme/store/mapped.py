"""Is a range a caller registers mapped readable and writable in this process (``/proc/self/maps``)?

A registered range is trusted from then on: puts checksum it and copy from it, gets copy into it,
in native code. A range that is not mapped, or not readable or writable, would kill the process
with SIGSEGV at the first put or get inside it, so ``register_memory`` does not take it (one
ERROR line, False; buffers inside it are then refused per key like any unregistered memory). It
does not raise: SGLang registers every tensor a pool exposes, and one it never hands us as
(address, nbytes) must not stop the server. /proc/self/maps is read once per registration, never
on the data path. Memory unmapped or protected after it was
registered is the caller's use-after-free and is not caught here.

State: none (/proc/self/maps).
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


def unusable_range(address, nbytes) -> str | None:
    """Why register_memory must not take the range (ints, but not memory this process may read and
    write), or None; other argument errors are left to memory.Ranges.add."""
    from .memory import ADDR_END, int_arg

    a, n = int_arg(address), int_arg(nbytes)
    if a is None or n is None or not (0 < a < ADDR_END and 0 < n < ADDR_END and a + n < ADDR_END):
        return None  # Ranges.add raises for these
    why = range_problem(a, n)
    return None if why is None else f"register_memory({a:#x}, {n}): {why}"
