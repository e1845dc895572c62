"""StoreConfig: defaults -> UMBP_* environment -> extra_config, validated strictly."""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class StoreConfig:
    # Names follow UMBP's extra_config keys (sglang-interface.md §6.11) where one exists.
    ssd_storage_dir: str = "/tmp/umbp_ssd"
    ssd_capacity_bytes: int = 32 * GiB
    ssd_segment_size_bytes: int = 256 * MiB
    ssd_queue_depth: int = 256  # io_uring SQ entries; UMBP's 4096 buys nothing on one local disk
    ssd_io_backend: str = "io_uring"  # "io_uring" | "posix"
    ssd_durability_mode: str = "strict"  # "strict" | "relaxed" (after alias mapping)
    ssd_high_watermark: float = 0.9
    ssd_low_watermark: float = 0.7
    eviction_policy: str = "lru"  # "lru" | "prefix_aware"
    verify_crc: bool = True
    io_timeout_s: float = 30.0  # bound on every wait for the disk; a stuck device becomes a failure
    o_direct: bool = True  # used when the file system allows it (probed once per store)
    extra_backend_tag: str | None = None
