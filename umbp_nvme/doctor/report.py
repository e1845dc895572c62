"""The doctor's report: what a store will actually use on this machine, and what the machine can do.

Shown by ``umbp-nvme doctor`` (cli/commands.py) and logged by the SGLang backend at open when
``doctor_at_start`` asks (sglang/stores.py); it sits below both, so neither imports the other.

``report(store_dir, config) -> dict`` checks, in this order, each as one item of the report:

* ``io_uring``: the kernel's ring (``_uring.probe()``): works or why not, feature bits, ops,
  ``kernel.io_uring_disabled``.
* ``engine``: the engine the store would open with this config (the real ``open_engine``) and why.
* ``o_direct``: whether a data file on the store's file system opens with O_DIRECT, and its
  alignment (``statx`` DIO alignment), or buffered I/O and the reason.
* ``memlock``: RLIMIT_MEMLOCK (registered buffers count against it) and a real registration.
* ``hugepages``: hugetlb pages reserved / free, transparent hugepages, and whether the host pool
  ranges (when a server runs the doctor at start) are hugepage-backed.
* ``filesystem``: type, device, free space against the capacity the store runs with (per store
  directory: each SGLang rank has its own), and the stores beside it (the other ranks') together.
* ``session`` (``session.py``): a drive of several: whether a writer can record its session
  there (else the drive takes no writes), and what a running writer last recorded.
* ``scheduler``: the block device's I/O scheduler and whether it honours I/O priorities.
* ``gpu``: GPU / GDS (KvikIO) status, with the exact reason when it is off.
* ``page_hash`` (``page_hash.py``): with SGLang installed, whether its page-hash extension is
  built where the server will look (else its first prefetches time out: how to build it first).
* ``probe`` (``probe.py``): a few seconds of put_many / get_many through a scratch store
  at the store's object size, in GB/s and as a fraction of raw O_DIRECT I/O of the same size on
  the same file system.

Every finding has a level (``ok``, ``info``, ``warn``, ``fail``) and a plain-language fix. Nothing
here writes into the store itself: the probe uses a scratch directory beside it, removed after.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource
import tempfile
import time

from ..config import StoreConfig
from .findings import existing, finding
from .probe import PROBE_SECONDS, check_probe
from .page_hash import check_page_hash
from .session import check_session_record
from ..sizes import format_bytes
from ..store.fs_room import stores_in, stores_shortfall
from ..store.layout import segment_disk_bytes

log = logging.getLogger("umbp_nvme.doctor")

_PRIORITY_SCHEDULERS = ("bfq", "mq-deadline")  # the blk-mq schedulers that honour ioprio


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


# ------------------------------------------------------------------------------ io_uring, engine


def check_io_uring(findings: list) -> dict:
    disabled = _read("/proc/sys/kernel/io_uring_disabled")
    try:
        from .. import _uring

        p = dict(_uring.probe())
    except ImportError as e:
        p = {"ring": False, "error": f"native extension not built ({e})"}
    p["io_uring_disabled_sysctl"] = None if disabled is None else int(disabled)
    p["kernel"] = p.get("kernel") or os.uname().release
    if p.get("ring"):
        missing = [op for op, ok in (p.get("ops") or {}).items() if not ok]
        finding(findings, "io_uring", "ok" if not missing else "warn",
                 f"io_uring works on kernel {p['kernel']}" + (f"; ops missing: {', '.join(missing)}" if missing else ""),
                 "" if not missing else "upgrade the kernel (5.19+ has every op the store uses)")
    else:
        why = p.get("error") or os.strerror(p.get("errno") or errno.ENOSYS)
        fix = ("set kernel.io_uring_disabled=0 (sysctl -w kernel.io_uring_disabled=0)" if disabled not in (None, "0")
               else "run on Linux 5.6+ outside a seccomp profile that blocks io_uring (docker: --security-opt "
                    "seccomp=unconfined or a profile allowing io_uring_setup/enter/register)")
        finding(findings, "io_uring", "warn", f"io_uring unavailable: {why}", fix)
    return p


def check_engine(config: StoreConfig, findings: list) -> dict:
    from ..engine import FORCE_NO_URING_ENV, open_engine

    asked = config.ssd_io_backend
    forced = os.environ.get(FORCE_NO_URING_ENV, "") not in ("", "0")

    async def pick():
        eng = await open_engine(asked, 8)
        try:
            return eng.capabilities.name
        finally:
            eng.close()

    logging.getLogger("umbp_nvme.engine").disabled, was = True, logging.getLogger("umbp_nvme.engine").disabled
    try:
        chosen = asyncio.run(pick())
    finally:
        logging.getLogger("umbp_nvme.engine").disabled = was
    if chosen != "posix":
        why = f"io_uring works and ssd_io_backend={asked!r}"
        finding(findings, "engine", "ok", f"engine {chosen}: {why}")
    elif asked == "posix":
        why = "ssd_io_backend='posix' in the config"
        finding(findings, "engine", "info", f"engine posix: chosen by the config ({why})",
                 "set ssd_io_backend to 'io_uring' (or 'auto') for fewer threads and lower latency")
    elif forced:
        why = f"io_uring disabled by {FORCE_NO_URING_ENV}=1 in the environment"
        finding(findings, "engine", "warn", f"engine posix (fallback; asked {asked!r}): {why}",
                 f"unset {FORCE_NO_URING_ENV} unless you mean to run without io_uring")
    else:
        why = "io_uring cannot start on this machine (see io_uring)"
        finding(findings, "engine", "warn", f"engine posix (fallback; asked {asked!r}): {why}",
                 "fix the io_uring item above; the store works but uses a thread pool")
    return {"asked": asked, "chosen": chosen, "fallback": asked != "posix" and chosen == "posix", "reason": why}


# ------------------------------------------------------------------------------ file system


def _mount_of(path: str) -> dict:
    """The /proc/self/mountinfo entry holding path: mount point, fs type, source."""
    best = {"mount_point": "/", "fs_type": "?", "source": "?"}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                mp = left.split()[4].replace("\\040", " ")
                fs = right.split()
                if (path == mp or path.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best["mount_point"]):
                    best = {"mount_point": mp, "fs_type": fs[0], "source": fs[1] if len(fs) > 1 else "?"}
    except OSError:
        pass
    return best


def _block_queue(dev: int) -> str | None:
    """/sys/block/<disk>/queue of the device holding st_dev ``dev`` (the whole disk for a partition)."""
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if not os.path.exists(base):
        return None
    real = os.path.realpath(base)
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    q = os.path.join(real, "queue")
    return q if os.path.isdir(q) else None


def check_filesystem(store_dir: str, config: StoreConfig, findings: list, capacity_source: str = "the config") -> dict:
    where = existing(store_dir)
    st = os.stat(where)
    sv = os.statvfs(where)
    m = _mount_of(os.path.realpath(where))
    free = sv.f_bavail * sv.f_frsize
    out = {**m, "path": where, "free_bytes": free, "size_bytes": sv.f_blocks * sv.f_frsize,
           "capacity_bytes": int(config.ssd_capacity_bytes), "device": f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"}
    q = _block_queue(st.st_dev)
    out["block_device"] = os.path.basename(os.path.dirname(q)) if q else None
    out["rotational"] = None if q is None else _read(os.path.join(q, "rotational")) == "1"
    out["store_disk_bytes"] = used = segment_disk_bytes(store_dir)
    if m["fs_type"] in ("tmpfs", "ramfs"):
        finding(findings, "filesystem", "warn", f"the store is on {m['fs_type']} ({m['mount_point']}): it lives in RAM, "
                 "not on a drive, and is gone at reboot", "point ssd_storage_dir at a directory on the NVMe drive "
                 "(an ext4 or xfs mount)")
    elif m["fs_type"] in ("overlay", "nfs", "nfs4", "fuse", "cifs") or m["fs_type"].startswith("fuse"):
        finding(findings, "filesystem", "warn", f"the store is on {m['fs_type']} ({m['mount_point']}): extra copies "
                 "and often no O_DIRECT", "bind-mount a host NVMe directory (ext4/xfs) into the container and use it")
    else:
        finding(findings, "filesystem", "ok", f"{m['fs_type']} on {m['source']} at {m['mount_point']}")
    if out["rotational"]:
        finding(findings, "filesystem", "warn", f"{out['block_device']} reports itself rotational (a spinning disk; "
                 "virtual disks often report this whatever is below them)",
                 "use an NVMe SSD; a spinning disk cannot serve KV pages fast enough to beat recomputation")
    out["capacity_source"] = capacity_source
    need = int(config.ssd_capacity_bytes) - used
    if need > free:
        finding(findings, "filesystem", "warn",
                 f"capacity {config.ssd_capacity_bytes / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB free "
                 f"(+{used / 2**30:.1f} GiB already in the store): the store will stop short of its capacity",
                 "lower ssd_capacity_bytes below the free space or free space on the drive")
    else:
        finding(findings, "filesystem", "ok",
                f"capacity {format_bytes(config.ssd_capacity_bytes)} ({capacity_source}) for this store directory; "
                "ssd_capacity_bytes is per store directory: each rank of an SGLang server has its own")
    # the other ranks' stores beside this one (one directory each under ssd_storage_dir)
    parent = os.path.dirname(os.path.abspath(store_dir))
    short = stores_shortfall(parent)
    out["stores_beside"] = len(stores_in(parent))
    if short is not None:
        finding(findings, "filesystem", "warn", short, "lower ssd_capacity_bytes (each rank's) as it says, or free "
                "space on the drive")
    return out


def check_o_direct(store_dir: str, config: StoreConfig, findings: list) -> dict:
    from ..buffers import DIO_ALIGN_BYTES
    from ..engine.files import open_data_file

    where = existing(store_dir)
    out: dict = {"asked": bool(config.o_direct)}
    try:
        fd, probe = tempfile.mkstemp(prefix=".umbp-doctor-odirect-", dir=where)
        os.close(fd)
    except OSError as e:
        out.update(direct=None, error=f"cannot create a probe file in {where}: {e.strerror}")
        finding(findings, "o_direct", "fail", out["error"], f"make {where} writable by this user")
        return out
    try:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT
        try:
            os.close(os.open(probe, flags))
            out["kernel_accepts"] = True
            out["error"] = ""
        except OSError as e:
            out["kernel_accepts"] = False
            out["error"] = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
        if config.o_direct:
            with open_data_file(probe) as f:
                out.update(direct=f.direct, align_bytes=f.align)
        else:
            out.update(direct=False, align_bytes=None)
    finally:
        os.unlink(probe)
    m = _mount_of(os.path.realpath(where))
    if out["direct"]:
        note = f"O_DIRECT on {m['fs_type']}, alignment {out['align_bytes']} bytes"
        if out["align_bytes"] == DIO_ALIGN_BYTES:
            note += " (statx reports none or 4 KiB)"
        finding(findings, "o_direct", "ok", note)
    elif not config.o_direct:
        finding(findings, "o_direct", "info", "buffered I/O: o_direct=false in the config",
                 "set o_direct=true so reads bypass the page cache (they are CRC-checked anyway)")
    else:
        finding(findings, "o_direct", "warn",
                 f"buffered I/O (fallback): {m['fs_type']} refuses O_DIRECT ({out['error'] or 'refused earlier in this process'}); "
                 "reads and writes go through the page cache",
                 "put the store on ext4 or xfs on the NVMe drive (tmpfs before Linux 6.6, overlay and many FUSE "
                 "file systems refuse O_DIRECT)")
    return out


# ------------------------------------------------------------------------------ memory


def check_memlock(findings: list, pool_bytes: int | None = None) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    out = {"soft_bytes": None if soft == inf else soft, "hard_bytes": None if hard == inf else hard,
           "unlimited": soft == inf}
    # a real registration of 64 MiB (a modest host pool share) tells what the kernel allows
    try:
        from .. import _uring
    except ImportError:
        _uring = None
    ok = None
    if _uring is not None:
        from ..buffers import AlignedBuffer

        with AlignedBuffer(64 << 20) as b:
            try:
                ring = _uring.Ring(8)
            except OSError as e:
                ring = None
                out["register_error"] = f"no ring ({e.strerror})"
            if ring is not None:
                try:
                    ring.register_buffers([(b.address, b.nbytes)])
                    ring.unregister_buffers()
                    ok = True
                except OSError as e:
                    ok = False
                    out["register_error"] = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror}"
                finally:
                    ring.close()
    out["register_64mib_ok"] = ok
    lim = "unlimited" if soft == inf else f"{soft / 2**20:.0f} MiB"
    if ok is False or (soft != inf and pool_bytes and soft < pool_bytes):
        finding(findings, "memlock", "warn", f"RLIMIT_MEMLOCK {lim}: the host pool cannot be registered with io_uring "
                 "(fixed buffers off; each I/O maps its pages instead, a few % more CPU)",
                 "raise it: `ulimit -l unlimited`, docker --ulimit memlock=-1, systemd LimitMEMLOCK=infinity")
    else:
        bypass = " (this process may lock memory beyond the limit: root or CAP_IPC_LOCK)" if (
            ok and soft != inf and soft < 64 << 20) else ""
        finding(findings, "memlock", "ok", f"RLIMIT_MEMLOCK {lim}; registering 64 MiB "
                 + ("works" if ok else "not tested (no io_uring)") + bypass)
    return out


def _smaps_page_sizes(ranges) -> list[dict]:
    """KernelPageSize / AnonHugePages of the mappings holding each (address, nbytes)."""
    out = []
    try:
        with open("/proc/self/smaps", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return out
    maps = []
    cur = None
    for line in text.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = {"lo": lo, "hi": hi, "kps": 4, "thp": 0}
            maps.append(cur)
        elif cur is not None and head == "KernelPageSize:":
            cur["kps"] = int(line.split()[1])
        elif cur is not None and head == "AnonHugePages:":
            cur["thp"] = int(line.split()[1])
    for addr, nbytes in ranges:
        hit = [m for m in maps if m["lo"] <= addr < m["hi"]]
        if hit:
            out.append({"address": hex(addr), "nbytes": nbytes, "kernel_page_kib": hit[0]["kps"],
                        "thp_kib": hit[0]["thp"]})
    return out


def check_hugepages(findings: list, ranges=None) -> dict:
    info = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        k, _, v = line.partition(":")
        if k in ("HugePages_Total", "HugePages_Free", "Hugepagesize", "AnonHugePages"):
            info[k] = int(v.split()[0])
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    out = {"total": info.get("HugePages_Total", 0), "free": info.get("HugePages_Free", 0),
           "page_kib": info.get("Hugepagesize"), "thp": thp,
           "pool": _smaps_page_sizes(ranges) if ranges else None}
    if out["pool"]:
        huge = all(p["kernel_page_kib"] >= 2048 or p["thp_kib"] > 0 for p in out["pool"])
        out["pool_hugepage_backed"] = huge
        if huge:
            finding(findings, "hugepages", "ok", "the host pool is hugepage-backed")
        else:
            finding(findings, "hugepages", "info", "the host pool is on 4 KiB pages (more TLB misses on large copies)",
                     "reserve hugetlb pages (echo N > /proc/sys/vm/nr_hugepages) or set transparent_hugepage to "
                     "'always'/'madvise'")
    else:
        out["pool_hugepage_backed"] = None
        msg = (f"{out['free']} of {out['total']} hugetlb pages of {out['page_kib']} KiB free; THP {thp or '?'}; "
               "host pool not in this process (run the doctor at server start to check it)")
        finding(findings, "hugepages", "info", msg,
                 "" if out["total"] else "optional: reserve 2 MiB pages (echo N > /proc/sys/vm/nr_hugepages) "
                                         "for a hugepage-backed host pool")
    return out


# ------------------------------------------------------------------------------ scheduler, GPU


def check_scheduler(store_dir: str, findings: list) -> dict:
    q = _block_queue(os.stat(existing(store_dir)).st_dev)
    if q is None:
        finding(findings, "scheduler", "info", "no block device under the store (tmpfs, overlay or network "
                 "file system): no I/O scheduler applies")
        return {"device": None, "scheduler": None, "honours_priorities": None}
    raw = _read(os.path.join(q, "scheduler")) or ""
    active = raw[raw.find("[") + 1 : raw.find("]")] if "[" in raw else raw or None
    prio = active in _PRIORITY_SCHEDULERS
    out = {"device": os.path.basename(os.path.dirname(q)), "scheduler": active, "available": raw.replace("[", "").replace("]", "").split(),
           "honours_priorities": prio, "nr_requests": _read(os.path.join(q, "nr_requests"))}
    if prio:
        finding(findings, "scheduler", "ok", f"{out['device']}: {active}, honours I/O priorities")
    else:
        finding(findings, "scheduler", "info",
                 f"{out['device']}: {active}: does not honour I/O priorities (the store issues none today; "
                 "on NVMe 'none' is the fastest choice)",
                 f"only if you need priorities: echo mq-deadline > /sys/block/{out['device']}/queue/scheduler")
    return out


def check_gpu(findings: list) -> dict:
    from ..engine.gds import gds_available

    try:
        ok, why = gds_available()
    except Exception as e:  # noqa: BLE001 - a broken CUDA stack is a finding, not a crash
        ok, why = False, f"probe failed: {e!r}"
    out = {"gds": ok, "detail": why}
    try:
        import torch

        out["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        out["cuda_devices"] = None
    if ok:
        compat = "compat" in why.lower() and "compat_mode=off" not in why.lower()
        finding(findings, "gpu", "warn" if compat else "ok", f"GDS available: {why}",
                 "KvikIO runs in compatibility mode (POSIX under the hood): install nvidia-fs and check "
                 "/etc/cufile.json" if compat else "")
    else:
        finding(findings, "gpu", "info", f"GDS off: {why}",
                 "only needed for GPU-direct reads into CUDA buffers; host-pool serving is unaffected")
    return out


# ------------------------------------------------------------------------------ the report


def report(store_dir: str, config: StoreConfig | None = None, *, probe: bool = True, ranges=None,
           probe_seconds: float = PROBE_SECONDS, capacity_source: str = "the config") -> dict:
    """Every check above; ``ranges``: the host pool's (address, nbytes) when a server runs it;
    ``capacity_source``: where the config's capacity came from, as the report names it."""
    config = config or StoreConfig()
    t0 = time.perf_counter()
    findings: list = []
    items: dict = {}
    checks = [
        ("io_uring", lambda: check_io_uring(findings)),
        ("engine", lambda: check_engine(config, findings)),
        ("o_direct", lambda: check_o_direct(store_dir, config, findings)),
        ("memlock", lambda: check_memlock(findings, sum(n for _, n in ranges) if ranges else None)),
        ("hugepages", lambda: check_hugepages(findings, ranges)),
        ("filesystem", lambda: check_filesystem(store_dir, config, findings, capacity_source)),
        ("session", lambda: check_session_record(store_dir, findings)),
        ("scheduler", lambda: check_scheduler(store_dir, findings)),
        ("gpu", lambda: check_gpu(findings)),
        ("page_hash", lambda: check_page_hash(findings)),
    ]
    if probe:
        checks.append(("probe", lambda: check_probe(store_dir, config, findings, probe_seconds)))
    for name, fn in checks:
        t1 = time.perf_counter()
        try:
            items[name] = fn()
        except Exception as e:  # noqa: BLE001 - one broken check never hides the others
            items[name] = {"error": repr(e)}
            finding(findings, name, "fail", f"the check itself failed: {e!r}", "report this with `umbp-nvme doctor -v`")
        if isinstance(items[name], dict):
            items[name]["check_s"] = round(time.perf_counter() - t1, 3)
    worst = max((("ok", "info", "warn", "fail").index(f["level"]) for f in findings), default=0)
    return {"store": os.path.abspath(store_dir), "elapsed_s": round(time.perf_counter() - t0, 2),
            "status": ("ok", "ok", "warn", "fail")[worst], "items": items, "findings": findings}


def format_text(r: dict) -> str:
    lines = [f"umbp-nvme doctor: {r['store']} ({r['status']}, {r['elapsed_s']:.1f} s)"]
    for f in r["findings"]:
        lines.append(f"  [{f['level']:<4}] {f['item']:<10} {f['message']}")
        if f["fix"] and f["level"] != "ok":
            lines.append(f"  {'':6} {'':10} fix: {f['fix']}")
    return "\n".join(lines)


def log_report(store_dir: str, config: StoreConfig | None = None, ranges=None) -> dict:
    """The report without the probe (a server must not spend seconds of I/O at start), logged in one block.

    Runs on a thread of its own: the engine check runs an event loop, and the caller may be inside one.
    """
    import threading

    box: list = []
    t = threading.Thread(target=lambda: box.append(report(store_dir, config, probe=False, ranges=ranges)),
                         name="umbp-doctor", daemon=True)
    t.start()
    t.join()
    if not box:
        raise RuntimeError("the doctor report failed (see the thread's traceback above)")
    log.info("%s", format_text(box[0]))
    return box[0]
