"""Engine benchmark: random O_DIRECT reads and writes against fio on the same file.

    python tools/bench_engine.py [--dir DIR] [--quick] [--json PATH] [--plot PATH]
    python -m umbp_nvme.bench engine [same args]

Systems (each on plain 4 KiB pages, "4k", and on 2 MiB hugetlb pages, "huge"):
  umbp_uring        UringEngine, ops into plain memory
  umbp_uring_fixed  UringEngine with the whole buffer registered (fixed buffers)
  umbp_posix        PosixEngine with one worker thread per op in flight (only with --systems)
  preadv_threads    the plain baseline: QD threads, each looping os.preadv/pwritev on its own slot
  fio / fio_huge    fio --ioengine=io_uring --direct=1 (fio_huge: --iomem=shmhuge), same file,
                    block size and iodepth

Memory of each row. "4k": ours is one anonymous private mmap (4 KiB pages, THP not requested;
the machine's THP mode is madvise), faulted in once, sequentially, before the first cell; fio's
is its default --iomem=malloc, which glibc serves from an anonymous private mmap of QD x bs, a
fresh one per fio run, faulted in by the first O_DIRECT ops. Same route, same page size: what
differs is the physical contiguity the page allocator happens to hand out, and for >= 1 MiB ops
that, not the engine, sets the throughput (a request takes at most 254 segments here). The
``phys_segs`` column gives the mean physically contiguous runs per op buffer for every row (fio:
sampled from its buffer in every run; see phys_runs). Compare 4k rows only with that column in
view. "huge": ours is MAP_HUGETLB 2 MiB pages, fio_huge is --iomem=shmhuge (SysV shm on 2 MiB
hugetlb pages): one segment per op up to 2 MiB.

Durations: --duration per measurement (0.5 s), --large-duration (1.0 s) for >= 1 MiB at QD > 1,
where the disk's throughput wanders most; 3 rounds.

How queue depth is driven. fio keeps exactly QD ops in flight, refilling one per completion. A
batch engine's natural unit is a batch (the store submits one batch per SGLang call), so each
engine run keeps ``--tasks`` (default 4, at most QD) asyncio tasks, each submitting a batch of
QD/tasks ops and resubmitting as soon as it completes. (Measured at 1 MiB QD32: 32 tasks of one
op, i.e. fio's exact refill, moved the same GB/s within noise but cost 10-20 us more CPU per op,
the per-batch asyncio round trip; 4 tasks it is.) In flight is then between QD*(tasks-1)/tasks and QD (QD when all batches are out),
close to fio's steady QD while keeping the per-batch Python cost amortised the way the store
uses the engine (one batch per call). At QD 1 it is one task with batches of one op, exactly
fio's QD 1. preadv_threads and umbp_posix run QD threads, so "equal threads" holds as well.
Offsets are uniform random multiples of the object size (fio's default blockalign = bs),
precomputed so the timed loop draws no random numbers.

CPU per op is process CPU time (user + sys, all threads, io_uring io-wq workers included) over
the timed window divided by the ops completed in it; for fio it is its reported
(usr_cpu + sys_cpu) x job runtime / ops.

The disk is noisy (±50% between repeats), so systems alternate within each configuration
(A B C ... A B C ...) for ``--runs`` rounds; the table shows medians with [min-max] and
``vs_fio`` is the median over rounds of our/fio from the same round (fio_huge for "huge").
Hugetlb pages are reserved through /proc/sys/vm/nr_hugepages when running as root and the
previous value is restored at exit; otherwise the "huge" variants are skipped with a note.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from .common import Sample, Skip, Stopwatch, check_buffers, finish, make_row, paired_ratio, parse_bytes, print_table

from umbp_nvme.buffers import HUGE_PAGE_BYTES, AlignedBuffer, reserve_hugepages
from umbp_nvme.engine import open_data_file, open_engine

BENCH = "engine"
ALL_SYSTEMS = ("umbp_uring", "umbp_uring_fixed", "umbp_posix", "preadv_threads", "fio", "fio_huge")
# umbp_posix (the fallback engine) only on request: it keeps the full run under ~8 minutes.
DEFAULT_SYSTEMS = ("umbp_uring", "umbp_uring_fixed", "preadv_threads", "fio", "fio_huge")
OUR_SYSTEMS = ALL_SYSTEMS[:4]
OFFSETS_PER_SLOT = 256  # precomputed random offsets per in-flight slot, cycled


def parse_args(argv):
    p = argparse.ArgumentParser(prog="umbp-nvme bench engine", description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="directory for the test file (default: a new temp dir under /tmp)")
    p.add_argument("--file-size", default=None, help="test file size (default 1g; --quick 256m)")
    p.add_argument("--sizes", default=None, help="object sizes (default 4k,64k,1m,4m; --quick 4k,1m)")
    p.add_argument("--qd", default=None, help="queue depths (default 1,32,128; --quick 32)")
    p.add_argument("--ops", default="read,write", help="read,write")
    p.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS),
        help=f"subset of {','.join(ALL_SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})",
    )  # fmt: skip
    p.add_argument("--buffers", default="4k,huge", help="memory kinds for our systems: 4k,huge")
    p.add_argument("--runs", type=int, default=None, help="rounds per configuration (default 3; --quick 2)")
    p.add_argument(
        "--duration", type=float, default=None,
        help="seconds per measurement below 1 MiB objects (default 0.5; --quick 0.2)",
    )  # fmt: skip
    p.add_argument(
        "--large-duration", type=float, default=None,
        help="seconds per measurement for >= 1 MiB objects at QD > 1 (default 1.0; --quick 0.4): "
        "the disk's throughput wanders, so short windows make the medians noise",
    )  # fmt: skip
    p.add_argument("--tasks", type=int, default=4, help="concurrent batches per engine run (QD split among them)")
    p.add_argument("--quick", action="store_true", help="small matrix, finishes in under a minute")
    p.add_argument("--json", help="write the rows as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--keep-file", action="store_true", help="keep the test file")
    a = p.parse_args(argv)
    q = a.quick
    a.file_size = parse_bytes(a.file_size or ("256m" if q else "1g"))
    a.sizes = [parse_bytes(s) for s in (a.sizes or ("4k,1m" if q else "4k,64k,1m,4m")).split(",")]
    a.qd = [int(x) for x in (a.qd or ("32" if q else "1,32,128")).split(",")]
    a.ops = a.ops.split(",")
    a.systems = [s for s in a.systems.split(",") if s]
    a.buffers = [b for b in a.buffers.split(",") if b]
    a.runs = a.runs or (2 if q else 3)
    a.duration = a.duration or (0.2 if q else 0.5)
    a.large_duration = a.large_duration or (0.4 if q else 1.0)
    for s in a.systems:
        if s not in ALL_SYSTEMS:
            p.error(f"unknown system {s!r}; expected some of {', '.join(ALL_SYSTEMS)}")
    check_buffers(p, a.buffers)
    for op in a.ops:
        if op not in ("read", "write"):
            p.error(f"unknown op {op!r}; expected read and/or write")
    for s in a.sizes:
        if s <= 0 or s % 4096:
            p.error(f"object size {s} must be a positive multiple of 4096 (O_DIRECT)")
    if max(a.sizes) > a.file_size:
        p.error(f"file size {a.file_size} is smaller than the largest object {max(a.sizes)}")
    if a.tasks < 1:
        p.error("--tasks must be >= 1")
    return a


# -- the test file and memory ------------------------------------------------------------------


def make_test_file(path: str, size: int) -> None:
    """Written in full: reads of fallocated-but-unwritten extents never reach the disk."""
    chunk = 32 << 20
    with AlignedBuffer(chunk) as buf:
        buf.array[:] = np.random.default_rng(1).integers(0, 256, chunk, dtype=np.uint8)
        f = open_data_file(path, create=True, size=size)
        try:
            mv = (ctypes.c_char * chunk).from_address(buf.address)
            for off in range(0, size, chunk):
                n = min(chunk, size - off)
                if os.pwritev(f.fd, [memoryview(mv)[:n]], off) != n:
                    raise OSError(f"short write filling {path} at {off}")
            os.fsync(f.fd)
        finally:
            f.close()


class Memory:
    """One buffer per memory kind, sized for the largest QD x object, touched once up front."""

    def __init__(self, nbytes: int, kinds: list[str], notes: list[str]):
        self.bufs: dict[str, AlignedBuffer] = {}
        for kind in kinds:
            try:
                buf = AlignedBuffer(nbytes, huge=(kind == "huge"))
            except OSError as e:
                notes.append(f"buffers={kind}: skipped ({e.strerror or e})")
                continue
            buf.array[:] = 0x5A  # fault every page in now, not inside a timed window
            self.bufs[kind] = buf

    def close(self) -> None:
        for buf in self.bufs.values():
            buf.close()
        self.bufs.clear()


class HugePages:
    """Reserve hugetlb pages as root; restore nr_hugepages on close."""

    PATH = "/proc/sys/vm/nr_hugepages"

    def __init__(self):
        self.saved: int | None = None

    def reserve(self, nbytes: int) -> tuple[bool, str]:
        if os.geteuid() != 0:
            return False, "not root: hugetlb pages not reserved (run as root or reserve them yourself)"
        try:
            with open(self.PATH) as f:
                self.saved = int(f.read())
        except OSError as e:
            return False, f"cannot read {self.PATH}: {e}"
        if reserve_hugepages(nbytes):
            return True, ""
        return False, f"could not reserve {nbytes >> 20} MiB of 2 MiB hugetlb pages"

    def restore(self) -> None:
        if self.saved is not None:
            try:
                with open(self.PATH, "w") as f:
                    f.write(str(self.saved))
            except OSError:
                pass
            self.saved = None


# -- physical layout of op buffers --------------------------------------------------------------
#
# A large O_DIRECT op becomes one scatter-gather segment per physically contiguous run of its
# buffer; this disk takes at most /sys/block/<dev>/queue/max_segments (254 here) per request, so a
# 1 MiB op on 256 scattered 4 KiB pages is split in two and a 4 MiB op in five or more, while the
# same op on 2 MiB hugetlb pages is one request. Plain anonymous memory (ours via mmap, fio's via
# malloc -> glibc mmap; THP is "madvise" and neither side madvises) gets whatever the page
# allocator hands out on first touch: sometimes pairs of contiguous pages (~128 runs per MiB),
# sometimes none (256), now and then long runs. Every row therefore reports ``phys_segs``: the
# mean number of physically contiguous runs per op buffer, read from /proc/PID/pagemap (root only;
# absent otherwise). For fio it is sampled from the running job's buffer in every run.


def phys_runs(pid, addr: int, nbytes: int, chunk: int) -> float | None:
    """Mean physically contiguous runs per ``chunk`` bytes of [addr, addr+nbytes); None if unknown."""
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            f.seek((addr // 4096) * 8)
            raw = f.read((nbytes // 4096) * 8)
    except OSError:
        return None
    ent = np.frombuffer(raw, dtype=np.uint64)
    present = (ent >> np.uint64(63)) & np.uint64(1)
    pfn = (ent & np.uint64((1 << 55) - 1)).astype(np.int64)
    if not len(pfn) or not present.all() or not pfn.any():  # not root: PFNs read as 0
        return None
    per = max(1, chunk // 4096)
    runs = [1 + int((np.diff(pfn[c : c + per]) != 1).sum()) for c in range(0, len(pfn) - per + 1, per)]
    return float(np.mean(runs)) if runs else None


def _fio_buffer_runs(fio_pid: int, nbytes: int, chunk: int) -> float | None:
    """phys_runs of the fio job's I/O buffer (the job is a child process of fio)."""
    kids = []
    try:
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == fio_pid:
                            kids.append(int(d))
                except (OSError, ValueError, IndexError):
                    pass
    except OSError:
        return None
    if nbytes < (1 << 20):
        return None  # small buffers live in the heap among other data: not identifiable
    for pid in kids + [fio_pid]:
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.readlines()
        except OSError:
            continue
        cands = []
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo < nbytes or len(parts) > 5 and not parts[5].startswith("/SYSV"):
                continue  # file mappings other than fio's shm segments
            cands.append((hi - lo, lo, hi))
        for _, lo, hi in sorted(cands):  # the smallest mapping that holds QD x bs: the buffer
            start = _first_present(pid, lo, hi)
            if start is not None and start + nbytes <= hi:
                r = phys_runs(pid, start, nbytes, chunk)
                if r is not None:
                    return r
    return None


