"""Names and places shared by the multi-drive tests: drive roots under a tmp dir, K/V page keys,
and a drive made unopenable (parked) and brought back."""

from __future__ import annotations

import os


def drive_roots(tmp_path, n: int) -> list[str]:
    """``n`` drives' store directories, each one level below its own "drive" directory."""
    return [str(tmp_path / f"drive{i}" / "store") for i in range(n)]


def page_keys(pages: int, tag: str = "p") -> list[str]:
    """Two objects (K and V) per page, rank 0."""
    return [f"{tag}{i:04d}_0_{c}" for i in range(pages) for c in "kv"]


def park_drive(root: str, parked: str) -> None:
    """The drive cannot open (its directory moved away, a file in its place)."""
    os.rename(os.path.dirname(root), parked)
    open(os.path.dirname(root), "w").close()


def unpark_drive(root: str, parked: str) -> None:
    os.unlink(os.path.dirname(root))
    os.rename(parked, os.path.dirname(root))
