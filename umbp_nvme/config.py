"""StoreConfig: defaults -> UMBP_* environment -> extra_config, validated strictly.

The key names are UMBP's (docs/sglang.md §9), so an `extra_config` written for SGLang's
UMBP store works here unchanged, with two exceptions that are refused with a clear error:
remote modes (`master_address`, `standalone_*`) and SPDK (`ssd_backend` other than `file`,
`spdk_*`). This backend is one process writing to a local NVMe file system.

Layering: field defaults, then `UMBP_*` environment variables, then `extra_config`. Each
layer is parsed with the same rules (config_values.py); errors name where the value came from
(`extra_config['key']` or the environment variable), the value, and what is allowed.

Every field says what it means, its unit and how its value is read (``described(...)`` metadata): the
key table in docs/sglang.md §9 is generated from it (config_doc.py), and a field without them
cannot be made. A StoreConfig is frozen and checked once, when it is made (``__post_init__``):
every StoreConfig that exists is valid, so nothing downstream checks it again. Durability aliases
(sync, async) are mapped there too; ``dataclasses.replace`` makes a changed copy.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .buffers import DIO_ALIGN_BYTES
from .config_values import (  # noqa: F401 - the choices and parsers are also named through this module
    ADMISSION_POLICIES, CRC_NICE_MAX, CRC_POLICIES, DURABILITY_ALIASES, EVICTION_POLICIES, IO_BACKENDS,
    IO_TIMEOUT_S_MAX, IO_TIMEOUT_S_MIN, READ_PRIORITY_CHOICES, SSD_BACKENDS, int_parser, io_timeout_range,
    is_real, parse_admission_policy, parse_bool, parse_crc_policy, parse_dir, parse_durability,
    parse_eviction_policy, parse_float, parse_io_backend, parse_io_timeout, parse_on_off, parse_roots,
    parse_ssd_backend, parse_tag, size_parser, warn_kv_events,
)

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

WRITE_SLICE_BYTES_MIN = 256 << 10  # ssd_write_slice_bytes: 0 (off) or in [MIN, MAX]
WRITE_SLICE_BYTES_MAX = 1 << 30
QUEUE_DEPTH_MAX = 32768  # the most SQ entries a ring takes (native/: IORING_MAX_ENTRIES)
# segments per store: the index records name a segment in 32 bits, and the open keeps a few per-segment
# arrays (2**24 segments: 16 TiB in 1 MiB segments, 4 EiB in the default 256 MiB ones)
SEGMENTS_MAX = 1 << 24
DEFAULT_STORAGE_DIR = "/tmp/umbp_ssd"  # UMBP's; the SGLang backend warns when a server runs with it


def described(parse: Callable[[Any, str], Any], unit: str, meaning: str, choices: Iterable[str] = ()) -> dict:
    """A field's metadata: how its extra_config / env value is read, its unit ("" for none) and
    what it means, as the key table says (config_doc.py)."""
    return {"parse": parse, "unit": unit, "meaning": meaning, "choices": tuple(choices)}


def _f(default, parse, unit: str, meaning: str, choices: Iterable[str] = ()):
    return field(default=default, metadata=described(parse, unit, meaning, choices))


@dataclass(frozen=True)
class StoreConfig:
    # Names follow UMBP's extra_config keys (docs/sglang.md §9) where one exists.
    ssd_storage_dir: str = _f(DEFAULT_STORAGE_DIR, parse_dir, "path",
        "The store's directory; several drives: a JSON list or comma-separated roots, one per drive. "
        "The SGLang backend opens one subdirectory per rank under it (§8). `~` is the home directory.")
    ssd_capacity_bytes: int = _f(32 * GiB, size_parser(1), "bytes",
        "Disk space one store directory uses: **per rank** (each tensor-parallel rank has its own "
        "directory, an MLA model's ranks share one; §8), split evenly over the drives of a list. A node "
        "needs it times its rank directories; the backend warns at open when they exceed the file system.")
    ssd_segment_size_bytes: int = _f(256 * MiB, size_parser(1), "bytes",
        "Size of each segment file (a multiple of 4 KiB); an object must fit in one. An existing store "
        "keeps its own.")
    ssd_queue_depth: int = _f(256, int_parser(1), "entries",
        "io_uring submission-queue entries per engine (UMBP's 4096 buys nothing on one local drive).")
    ssd_io_backend: str = _f("io_uring", parse_io_backend, "",
        "How the store talks to the drive: io_uring, posix (thread pools), or auto (io_uring, else posix "
        "with one warning).", IO_BACKENDS)
    # Reads first (docs/tuning.md): a put batch reaches the device in slices of this many bytes
    # (0 = whole batches); "on" gives reads a higher ioprio and one write slice in flight while they run.
    ssd_write_slice_bytes: int = _f(8 * MiB, size_parser(0), "bytes",
        "A put batch reaches the drive in slices of this size, so reads never queue behind a whole "
        "batch; 0: whole batches (docs/tuning.md).")
    ssd_read_priority: str = _f("on", parse_on_off, "",
        "on: reads get a higher I/O priority, and one write slice is in flight while reads run.",
        READ_PRIORITY_CHOICES)
    # Where a put's CRC32C runs while reads are about (store/put_crc.py): on worker threads at a lower
    # CPU priority (idle = SCHED_IDLE, batch = SCHED_BATCH at nice ssd_crc_nice, nice = nice
    # ssd_crc_nice, normal = unchanged); ssd_crc_worker=False: by batch size alone (loop / executor).
    ssd_crc_worker: bool = _f(True, parse_bool, "",
        "A put's CRC32C runs on low-priority worker threads while reads are about; false: by batch "
        "size alone.")
    ssd_crc_policy: str = _f("nice", parse_crc_policy, "",
        "How those workers lower their CPU priority: idle (SCHED_IDLE), batch (SCHED_BATCH), nice, normal.",
        CRC_POLICIES)
    ssd_crc_nice: int = _f(19, int_parser(0), "nice value",
        f"The workers' nice value (0-{CRC_NICE_MAX}) for the batch and nice policies.")
    ssd_durability_mode: str = _f("strict", parse_durability, "",
        "strict (alias sync): an acknowledged page survives a power loss (fdatasync before True); "
        "relaxed (alias async): it survives a process crash.", ("strict", "relaxed", "sync", "async"))
    # Eviction starts at the high watermark and frees down to the low one: small steps near the
    # top, so the capacity configured is the capacity that caches (issue 26: 0.9 / 0.7 held ~80 %).
    ssd_high_watermark: float = _f(0.98, parse_float, "fraction",
        "Eviction starts when the slots in use pass this fraction of the capacity.")
    ssd_low_watermark: float = _f(0.95, parse_float, "fraction",
        "... and frees down to this fraction (0 < low < high <= 1).")
    eviction_policy: str = _f("lru", parse_eviction_policy, "",
        "Which pages go first: lru, deepest first among pages used together (prefix_aware names it).",
        EVICTION_POLICIES)
    # which new pages a put writes (store/admit_gate.py): "adaptive" | "all" | "second"; "auto" is
    # "adaptive" in the SGLang backend's store and "all" for a PageStore used directly
    admission_policy: str = _f("auto", parse_admission_policy, "",
        "Which new pages a put writes: adaptive, all, second; auto is adaptive in the SGLang backend and "
        "all for a PageStore used directly (docs/cache-policy.md).", ADMISSION_POLICIES)
    verify_crc: bool = _f(True, parse_bool, "",
        "Check every object's CRC32C when it is read; a mismatch is a miss, never wrong bytes.")
    io_timeout_s: float = _f(30.0, parse_io_timeout, "s",
        f"Bound on every wait for the drive ({IO_TIMEOUT_S_MIN:g}-{IO_TIMEOUT_S_MAX:g}); a stuck device "
        "becomes failed calls.")
    o_direct: bool = _f(True, parse_bool, "",
        "Bypass the page cache where the file system allows it (probed once per store).")
    gds_staging: bool = _f(False, parse_bool, "",
        "CUDA buffers without GPUDirect Storage: stage them through pinned host memory (docs/gpu.md).")
    # issue 36: a large index loads after open returns (store/loading.py); lookups miss until then
    ssd_background_open_bytes: int = _f(64 * 1024 * 1024, size_parser(0), "bytes",
        "A writer whose index file is at least this large returns from open at once and loads the index "
        "in the background (lookups miss, puts wait up to 1 s, deletes wait); 0: always.")
    # issue 36: a writer keeps the record blocks it changes plus this much of clean ones (store/record_areas.py)
    ssd_record_cache_bytes: int = _f(64 * 1024 * 1024, size_parser(0), "bytes",
        "Clean record blocks (256 B a slot, 4 KiB a block) a writer keeps in memory beside the ones it is "
        "changing; beyond it they are read back from the segment when changed again. 0: keep none.")
    # Swift's mount_check: a root must lie on a mounted drive (store/mounts.py), else that drive is
    # degraded and nothing is created there; off: only the multi-drive guard applies.
    ssd_require_mount: bool = _f(False, parse_bool, "",
        "Every root must lie on a mounted drive (not on `/`); one that does not is degraded and nothing "
        "is created there (docs/reliability.md).")
    extra_backend_tag: str | None = _f(None, parse_tag, "",
        "Prefix of side-pool keys, before the model name (UMBP's key scheme, §4).")
    # UMBP knobs kept for compatibility and stats; they change nothing in this store.
    ssd_enabled: bool = _f(True, parse_bool, "",
        "UMBP's SSD-tier switch: false leaves the backend nothing to store (every lookup misses).")
    dram_capacity_bytes: int = _f(4 * GiB, size_parser(0), "bytes",
        "UMBP's DRAM tier: accepted, no effect (there is none here; the OS page cache is it).")
    eviction_candidate_window: int = _f(16, int_parser(0), "entries", "UMBP's: accepted, no effect here.")
    auto_promote_on_read: bool = _f(True, parse_bool, "", "UMBP's: accepted, no effect here.")

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
        if not (is_real(low) and is_real(high) and 0.0 < low < high <= 1.0):
            raise ValueError(
                f"SSD watermarks must satisfy 0 < ssd_low_watermark < ssd_high_watermark <= 1, "
                f"got ssd_low_watermark={low!r}, ssd_high_watermark={high!r}"
            )
        t = self.io_timeout_s
        if not (is_real(t) and math.isfinite(t) and t > 0):
            raise ValueError(f"io_timeout_s must be a positive number of seconds, got {t!r}")
        if not IO_TIMEOUT_S_MIN <= t <= IO_TIMEOUT_S_MAX:
            raise ValueError(io_timeout_range("io_timeout_s", t))



# ---------------------------------------------------------------------------------------------
# Key tables.

# UMBP keys accepted, type-checked and ignored here (its DRAM->SSD copy pipeline, RDMA registration,
# KV-event subscription): key -> (parser, what the key table says)
ACCEPTED_KEYS: dict[str, tuple[Callable[[Any, str], Any], str]] = {
    "ssd_backend": (parse_ssd_backend, "UMBP's SSD backend: only `file` (SPDK is refused with the reason)."),
    "ssd_copy_async": (parse_bool, "UMBP's DRAM->SSD copy pipeline: accepted, no effect here."),
    "ssd_copy_queue_depth": (int_parser(0), "UMBP's DRAM->SSD copy pipeline: accepted, no effect here."),
    "ssd_copy_worker_threads": (int_parser(0), "UMBP's DRAM->SSD copy pipeline: accepted, no effect here."),
    "ssd_copy_batch_max_ops": (int_parser(0), "UMBP's DRAM->SSD copy pipeline: accepted, no effect here."),
    "disable_zero_copy_register": (parse_bool, "UMBP's RDMA registration switch: accepted, no effect here."),
    "kv_events_subscriber": (warn_kv_events, "UMBP's KV-event subscriber: accepted with a warning, no effect "
                                             "(`kv_events_endpoint` publishes this store's events)."),
    # the SGLang backend takes these itself (sglang/kv_events.py); a PageStore user's are ignored
    "kv_events_endpoint": (lambda v, label: v, "DISK-tier KV events (docs/fleet.md)."),
    "kv_events_topic": (lambda v, label: v, "DISK-tier KV events (docs/fleet.md)."),
}

# extra_config key -> (StoreConfig field or None when accepted and ignored, parser)
_FIELD_KEYS: dict[str, tuple[str | None, Callable[[Any, str], Any]]] = {
    **{f.name: (f.name, f.metadata["parse"]) for f in fields(StoreConfig)},
    **{k: (None, parse) for k, (parse, _) in ACCEPTED_KEYS.items()},
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
    "UMBP_SSD_BACKGROUND_OPEN_BYTES": "ssd_background_open_bytes",
    "UMBP_SSD_RECORD_CACHE_BYTES": "ssd_record_cache_bytes",
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


def config_sources(extra_config: Mapping | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """StoreConfig field -> where load_config took its value from (``extra_config['key']`` or the
    environment variable; the dict wins, as in load_config); a field not listed has its default
    (the SGLang backend warns when the directory or the capacity is one: sglang/startup.py)."""
    env = os.environ if env is None else env
    out = {}
    for var, k in ENV_KEYS.items():
        if env.get(var) and _FIELD_KEYS[k][0] is not None:
            out[_FIELD_KEYS[k][0]] = var
    for k in extra_config or {}:
        if isinstance(k, str) and k in _FIELD_KEYS and _FIELD_KEYS[k][0] is not None:
            out[_FIELD_KEYS[k][0]] = f"extra_config[{k!r}]"
    return out