def _first_present(pid: int, lo: int, hi: int) -> int | None:
    try:
        with open(f"/proc/{pid}/pagemap", "rb") as f:
            f.seek((lo // 4096) * 8)
            ent = np.frombuffer(f.read(((hi - lo) // 4096) * 8), dtype=np.uint64)
    except OSError:
        return None
    idx = np.flatnonzero((ent >> np.uint64(63)) & np.uint64(1))
    return None if not len(idx) else lo + int(idx[0]) * 4096


# -- systems -----------------------------------------------------------------------------------


def _split(qd: int, tasks: int) -> list[int]:
    k = min(qd, tasks)
    return [qd // k + (1 if i < qd % k else 0) for i in range(k)]


async def run_engine(engine, fd, op: str, size: int, qd: int, base_addr: int, slots: int, cfg) -> Sample:
    submit = engine.read_many if op == "read" else engine.write_many
    per_task = _split(qd, cfg.tasks)
    rng = np.random.default_rng()
    plans = []
    first = 0
    for n in per_task:
        addrs = base_addr + np.arange(first, first + n, dtype=np.uint64) * np.uint64(size)
        offs = rng.integers(0, slots, n * OFFSETS_PER_SLOT, dtype=np.int64) * size
        plans.append((addrs, offs, np.full(n, size, dtype=np.int64)))
        first += n

    async def one(addrs, offs, lengths, deadline) -> int:
        n = len(addrs)
        ops = 0
        i = 0
        cycle = OFFSETS_PER_SLOT
        while True:
            j = (i % cycle) * n
            res = await submit(fd, offs[j : j + n], addrs, lengths)
            if (res != lengths).any():
                bad = int(np.flatnonzero(res != lengths)[0])
                raise RuntimeError(f"{op} of {size} B at {int(offs[j + bad])} returned {int(res[bad])}")
            ops += n
            i += 1
            if deadline is None or time.perf_counter() >= deadline:
                return ops

    await asyncio.gather(*(one(a, o, ln, None) for a, o, ln in plans))  # warm-up: threads, first faults
    with Stopwatch() as sw:
        deadline = time.perf_counter() + cfg.duration
        counts = await asyncio.gather(*(one(a, o, ln, deadline) for a, o, ln in plans))
    ops = sum(counts)
    return sw.sample(ops * size, ops)


def run_preadv_threads(fd: int, op: str, size: int, qd: int, base_addr: int, slots: int, cfg) -> Sample:
    call = os.preadv if op == "read" else os.pwritev
    rng = np.random.default_rng()
    counts = [0] * qd
    errors: list[str] = []
    start = threading.Barrier(qd + 1)
    deadline = [0.0]

    def worker(i: int) -> None:
        mv = [(ctypes.c_char * size).from_address(base_addr + i * size)]
        offs = (rng.integers(0, slots, OFFSETS_PER_SLOT, dtype=np.int64) * size).tolist()
        n = 0
        start.wait()
        end = deadline[0]
        now = time.perf_counter
        try:
            while True:
                if call(fd, mv, offs[n % OFFSETS_PER_SLOT]) != size:
                    raise OSError(f"short {op}")
                n += 1
                if now() >= end:
                    break
        except OSError as e:
            errors.append(str(e))
        counts[i] = n

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(qd)]
    for t in threads:
        t.start()
    with Stopwatch() as sw:
        deadline[0] = time.perf_counter() + cfg.duration
        start.wait()
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(f"preadv_threads {op}: {errors[0]}")
    ops = sum(counts)
    return sw.sample(ops * size, ops)


def run_fio(path: str, file_size: int, op: str, size: int, qd: int, huge: bool, cfg) -> Sample:
    cmd = [
        cfg.fio,
        "--name=bench",
        f"--filename={path}",
        f"--size={file_size}",
        f"--rw={'randread' if op == 'read' else 'randwrite'}",
        f"--bs={size}",
        f"--iodepth={qd}",
        "--ioengine=io_uring",
        "--direct=1",
        "--time_based",
        f"--runtime={max(1, int(cfg.duration * 1000))}ms",
        "--allow_file_create=0",
        "--randrepeat=0",
        "--norandommap",
        "--output-format=json",
    ]
    if huge:
        cmd += ["--iomem=shmhuge", "--hugepage-size=2m"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    runs = None
    if os.geteuid() == 0 and size > 4096 and qd * size >= (1 << 20):
        time.sleep(0.3 + cfg.duration / 2)  # fio's setup, then its buffer is faulted in
        for _ in range(5):
            runs = _fio_buffer_runs(proc.pid, qd * size, size)
            if runs is not None or proc.poll() is not None:
                break
            time.sleep(0.1)
    try:
        out, err = proc.communicate(timeout=cfg.duration * 10 + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    if proc.returncode != 0:
        msg = (err or out).strip().splitlines()
        raise Skip(f"fio exited {proc.returncode}: {msg[-1] if msg else ''}")
    if runs is not None:
        cfg.fio_runs.append(runs)
    text = out
    job = json.loads(text[text.index("{") :])["jobs"][0]  # fio may print warnings before the JSON
    side = job["read" if op == "read" else "write"]
    ops = int(side["total_ios"])
    runtime_s = job["job_runtime"] / 1000.0
    cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * runtime_s
    return Sample(nbytes=int(side["io_bytes"]), ops=ops, wall_s=side["runtime"] / 1000.0, cpu_s=cpu_s)


# -- driver ------------------------------------------------------------------------------------


async def bench(cfg) -> tuple[list[dict], list[str]]:
    notes: list[str] = []
    tmpdir = None
    if cfg.dir:
        os.makedirs(cfg.dir, exist_ok=True)
        directory = cfg.dir
    else:
        directory = tmpdir = tempfile.mkdtemp(prefix="umbp-bench-")
    path = os.path.join(directory, "bench_engine.dat")
    cfg.fio = shutil.which("fio")
    systems = list(cfg.systems)
    if not cfg.fio:
        notes.append("fio not on PATH: fio rows and vs_fio ratios skipped")
        systems = [s for s in systems if not s.startswith("fio")]
    buffers = list(cfg.buffers)
    max_bytes = max(cfg.qd) * max(cfg.sizes)
    huge = HugePages()
    want_huge = "huge" in buffers or "fio_huge" in systems
    if want_huge:
        # fio rounds its QD x bs buffer up to whole huge pages; the extra slack covers hugetlb
        # pages other processes on the machine take meanwhile (fio then fails with EFAULT).
        fio_bytes = (2 * max_bytes + 4 * HUGE_PAGE_BYTES) if "fio_huge" in systems else 0
        ok, why = huge.reserve((max_bytes if "huge" in buffers else 0) + fio_bytes + HUGE_PAGE_BYTES)
        if not ok:
            notes.append(f"huge buffers and fio_huge skipped: {why}")
            buffers = [b for b in buffers if b != "huge"]
            systems = [s for s in systems if s != "fio_huge"]
    mem = None
    engines: dict[str, object] = {}
    rows: list[dict] = []
    try:
        # Our buffers first, in a fresh address space like fio's: memory freed by writing the
        # test file would otherwise come back scattered (measured: 256 vs ~128 runs per MiB).
        mem = Memory(max_bytes, buffers, notes)
        t0 = time.perf_counter()
        make_test_file(path, cfg.file_size)
        notes.append(f"test file {path}: {cfg.file_size >> 20} MiB written in {time.perf_counter() - t0:.1f} s")
        data = open_data_file(path)
        if not data.direct:
            notes.append(f"O_DIRECT refused on {directory}: our systems run buffered, fio still asks for direct")
        await open_engines(cfg, systems, mem, engines, notes)
        for op in cfg.ops:
            for size in cfg.sizes:
                slots = cfg.file_size // size
                for qd in cfg.qd:
                    rows += await bench_cell(cfg, systems, mem, engines, data, path, op, size, qd, slots, notes)
        data.close()
    finally:
        for eng in engines.values():
            eng.close()
        if mem is not None:
            mem.close()
        huge.restore()
        if not cfg.keep_file:
            try:
                os.unlink(path)
            except OSError:
                pass
            if tmpdir:
                shutil.rmtree(tmpdir, ignore_errors=True)
    return rows, notes


async def open_engines(cfg, systems, mem: Memory, engines: dict, notes: list[str]) -> None:
    depth = max(256, max(cfg.qd))
    if "umbp_uring" in systems or "umbp_uring_fixed" in systems:
        for name in ("umbp_uring", "umbp_uring_fixed"):
            if name not in systems:
                continue
            eng = await open_engine("io_uring", queue_depth=depth)
            if eng.capabilities.name != "io_uring":
                eng.close()
                notes.append(f"{name}: skipped (io_uring engine unavailable; see the warning above)")
                continue
            if name == "umbp_uring_fixed":
                ranges = [(b.address, b.nbytes) for b in mem.bufs.values()]
                if not eng.register_buffers(ranges):
                    eng.close()
                    notes.append(f"{name}: skipped (buffer registration refused)")
                    continue
            engines[name] = eng
    if "umbp_posix" in systems:
        engines["umbp_posix"] = await open_engine("posix", queue_depth=max(cfg.qd), workers=max(cfg.qd))


def cell_duration(cfg, size: int, qd: int) -> float:
    return cfg.large_duration if size >= (1 << 20) and qd > 1 else cfg.duration


async def bench_cell(cfg, systems, mem, engines, data, path, op, size, qd, slots, notes) -> list[dict]:
    cfg = argparse.Namespace(**vars(cfg))
    cfg.duration = cell_duration(cfg, size, qd)
    fio_segs: dict[str, list[float]] = {"fio": [], "fio_huge": []}
    our_segs = {kind: phys_runs("self", buf.address, qd * size, size) for kind, buf in mem.bufs.items()}
    variants = []  # (label, system, buffers, thunk returning an awaitable or a Sample)
    for system in systems:
        if system in ("fio", "fio_huge"):
            is_huge = system == "fio_huge"
            variants.append(
                (system, system, "huge" if is_huge else "4k",
                 lambda h=is_huge: run_fio(path, cfg.file_size, op, size, qd, h, cfg))
            )
            continue
        for kind, buf in mem.bufs.items():
            label = f"{system}/{kind}"
            if system == "preadv_threads":
                fn = lambda a=buf.address: run_preadv_threads(data.fd, op, size, qd, a, slots, cfg)  # noqa: E731
            elif system in engines:
                eng = engines[system]
                fn = lambda e=eng, a=buf.address: run_engine(e, data, op, size, qd, a, slots, cfg)  # noqa: E731
            else:
                continue
            variants.append((label, system, kind, fn))
    samples: dict[str, list[Sample]] = {v[0]: [] for v in variants}
    dropped: set[str] = set()
    for _ in range(cfg.runs):  # alternate: A B C ... A B C ...
        for label, _system, _kind, fn in variants:
            if label in dropped:
                continue
            try:
                cfg.fio_runs = fio_segs.get(label, [])
                out = fn()
                if asyncio.iscoroutine(out):
                    out = await out
                samples[label].append(out)
            except Skip as e:
                dropped.add(label)
                notes.append(f"{label} {op} {size} B QD{qd}: skipped ({e})")
    rows = []
    for label, system, kind, _fn in variants:
        if not samples[label]:
            continue
        base = "fio_huge" if kind == "huge" else "fio"
        vs = None
        if not system.startswith("fio") and samples.get(base):
            vs = paired_ratio(samples[label], samples[base])
        pre = samples.get(f"preadv_threads/{kind}")
        vs_pre = paired_ratio(samples[label], pre) if pre and system != "preadv_threads" else None
        segs = fio_segs[system] if system.startswith("fio") else ([our_segs[kind]] if our_segs.get(kind) else [])
        seg_fields = {}
        if segs:
            seg_fields = {"phys_segs": statistics.median(segs), "phys_segs_min": min(segs), "phys_segs_max": max(segs)}
        rows.append(
            make_row(
                BENCH, system, op, size, qd, samples[label], buffers=kind, vs_fio=vs, vs_preadv_threads=vs_pre,
                duration_s=cfg.duration, **seg_fields,
            )
        )
    return rows


def main(argv=None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    rows, notes = asyncio.run(bench(cfg))
    print(
        f"engine benchmark: {len(rows)} rows, {cfg.runs} alternating runs x {cfg.duration:g} s "
        f"({cfg.large_duration:g} s for >= 1 MiB at QD > 1), load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
        f"file {cfg.file_size >> 20} MiB, {time.perf_counter() - started:.0f} s total"
    )
    print_table(rows, ratio_keys=("vs_fio", "vs_preadv_threads", "phys_segs"))
    finish(cfg, rows, notes, title="umbp_nvme engines vs fio (O_DIRECT, random)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
