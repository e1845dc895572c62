"""Shared store-test fixtures."""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from umbp_nvme.config import StoreConfig  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


def small_config(**kw) -> StoreConfig:
    base = dict(
        ssd_capacity_bytes=16 * MiB,
        ssd_segment_size_bytes=1 * MiB,
        ssd_durability_mode="relaxed",
        ssd_io_backend="auto",
        ssd_queue_depth=64,
        io_timeout_s=20.0,
    )
    base.update(kw)
    return StoreConfig(**base)


def payload(key: str, nbytes: int) -> np.ndarray:
    """Deterministic bytes per key, so any mix-up between keys shows."""
    seed = int.from_bytes(hashlib.blake2b(f"{key}/{nbytes}".encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def store_dir(tmp_path):
    return str(tmp_path / "store")
