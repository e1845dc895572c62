"""kvikio settings across versions: read, set (read back), describe, configure."""

from __future__ import annotations

import os

from ._common import PROBE_BYTES, log

# --------------------------------------------------------------------------------------------
# kvikio settings across versions (24.x: compat_mode()/*_reset(); 25.x+: defaults.get/set)


# name -> (24.x getters, in preference order; 24.x setter)
_LEGACY = {"compat_mode": (("compat_mode",), "compat_mode_reset"),
           "num_threads": (("get_num_threads", "num_threads"), "num_threads_reset"),
           "gds_threshold": (("gds_threshold",), "gds_threshold_reset"),
           "task_size": (("task_size",), "task_size_reset")}


def _try_call(obj, attrs, *args) -> tuple[bool, object]:
    """(True, result) of the first callable among obj's attrs; (False, None) if none is or it raised."""
    for attr in attrs:
        fn = getattr(obj, attr, None)
        if callable(fn):
            try:
                return True, fn(*args)
            except Exception:
                return False, None
    return False, None


def kvikio_get(kv, name: str):
    d = getattr(kv, "defaults", None)
    ok, value = _try_call(d, ("get",), name)
    return value if ok else _try_call(d, _LEGACY.get(name, ((), ""))[0])[1]


def kvikio_set(kv, name: str, value) -> bool:
    """Set a kvikio default; True only when reading it back gives the value (it took effect)."""
    d = getattr(kv, "defaults", None)
    # defaults.set applies at once; the context manager it returns is only for `with`
    if not (callable(getattr(d, "get", None)) and _try_call(d, ("set",), name, value)[0]):
        if not _try_call(d, (_LEGACY.get(name, ((), ""))[1],), value)[0]:
            return False
    return _same_setting(kvikio_get(kv, name), value)


def _same_setting(got, want) -> bool:
    if got is None:
        return False
    if isinstance(want, bool) or isinstance(got, bool):
        return bool(got) == bool(want) if not hasattr(got, "name") else _mode_name(got) == _mode_name(want)
    try:
        return int(got) == int(want)
    except (TypeError, ValueError):
        return got == want


def _mode_name(mode) -> str | None:
    """'ON' | 'OFF' | 'AUTO' for a CompatMode, a legacy bool or a string; None if unknown."""
    if mode is None:
        return None
    name = getattr(mode, "name", None)
    if name is not None:
        return str(name).upper()
    if isinstance(mode, bool):
        return "ON" if mode else "OFF"
    if isinstance(mode, str):
        return mode.upper()
    return {0: "OFF", 1: "ON", 2: "AUTO"}.get(int(mode))


def _compat_value(kv, mode: str):
    enum = getattr(kv, "CompatMode", None)
    if enum is not None and hasattr(enum, mode.upper()):
        return getattr(enum, mode.upper())
    return {"on": True, "off": False, "auto": True}[mode]  # pre-CompatMode kvikio: a bool


def kvikio_compat_preferred(kv) -> bool | None:
    """True when kvikio does POSIX I/O + copies (its compat mode), False when cuFile is used."""
    ok, preferred = _try_call(getattr(kv, "defaults", None), ("is_compat_mode_preferred",))
    if ok:
        return bool(preferred)
    mode = kvikio_get(kv, "compat_mode")
    if mode is None:
        return None
    name = getattr(mode, "name", None)
    if name is not None:
        return None if name == "AUTO" else name == "ON"
    return bool(mode)


def kvikio_gds_driver_available(kv) -> bool | None:
    drv = getattr(kv, "cufile_driver", None)
    try:
        if drv is not None and callable(getattr(drv, "get", None)):
            return bool(drv.get("is_gds_available"))
        props = getattr(drv, "properties", None) if drv is not None else None
        if props is not None and hasattr(props, "is_gds_available"):
            return bool(props.is_gds_available)
        cls = getattr(kv, "DriverProperties", None) or getattr(drv, "DriverProperties", None)
        if cls is not None:
            return bool(cls().is_gds_available)
    except Exception:
        return False
    return None


def kvikio_settings(kv) -> dict:
    """What kvikio will do, read back from kvikio itself (None where it does not say)."""
    compat = kvikio_compat_preferred(kv)
    return {"compat_mode": _mode_name(kvikio_get(kv, "compat_mode")),
            "compat_decision": None if compat is None else ("posix" if compat else "cufile"),
            "gds_driver_available": kvikio_gds_driver_available(kv),
            "num_threads": kvikio_get(kv, "num_threads"),
            "gds_threshold": kvikio_get(kv, "gds_threshold"),
            "task_size": kvikio_get(kv, "task_size")}


def describe_kvikio(kv) -> str:
    s = kvikio_settings(kv)
    decision = {"posix": "POSIX+copy (kvikio compat mode)", "cufile": "cuFile where each file allows it",
                None: "unknown"}[s["compat_decision"]]
    gds = s["gds_driver_available"]
    return (f"io={decision}, compat_mode={s['compat_mode'] or 'unknown'}, "
            f"gds_driver={'unknown' if gds is None else gds}, num_threads={s['num_threads']}, "
            f"gds_threshold={s['gds_threshold']}")



def configure_kvikio(kv, queue_depth: int, *, compat_mode: str | None = None,
                     num_threads: int | None = None, gds_threshold: int | None = None) -> list[str]:
    """Apply our defaults unless the KVIKIO_* environment variables already chose; returns the
    names of the settings kvikio did not take (each is read back after setting it).

    * ``num_threads``: kvikio's pool defaults to 1 thread, which serialises every op; we use
      min(queue_depth, 16) unless KVIKIO_NTHREADS is set.
    * ``gds_threshold``: below it kvikio's pread runs synchronously, by POSIX + copy, in the calling
      thread (kvikio's small-I/O shortcut), which would serialise a batch of KV pages; we lower it to
      one page unless KVIKIO_GDS_THRESHOLD is set.
    * ``compat_mode``: "on" | "off" | "auto"; default: kvikio's own (AUTO: cuFile when it works,
      POSIX + copy otherwise; KVIKIO_COMPAT_MODE overrides).
    """
    wanted = {}
    if compat_mode is not None:
        if compat_mode not in ("on", "off", "auto"):
            raise ValueError(f"compat_mode must be 'on', 'off' or 'auto', got {compat_mode!r}")
        wanted["compat_mode"] = _compat_value(kv, compat_mode)
    if num_threads is None and "KVIKIO_NTHREADS" not in os.environ:
        want = min(queue_depth, 16)
        cur = kvikio_get(kv, "num_threads")
        if cur is None or int(cur) < want:
            num_threads = want
    if num_threads is not None:
        wanted["num_threads"] = int(num_threads)
    if gds_threshold is None and "KVIKIO_GDS_THRESHOLD" not in os.environ:
        gds_threshold = PROBE_BYTES
    if gds_threshold is not None:
        wanted["gds_threshold"] = int(gds_threshold)
    failed = [name for name, value in wanted.items() if not kvikio_set(kv, name, value)]
    if failed:
        log.warning("kvikio did not take these settings (read back differs): %s; it runs with %s",
                    ", ".join(f"{n}={wanted[n]}" for n in failed), describe_kvikio(kv))
    return failed
