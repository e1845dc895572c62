"""StoreConfig: defaults -> UMBP_* environment -> extra_config, validated strictly.

The key names are UMBP's (docs/sglang.md §9), so an `extra_config` written for SGLang's
UMBP store works here unchanged, with two exceptions that are refused with a clear error:
remote modes (`master_address`, `standalone_*`) and SPDK (`ssd_backend` other than `file`,
`spdk_*`). This backend is one process writing to a local NVMe file system.

Layering: field defaults, then `UMBP_*` environment variables, then `extra_config`. Each
layer is parsed with the same rules; errors name where the value came from
(`extra_config['key']` or the environment variable), the value, and what is allowed.

A StoreConfig is frozen and checked once, when it is made (``__post_init__``): every StoreConfig
that exists is valid, so nothing downstream checks it again. Durability aliases (sync, async) are
mapped there too; ``dataclasses.replace`` makes a changed copy.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import numbers
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Callable

from .buffers import DIO_ALIGN_BYTES
from .sizes import parse_size

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

IO_BACKENDS = ("posix", "io_uring", "auto")  # auto: io_uring, falling back to posix with one warning
DURABILITY_ALIASES = {"strict": "strict", "sync": "strict", "relaxed": "relaxed", "async": "relaxed"}
SSD_BACKENDS = ("file", "spdk", "spdk_proxy")
EVICTION_POLICIES = ("lru", "prefix_aware")
ADMISSION_POLICIES = ("auto", "adaptive", "all", "second")  # store/admit_gate.py
READ_PRIORITY_CHOICES = ("on", "off")  # reads before writes: ioprio, one write slice in flight while reads run
CRC_POLICIES = ("idle", "batch", "nice", "normal")  # how a put's CRC worker lowers its CPU priority (put_crc.py)
CRC_NICE_MAX = 19  # the lowest CPU priority a nice value names
WRITE_SLICE_BYTES_MIN = 256 << 10  # ssd_write_slice_bytes: 0 (off) or in [MIN, MAX]
WRITE_SLICE_BYTES_MAX = 1 << 30
QUEUE_DEPTH_MAX = 32768  # the most SQ entries a ring takes (native/: IORING_MAX_ENTRIES)
# segments per store: the index records name a segment in 32 bits, and the open keeps a few per-segment
# arrays (2**24 segments: 16 TiB in 1 MiB segments, 4 EiB in the default 256 MiB ones)
SEGMENTS_MAX = 1 << 24
# io_timeout_s bounds: below 0.1 s a healthy drive's fdatasync under load, or one large batch, already
# outlives the bound and every operation fails; above a day the sync front's waits (4x + slack) pass
# threading.TIMEOUT_MAX and the store cannot even open. Neither is a wait for a stuck disk anyone wants.
IO_TIMEOUT_S_MIN = 0.1
IO_TIMEOUT_S_MAX = 86400.0


@dataclass(frozen=True)
class StoreConfig:
    # Names follow UMBP's extra_config keys (docs/sglang.md §9) where one exists.
    ssd_storage_dir: str = "/tmp/umbp_ssd"
    ssd_capacity_bytes: int = 32 * GiB
    ssd_segment_size_bytes: int = 256 * MiB
    ssd_queue_depth: int = 256  # io_uring SQ entries; UMBP's 4096 buys nothing on one local disk
    ssd_io_backend: str = "io_uring"  # "io_uring" | "posix"
    # Reads first (docs/tuning.md): a put batch reaches the device in slices of this many bytes
    # (0 = whole batches); "on" gives reads a higher ioprio and one write slice in flight while they run.
    ssd_write_slice_bytes: int = 8 * MiB
    ssd_read_priority: str = "on"  # "on" | "off"
    # Where a put's CRC32C runs while reads are about (store/put_crc.py): on worker threads at a lower
    # CPU priority (idle = SCHED_IDLE, batch = SCHED_BATCH at nice ssd_crc_nice, nice = nice
    # ssd_crc_nice, normal = unchanged); ssd_crc_worker=False: by batch size alone (loop / executor).
    ssd_crc_worker: bool = True
    ssd_crc_policy: str = "nice"
    ssd_crc_nice: int = 19
    ssd_durability_mode: str = "strict"  # "strict" | "relaxed" (after alias mapping)
    # Eviction starts at the high watermark and frees down to the low one: small steps near the
    # top, so the capacity configured is the capacity that caches (issue 26: 0.9 / 0.7 held ~80 %).
    ssd_high_watermark: float = 0.98
    ssd_low_watermark: float = 0.95
    eviction_policy: str = "lru"  # "lru" | "prefix_aware" (a name for lru since issue 26: store/eviction.py)
    # which new pages a put writes (store/admit_gate.py): "adaptive" | "all" | "second"; "auto" is
    # "adaptive" in the SGLang backend's store and "all" for a PageStore used directly
    admission_policy: str = "auto"
    verify_crc: bool = True
    io_timeout_s: float = 30.0  # bound on every wait for the disk; a stuck device becomes a failure
    o_direct: bool = True  # used when the file system allows it (probed once per store)
    gds_staging: bool = False  # CUDA buffers without GPUDirect Storage: stage through pinned host memory
    # Swift's mount_check: a root must lie on a mounted drive (store/mounts.py), else that drive is
    # degraded and nothing is created there; off: only the multi-drive guard applies.
    ssd_require_mount: bool = False
    extra_backend_tag: str | None = None
    # UMBP knobs kept for compatibility and stats; they change nothing in this store.
    ssd_enabled: bool = True  # UMBP's SSD-tier switch; False leaves the backend nothing to store
    dram_capacity_bytes: int = 4 * GiB  # UMBP's DRAM tier; we have none (the OS page cache is it)
    eviction_candidate_window: int = 16
    auto_promote_on_read: bool = True

    def __post_init__(self):
        if isinstance(self.ssd_storage_dir, (list, tuple)):  # several roots: kept as a JSON list
            object.__setattr__(self, "ssd_storage_dir", json.dumps(parse_roots(self.ssd_storage_dir)))
        mode = self.ssd_durability_mode
        if isinstance(mode, str) and mode.strip().lower() in DURABILITY_ALIASES:
            object.__setattr__(self, "ssd_durability_mode", DURABILITY_ALIASES[mode.strip().lower()])
        self._check()

    @property
    def storage_roots(self) -> list[str]:
        """``ssd_storage_dir`` as a list of roots (one drive each; one entry for a single path)."""
        return parse_roots(self.ssd_storage_dir)

    def validate(self) -> "StoreConfig":
        """Every StoreConfig was checked when it was made; kept for callers that call it. Returns self."""
        return self

    def _check(self) -> None:
        """Check every field and the rules between them; raise ValueError naming the fields and values."""
        if not isinstance(self.ssd_storage_dir, str) or not self.ssd_storage_dir.strip():
            raise ValueError(f"ssd_storage_dir must be a non-empty path, got {self.ssd_storage_dir!r}")
        parse_roots(self.ssd_storage_dir)  # several roots: each one a path, none twice
        for name in ("ssd_capacity_bytes", "ssd_segment_size_bytes", "ssd_queue_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.ssd_segment_size_bytes % DIO_ALIGN_BYTES:  # segments are written with O_DIRECT
            raise ValueError(
                f"ssd_segment_size_bytes must be a multiple of {DIO_ALIGN_BYTES} "
                f"(O_DIRECT alignment), got {self.ssd_segment_size_bytes}"
            )
        if self.ssd_queue_depth > QUEUE_DEPTH_MAX:
            raise ValueError(
                f"ssd_queue_depth must be at most {QUEUE_DEPTH_MAX} (the ring's limit), got {self.ssd_queue_depth}"
            )
        if self.ssd_capacity_bytes // self.ssd_segment_size_bytes > SEGMENTS_MAX:
            raise ValueError(
                f"ssd_capacity_bytes ({self.ssd_capacity_bytes}) holds more than {SEGMENTS_MAX} segments of "
                f"ssd_segment_size_bytes ({self.ssd_segment_size_bytes}); raise ssd_segment_size_bytes or lower "
                "ssd_capacity_bytes"
            )
        if self.ssd_capacity_bytes < self.ssd_segment_size_bytes:
            raise ValueError(
                f"ssd_capacity_bytes ({self.ssd_capacity_bytes}) must be at least "
                f"ssd_segment_size_bytes ({self.ssd_segment_size_bytes}): the store needs room "
                "for one segment; lower ssd_segment_size_bytes or raise ssd_capacity_bytes"
            )
        if self.ssd_io_backend not in IO_BACKENDS:
            raise ValueError(f"ssd_io_backend must be one of: {', '.join(IO_BACKENDS)}; got {self.ssd_io_backend!r}")
        slice_b = self.ssd_write_slice_bytes
        if isinstance(slice_b, bool) or not isinstance(slice_b, int) or (
            slice_b != 0 and not WRITE_SLICE_BYTES_MIN <= slice_b <= WRITE_SLICE_BYTES_MAX
        ):
            raise ValueError(
                f"ssd_write_slice_bytes must be 0 (off) or an int in [{WRITE_SLICE_BYTES_MIN}, "
                f"{WRITE_SLICE_BYTES_MAX}] bytes, got {slice_b!r}"
            )
        if self.ssd_read_priority not in READ_PRIORITY_CHOICES:
            raise ValueError(f"ssd_read_priority must be 'on' or 'off', got {self.ssd_read_priority!r}")
        if self.ssd_crc_policy not in CRC_POLICIES:
            raise ValueError(f"ssd_crc_policy must be one of: {', '.join(CRC_POLICIES)}; got {self.ssd_crc_policy!r}")
        nice = self.ssd_crc_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= CRC_NICE_MAX:
            raise ValueError(f"ssd_crc_nice must be an integer in [0, {CRC_NICE_MAX}], got {nice!r}")
        if self.ssd_durability_mode not in ("strict", "relaxed"):
            raise ValueError(f"ssd_durability_mode must be 'strict' or 'relaxed', got {self.ssd_durability_mode!r}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of: {', '.join(EVICTION_POLICIES)}; got {self.eviction_policy!r}"
            )
        if self.admission_policy not in ADMISSION_POLICIES:
            raise ValueError(
                f"admission_policy must be one of: {', '.join(ADMISSION_POLICIES)}; got {self.admission_policy!r}"
            )
        low, high = self.ssd_low_watermark, self.ssd_high_watermark
        if not (_is_real(low) and _is_real(high) and 0.0 < low < high <= 1.0):
            raise ValueError(
                f"SSD watermarks must satisfy 0 < ssd_low_watermark < ssd_high_watermark <= 1, "
                f"got ssd_low_watermark={low!r}, ssd_high_watermark={high!r}"
            )
        t = self.io_timeout_s
        if not (_is_real(t) and math.isfinite(t) and t > 0):
            raise ValueError(f"io_timeout_s must be a positive number of seconds, got {t!r}")
        if not IO_TIMEOUT_S_MIN <= t <= IO_TIMEOUT_S_MAX:
            raise ValueError(_io_timeout_range("io_timeout_s", t))


def _is_real(value: Any) -> bool:
    """An int or float, not a bool (True would pass as 1) nor a string (a TypeError in comparisons)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _io_timeout_range(label: str, value: Any) -> str:
    return (f"{label} must be between {IO_TIMEOUT_S_MIN:g} and {IO_TIMEOUT_S_MAX:g} seconds, got {value!r}: "
            "shorter fails healthy operations, longer overflows the waits built on it")


