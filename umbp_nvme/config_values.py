"""How a setting's value is read: the parsers every layer of the config uses, and the choices they take.

Each parser takes ``(value, label)``, where ``label`` is how its error names the source
(``extra_config['key']`` or the environment variable); the error names the value and what is
allowed. config.py applies them (defaults -> ``UMBP_*`` environment -> extra_config) and checks
the result once, when a StoreConfig is made.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
from typing import Any, Callable

from .sizes import parse_size

logger = logging.getLogger("umbp_nvme.config")

IO_BACKENDS = ("posix", "io_uring", "auto")  # auto: io_uring, falling back to posix with one warning
DURABILITY_ALIASES = {"strict": "strict", "sync": "strict", "relaxed": "relaxed", "async": "relaxed"}
SSD_BACKENDS = ("file", "spdk", "spdk_proxy")
EVICTION_POLICIES = ("lru", "prefix_aware")
ADMISSION_POLICIES = ("auto", "adaptive", "all", "second")  # store/admit_gate.py
READ_PRIORITY_CHOICES = ("on", "off")  # reads before writes: ioprio, one write slice in flight while reads run
CRC_POLICIES = ("idle", "batch", "nice", "normal")  # how a put's CRC worker lowers its CPU priority (put_crc.py)
CRC_NICE_MAX = 19  # the lowest CPU priority a nice value names
# io_timeout_s bounds: below 0.1 s a healthy drive's fdatasync under load, or one large batch, already
# outlives the bound and every operation fails; above a day the sync front's waits (4x + slack) pass
# threading.TIMEOUT_MAX and the store cannot even open. Neither is a wait for a stuck disk anyone wants.
IO_TIMEOUT_S_MIN = 0.1
IO_TIMEOUT_S_MAX = 86400.0


def is_real(value: Any) -> bool:
    """An int or float, not a bool (True would pass as 1) nor a string (a TypeError in comparisons)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def io_timeout_range(label: str, value: Any) -> str:
    return (f"{label} must be between {IO_TIMEOUT_S_MIN:g} and {IO_TIMEOUT_S_MAX:g} seconds, got {value!r}: "
            "shorter fails healthy operations, longer overflows the waits built on it")


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


def size_parser(minimum: int) -> Callable[[Any, str], int]:
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


def parse_float(value: Any, label: str) -> float:
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


def parse_positive_float(value: Any, label: str) -> float:
    parsed = parse_float(value, label)
    if parsed <= 0:
        raise ValueError(f"{label} must be a positive number, got {value!r}")
    return parsed


def parse_io_timeout(value: Any, label: str) -> float:
    parsed = parse_positive_float(value, label)
    if not IO_TIMEOUT_S_MIN <= parsed <= IO_TIMEOUT_S_MAX:
        raise ValueError(io_timeout_range(label, value))
    return parsed


def parse_dir(value: Any, label: str) -> str:
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


def parse_io_backend(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in IO_BACKENDS:
        # The text up to ';' is UMBP's message, so logs and tests written for it still match.
        raise ValueError(f"{label} must be one of: posix, io_uring; got {value!r} (umbp_nvme also takes 'auto')")
    return norm


def parse_durability(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in DURABILITY_ALIASES:
        raise ValueError(f"{label} must be one of: strict, sync, relaxed, async; got {value!r}")
    return DURABILITY_ALIASES[norm]


def parse_ssd_backend(value: Any, label: str) -> str:
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


def parse_eviction_policy(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in EVICTION_POLICIES:
        raise ValueError(f"{label} must be one of: lru, prefix_aware; got {value!r}")
    return norm


def parse_admission_policy(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in ADMISSION_POLICIES:
        raise ValueError(f"{label} must be one of: {', '.join(ADMISSION_POLICIES)}; got {value!r}")
    return norm


def warn_kv_events(value: Any, label: str) -> Any:
    if value:
        logger.warning("umbp_nvme: %s is set, but this backend subscribes to no KV events; ignored "
                       "(kv_events_endpoint publishes this store's DISK events: docs/fleet.md).", label)  # fmt: skip
    return value


def parse_crc_policy(value: Any, label: str) -> str:
    norm = str(value).strip().lower()
    if norm not in CRC_POLICIES:
        raise ValueError(f"{label} must be one of: {', '.join(CRC_POLICIES)}; got {value!r}")
    return norm


def parse_on_off(value: Any, label: str) -> str:
    return "on" if parse_bool(value, label) else "off"


def parse_tag(value: Any, label: str) -> str | None:
    return None if value is None else str(value)