# ---------------------------------------------------------------------------------------------
# Value parsers. Each takes (value, label) where label is how the error names the source.

_TRUE_STRINGS = frozenset({"1", "true", "yes", "on"})
_FALSE_STRINGS = frozenset({"0", "false", "no", "off"})
_INT_RE = re.compile(r"^\+?\d+$")
_UNIT_RE = re.compile(r"\d\s*[kmgtpb]", re.I)


def parse_bool(value: Any, label: str) -> bool:
    """Strict boolean: bool, 0/1, or 1/true/yes/on and 0/false/no/off (any case, stripped).

    bool("false") is True, which is exactly the bug this exists to prevent.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        if value in (0, 1):
            return bool(value)
    elif isinstance(value, str):
        norm = value.strip().lower()
        if norm in _TRUE_STRINGS:
            return True
        if norm in _FALSE_STRINGS:
            return False
    raise ValueError(f"{label} must be a boolean-like value (true/false, 1/0, yes/no, on/off), got {value!r}")


def int_parser(minimum: int) -> Callable[[Any, str], int]:
    def parse(value: Any, label: str) -> int:
        parsed: int | None = None
        if isinstance(value, bool):
            parsed = None  # True is an int in Python, never a byte count
        elif isinstance(value, int):
            parsed = value
        elif isinstance(value, float) and value.is_integer():
            parsed = int(value)
        elif isinstance(value, str) and _INT_RE.match(value.strip()):
            try:
                parsed = int(value.strip())
            except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
                parsed = None
        if parsed is None:
            raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")
        if parsed < minimum:
            raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")
        return parsed

    return parse


def _size_parser(minimum: int) -> Callable[[Any, str], int]:
    """Byte counts: an int, or a string with a binary unit ('500g', '512GiB'; sizes.py)."""
    as_int = int_parser(minimum)

    def parse(value: Any, label: str) -> int:
        if not isinstance(value, str) or not _UNIT_RE.search(value):  # no unit: the integer rules and message
            return as_int(value, label)
        try:
            parsed = parse_size(value)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        if parsed < minimum:
            raise ValueError(f"{label} must be at least {minimum} bytes, got {value!r}")
        return parsed

    return parse


def _parse_float(value: Any, label: str) -> float:
    parsed: float | None = None
    if isinstance(value, bool):
        parsed = None
    elif isinstance(value, (int, float)):
        parsed = float(value)
    elif isinstance(value, str):
        try:
            parsed = float(value.strip())
        except ValueError:
            parsed = None
    if parsed is None or not math.isfinite(parsed):
        raise ValueError(f"{label} must be a finite number, got {value!r}")
    return parsed


def _parse_positive_float(value: Any, label: str) -> float:
    parsed = _parse_float(value, label)
    if parsed <= 0:
        raise ValueError(f"{label} must be a positive number, got {value!r}")
    return parsed


def _parse_io_timeout(value: Any, label: str) -> float:
    parsed = _parse_positive_float(value, label)
    if not IO_TIMEOUT_S_MIN <= parsed <= IO_TIMEOUT_S_MAX:
        raise ValueError(_io_timeout_range(label, value))
    return parsed


def _parse_dir(value: Any, label: str) -> str:
    """One root, or several (a list, a JSON list, a comma-separated string; see parse_roots).

    Several roots are kept as given when a string, and as a JSON list when a list.
    """
    if isinstance(value, (list, tuple)):
        try:
            return json.dumps([os.path.expanduser(r) for r in parse_roots(value)])
        except ValueError as e:
            raise ValueError(f"{label}: {e}, got {value!r}") from None
    if not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)).strip():
        raise ValueError(f"{label} must be a non-empty directory path, got {value!r}")
    try:
        roots = parse_roots(os.fspath(value))
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    if any(r.startswith("~") for r in roots):  # no shell expands a path inside JSON
        roots = [os.path.expanduser(r) for r in roots]
        return roots[0] if len(roots) == 1 else json.dumps(roots)
    return os.fspath(value)


def parse_roots(value) -> list[str]:
    """``ssd_storage_dir`` as a list of roots: a list/tuple, a JSON list, or a comma-separated string.

    A single path is a one-element list. A path that itself contains a comma must be given as a
    JSON list. Raises ValueError for an empty list, an empty entry or a duplicate root.
    """
    if isinstance(value, (list, tuple)):
        roots = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
    else:
        text = os.fspath(value) if isinstance(value, os.PathLike) else value
        if not isinstance(text, str):
            raise ValueError(f"ssd_storage_dir must be a path or a list of paths, got {value!r}")
        s = text.strip()
        if s.startswith("["):
            try:
                roots = json.loads(s)
            except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
                raise ValueError(f"ssd_storage_dir looks like a JSON list but is not one ({e}): {text[:200]!r}") from None
            if not isinstance(roots, list):
                raise ValueError(f"ssd_storage_dir JSON must be a list of paths, got {text!r}")
        elif "," in s and not os.path.isdir(text):  # an existing directory with a comma is one root
            roots = [p.strip() for p in s.split(",")]
        else:
            roots = [text]
    if not roots:
        raise ValueError("ssd_storage_dir lists no directory")
    for r in roots:
        if not isinstance(r, str) or not r.strip():
            raise ValueError(f"ssd_storage_dir entries must be non-empty paths, got {r!r} in {value!r}")
    seen = set()
    for r in roots:
        a = os.path.abspath(r)
        if a in seen:
            raise ValueError(f"ssd_storage_dir lists {r!r} twice")
        seen.add(a)
    return list(roots)


def _parse_io_backend(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in IO_BACKENDS:
        # The text up to ';' is UMBP's message, so logs and tests written for it still match.
        raise ValueError(f"{label} must be one of: posix, io_uring; got {value!r} (umbp_nvme also takes 'auto')")
    return norm


def _parse_durability(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in DURABILITY_ALIASES:
        raise ValueError(f"{label} must be one of: strict, sync, relaxed, async; got {value!r}")
    return DURABILITY_ALIASES[norm]


def _parse_ssd_backend(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in SSD_BACKENDS:
        raise ValueError(f"{label} must be one of: file, spdk, spdk_proxy; got {value!r}")
    if norm != "file":
        raise ValueError(
            f"{label} is {value!r}, but umbp_nvme is a local-NVMe backend that stores pages in "
            "files on a mounted file system; SPDK is not supported. Remove the key or set it to "
            "'file', and drop any spdk_* keys."
        )
    return norm


def _parse_eviction_policy(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in EVICTION_POLICIES:
        raise ValueError(f"{label} must be one of: lru, prefix_aware; got {value!r}")
    return norm


def _parse_admission_policy(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in ADMISSION_POLICIES:
        raise ValueError(f"{label} must be one of: {', '.join(ADMISSION_POLICIES)}; got {value!r}")
    return norm


def _warn_kv_events(value: Any, label: str) -> Any:
    if value:
        logger.warning("umbp_nvme: %s is set, but this backend subscribes to no KV events; ignored "
                       "(kv_events_endpoint publishes this store's DISK events: docs/fleet.md).", label)  # fmt: skip
    return value


def _parse_crc_policy(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in CRC_POLICIES:
        raise ValueError(f"{label} must be one of: {', '.join(CRC_POLICIES)}; got {value!r}")
    return norm


def _parse_on_off(value: Any, label: str) -> str:
    return "on" if parse_bool(value, label) else "off"


def _parse_tag(value: Any, label: str) -> str | None:
    return None if value is None else str(value)


# ---------------------------------------------------------------------------------------------
# Key tables.

# extra_config key -> (StoreConfig field or None when accepted and ignored, parser)
_FIELD_KEYS: dict[str, tuple[str | None, Callable[[Any, str], Any]]] = {
    "ssd_storage_dir": ("ssd_storage_dir", _parse_dir),
    "ssd_capacity_bytes": ("ssd_capacity_bytes", _size_parser(1)),
    "ssd_segment_size_bytes": ("ssd_segment_size_bytes", _size_parser(1)),
    "ssd_queue_depth": ("ssd_queue_depth", int_parser(1)),
    "ssd_io_backend": ("ssd_io_backend", _parse_io_backend),
    "ssd_write_slice_bytes": ("ssd_write_slice_bytes", _size_parser(0)),
    "ssd_read_priority": ("ssd_read_priority", _parse_on_off),
    "ssd_crc_worker": ("ssd_crc_worker", parse_bool),
    "ssd_crc_policy": ("ssd_crc_policy", _parse_crc_policy),
    "ssd_crc_nice": ("ssd_crc_nice", int_parser(0)),
    "ssd_durability_mode": ("ssd_durability_mode", _parse_durability),
    "ssd_high_watermark": ("ssd_high_watermark", _parse_float),
    "ssd_low_watermark": ("ssd_low_watermark", _parse_float),
    "eviction_policy": ("eviction_policy", _parse_eviction_policy),
    "admission_policy": ("admission_policy", _parse_admission_policy),
    "verify_crc": ("verify_crc", parse_bool),
    "io_timeout_s": ("io_timeout_s", _parse_io_timeout),
    "o_direct": ("o_direct", parse_bool),
    "gds_staging": ("gds_staging", parse_bool),
    "ssd_require_mount": ("ssd_require_mount", parse_bool),
    "extra_backend_tag": ("extra_backend_tag", _parse_tag),
    "ssd_enabled": ("ssd_enabled", parse_bool),
    "dram_capacity_bytes": ("dram_capacity_bytes", _size_parser(0)),
    "eviction_candidate_window": ("eviction_candidate_window", int_parser(0)),
    "auto_promote_on_read": ("auto_promote_on_read", parse_bool),
    # Accepted, type-checked, and ignored: UMBP's DRAM->SSD copy pipeline and RDMA registration.
    "ssd_backend": (None, _parse_ssd_backend),
    "ssd_copy_async": (None, parse_bool),
    "ssd_copy_queue_depth": (None, int_parser(0)),
    "ssd_copy_worker_threads": (None, int_parser(0)),
    "ssd_copy_batch_max_ops": (None, int_parser(0)),
    "disable_zero_copy_register": (None, parse_bool),
    "kv_events_subscriber": (None, _warn_kv_events),
    "kv_events_endpoint": (None, lambda v, label: v),
    "kv_events_topic": (None, lambda v, label: v),
}

# Keys SGLang's dynamic loader and controller put in the same dict; accepted silently.
LOADER_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        # SGLang pops these before the backend sees the dict; harmless if a version does not.
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)

# UMBP keys that only mean something in its distributed mode; ignored with a warning.
DISTRIBUTED_ONLY_KEYS = frozenset(
    {
        "node_address",
        "node_id",
        "node_tags",
        "tags",
        "auto_heartbeat",
        "io_engine_host",
        "io_engine_port",
        "staging_buffer_size",
        "ranged_scratch_size",
        "ssd_staging_buffer_size",
        "ssd_staging_buffer_slots",
        "peer_service_port",
        "cache_remote_fetches",
        "dram_page_size",
    }
)

_REMOTE_KEYS = ("master_address", "standalone_address")


def _is_remote_key(key: str) -> bool:
    return key in _REMOTE_KEYS or key.startswith("standalone_") or key.startswith("spdk_")


def _refuse_remote(label: str, value: Any) -> None:
    if label.startswith("extra_config['spdk") or label.startswith("UMBP_SPDK"):
        what = "SPDK"
    else:
        what = "UMBP's remote (master / standalone-process) modes"
    raise ValueError(
        f"{label}={value!r} selects {what}, but umbp_nvme is a local-NVMe backend: each "
        "process stores its pages in files under ssd_storage_dir. Remove this key "
        "(and any other master_address / standalone_* / spdk_* keys) from the config."
    )


# Environment variable -> extra_config key. UMBP's names (mori runtime-env-vars.md) first, then ours.
ENV_KEYS: dict[str, str] = {
    "UMBP_SSD_DIR": "ssd_storage_dir",
    "UMBP_SSD_CAPACITY": "ssd_capacity_bytes",
    "UMBP_SSD_ENABLED": "ssd_enabled",
    "UMBP_SSD_HIGH_WM": "ssd_high_watermark",
    "UMBP_SSD_LOW_WM": "ssd_low_watermark",
    "UMBP_EVICTION_POLICY": "eviction_policy",
    "UMBP_DRAM_CAPACITY": "dram_capacity_bytes",
    "UMBP_SSD_BACKEND": "ssd_backend",
    "UMBP_DISABLE_ZERO_COPY_REGISTER": "disable_zero_copy_register",
    "UMBP_SSD_SEGMENT_SIZE": "ssd_segment_size_bytes",
    "UMBP_SSD_IO_BACKEND": "ssd_io_backend",
    "UMBP_SSD_DURABILITY": "ssd_durability_mode",
    "UMBP_VERIFY_CRC": "verify_crc",
    "UMBP_SSD_QUEUE_DEPTH": "ssd_queue_depth",
    "UMBP_IO_TIMEOUT_S": "io_timeout_s",
    "UMBP_O_DIRECT": "o_direct",
    "UMBP_GDS_STAGING": "gds_staging",
    "UMBP_SSD_WRITE_SLICE_BYTES": "ssd_write_slice_bytes",
    "UMBP_SSD_READ_PRIORITY": "ssd_read_priority",
    "UMBP_SSD_REQUIRE_MOUNT": "ssd_require_mount",
    "UMBP_ADMISSION_POLICY": "admission_policy",
    "UMBP_SSD_CRC_WORKER": "ssd_crc_worker",
    "UMBP_SSD_CRC_POLICY": "ssd_crc_policy",
    "UMBP_SSD_CRC_NICE": "ssd_crc_nice",
}

# Environment variables that select a remote mode or SPDK in UMBP.
_REMOTE_ENV = ("UMBP_MASTER_ADDRESS", "UMBP_STANDALONE_ADDRESS", "UMBP_SPDK_NVME_PCI")


def load_config(extra_config: Mapping | None = None, env: Mapping[str, str] | None = None, *,
                known: Iterable[str] = ()) -> StoreConfig:
    """Build and validate a StoreConfig: defaults, then `UMBP_*` from `env`, then `extra_config`.

    `env` defaults to os.environ. Unknown extra_config keys log one warning each (with the
    closest known key, ``known`` included: keys the caller took out itself) and are ignored;
    SGLang's loader keys are accepted silently; remote and SPDK keys raise. Byte counts take
    binary units ('500g', '512GiB').
    """
    env = os.environ if env is None else env
    extra = dict(extra_config or {})
    values: dict[str, Any] = {}  # field -> parsed value; the config is made (and checked) once, at the end
    valid_fields = {f.name for f in fields(StoreConfig)}

    for var in _REMOTE_ENV:
        value = env.get(var)
        if value is not None and value.strip():
            _refuse_remote(var, value)
    for var, key in ENV_KEYS.items():
        raw = env.get(var)
        if raw is None or raw == "":  # unset or empty means "use the default", as in mori
            continue
        field, parse = _FIELD_KEYS[key]
        parsed = parse(raw, var)
        if field is not None:
            values[field] = parsed

    for key, value in extra.items():
        label = f"extra_config[{key!r}]"
        if not isinstance(key, str):
            raise ValueError(f"{label}: extra_config keys must be strings, got {type(key).__name__} {key!r:.60}")
        if key in LOADER_KEYS:
            continue
        if _is_remote_key(key):
            if value is None or value == "":  # UMBP treats an empty address as "not set"
                continue
            _refuse_remote(label, value)
        if key in _FIELD_KEYS:
            field, parse = _FIELD_KEYS[key]
            parsed = parse(value, label)
            if field is not None:
                assert field in valid_fields
                values[field] = parsed
        elif key in DISTRIBUTED_ONLY_KEYS:
            logger.warning(
                "umbp_nvme: extra_config[%r] only applies to UMBP's distributed mode and is ignored "
                "by this local-NVMe backend.",
                key,
            )
        else:
            close = difflib.get_close_matches(key, [*_FIELD_KEYS, *DISTRIBUTED_ONLY_KEYS, *known], n=1, cutoff=0.7)
            logger.warning(
                "umbp_nvme: unknown extra_config key %r is ignored. %s",
                key,
                f"Did you mean {close[0]!r}?" if close else
                "Known keys are UMBP's (ssd_storage_dir, ssd_capacity_bytes, ssd_io_backend, ...; docs/sglang.md §9).",
            )
    return StoreConfig(**values)
