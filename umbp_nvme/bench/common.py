"""Shared pieces of the benchmarks (umbp_nvme.bench: engine, store, hicache, gds).

* ``Sample`` — one timed measurement; ``Stopwatch`` times wall and process CPU (all threads of
  the process, io_uring io-wq workers included: they are threads of our thread group).
* ``run_alternating`` — runs systems A B C A B C ... so slow drift of a noisy disk hits all of
  them alike; a system that raises ``Skip`` is dropped from later rounds with a note.
* ``make_row`` / ``paired_ratio`` — the row format every benchmark writes (medians, min, max) and
  ratios taken round by round against a baseline measured in the same round.
* ``print_table``, ``write_json``, ``plot`` (matplotlib imported lazily); ``finish`` prints the
  targets and notes and writes --json / --plot the way every benchmark's main() ends.
* ``check_buffers`` — the --buffers validation the benchmarks share; ``WorkDir`` (--dir or the
  default: says where it writes, removes what the run made unless --keep; ``bench_dir`` is the
  older form); ``drop_caches`` (root); ``as_info`` (a deliberate fault measured: its log at INFO).

Row format (JSON list of dicts): bench, system, op, object_bytes, queue_depth, gbps (GB/s,
1e9 bytes), iops, cpu_us_per_op, runs, plus buffers, *_min/*_max and optional vs_* ratios.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from umbp_nvme.sglang.keys import KeyScheme


def page_keys(tag: str, pages: int, start: int = 0) -> list[str]:
    """v1 object keys as the backend composes them (keys.KeyScheme, TP rank 0 MHA: K and V per
    page), page hashes made from ``tag``."""
    hashes = [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(start, start + pages)]
    return KeyScheme().v1_keys(hashes)


class Skip(Exception):
    """A system cannot run in this configuration (the message says why)."""


@dataclass(frozen=True)
class Sample:
    nbytes: int  # payload bytes moved
    ops: int
    wall_s: float
    cpu_s: float  # process CPU time (user + sys) over the same window

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    @property
    def iops(self) -> float:
        return self.ops / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_us_per_op(self) -> float:
        return self.cpu_s / self.ops * 1e6 if self.ops else 0.0


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.wall_s``, ``sw.cpu_s``."""

    def __enter__(self):
        self._w0 = time.perf_counter()
        self._c0 = time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall_s = time.perf_counter() - self._w0
        self.cpu_s = time.process_time() - self._c0

    def sample(self, nbytes: int, ops: int) -> Sample:
        return Sample(nbytes=nbytes, ops=ops, wall_s=self.wall_s, cpu_s=self.cpu_s)


def run_alternating(
    systems: list[tuple[str, Callable[[], Sample]]], runs: int, *, notes: list[str] | None = None
) -> dict[str, list[Sample]]:
    """Run each system once per round, in the same order every round; returns samples per name."""
    out: dict[str, list[Sample]] = {name: [] for name, _ in systems}
    skipped: set[str] = set()
    for _ in range(runs):
        for name, fn in systems:
            if name in skipped:
                continue
            try:
                out[name].append(fn())
            except Skip as e:
                skipped.add(name)
                if notes is not None:
                    notes.append(f"{name}: skipped ({e})")
    return {k: v for k, v in out.items() if v}


def _stats(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def make_row(
    bench: str, system: str, op: str, object_bytes: int, queue_depth: int, samples: list[Sample], **extra
) -> dict:
    """One table row: medians over samples with min and max."""
    if not samples:
        raise ValueError(f"no samples for {system} {op} {object_bytes} B QD{queue_depth}")
    row = {
        "bench": bench,
        "system": system,
        "op": op,
        "object_bytes": int(object_bytes),
        "queue_depth": int(queue_depth),
        "runs": len(samples),
    }
    for key in ("gbps", "iops", "cpu_us_per_op"):
        med, lo, hi = _stats([getattr(s, key) for s in samples])
        row[key], row[f"{key}_min"], row[f"{key}_max"] = med, lo, hi
    row.update(extra)
    return row


def paired_ratio(samples: list[Sample], baseline: list[Sample], key: str = "gbps") -> float | None:
    """Median over rounds of samples[i].key / baseline[i].key (same round, so drift cancels)."""
    ratios = [getattr(a, key) / getattr(b, key) for a, b in zip(samples, baseline) if getattr(b, key) > 0]
    return statistics.median(ratios) if ratios else None


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """'4k', '64KiB', '1m', '4M', '1g', '4096' -> bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in "kmg" else t
    try:
        value = float(digits) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4k, 64k, 1m, 4m)") from None
    return int(value)


def _span(row: dict, key: str, fmt: str) -> str:
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    s = format(row[key], fmt)
    if lo is not None and hi is not None and row.get("runs", 1) > 1:
        s += f" [{format(lo, fmt)}-{format(hi, fmt)}]"
    return s


def print_table(rows: Iterable[dict], *, ratio_keys: tuple[str, ...] = (), file=None) -> None:
    """Medians with [min-max] per row, grouped by (op, size, queue depth)."""
    rows = sorted(
        rows, key=lambda r: (r["op"], r["object_bytes"], r["queue_depth"], r.get("buffers", ""), r["system"])
    )
    header = ["op", "size", "QD", "system", "buffers", "GB/s med [min-max]", "kIOPS", "CPU us/op med [min-max]"]
    header += list(ratio_keys)
    lines = [header]
    for r in rows:
        line = [
            r["op"],
            fmt_bytes(r["object_bytes"]),
            str(r["queue_depth"]),
            r["system"],
            r.get("buffers", ""),
            _span(r, "gbps", ".2f"),
            format(r["iops"] / 1e3, ".1f"),
            _span(r, "cpu_us_per_op", ".1f"),
        ]
        line += ["" if r.get(k) is None else format(r[k], ".2f") for k in ratio_keys]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    prev = None
    for i, line in enumerate(lines):
        group = tuple(line[:3])
        if i > 1 and group != prev:
            print("", file=file)
        prev = group
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip(), file=file)


def bench_dir(cfg, default: str, prefix: str) -> tuple[str, str | None]:
    """(directory, tmpdir): --dir, else a fresh temp dir for --smoke (tmpdir: remove it after),
    else the benchmark's default directory; created if missing."""
    tmpdir = None
    if cfg.dir:
        directory = cfg.dir
    elif cfg.smoke:
        directory = tmpdir = tempfile.mkdtemp(prefix=prefix)
    else:
        directory = default
    os.makedirs(directory, exist_ok=True)
    return directory, tmpdir


def kept_store(path: str, marker: str, want: dict) -> dict | None:
    """The marker a kept bench store left in ``path`` when it was made as ``want`` says, else None
    (the caller rebuilds it)."""
    try:
        with open(os.path.join(path, marker)) as f:
            have = json.load(f)
    except (OSError, ValueError):
        return None
    return have if isinstance(have, dict) and all(have.get(k) == v for k, v in want.items()) else None


def check_buffers(parser, buffers: Iterable[str]) -> None:
    """--buffers takes memory kinds 4k and/or huge; anything else is a usage error."""
    for b in buffers:
        if b not in ("4k", "huge"):
            parser.error(f"unknown buffers {b!r}; expected 4k and/or huge")


class WorkDir:
    """Where a benchmark writes: ``--dir``, else ``default`` (a fresh temp dir for --smoke).

    Says where on stdout when made. ``cleanup()`` removes what this run made there: the whole
    directory when the run created it, else only the entries that were not there before (an
    earlier ``--keep`` run's reopen store is reused, not removed). ``--keep`` keeps everything.
    """

    def __init__(self, cfg, default: str, prefix: str, name: str):
        self.keep = bool(getattr(cfg, "keep", False))
        given = getattr(cfg, "dir", None)
        if not given and getattr(cfg, "smoke", False):
            self.path, self.made = tempfile.mkdtemp(prefix=prefix), True
        else:
            self.path = os.path.abspath(os.path.expanduser(given or default))
            if os.path.exists(self.path) and not os.path.isdir(self.path):
                raise SystemExit(f"{name}: --dir {self.path} is a file; give a directory (it is created if missing)")
            self.made = not os.path.exists(self.path)
            os.makedirs(self.path, exist_ok=True)
        self.before = set(os.listdir(self.path))
        then = "kept (--keep)" if self.keep else "what this run makes there is removed at the end (--keep keeps it)"
        print(f"{name}: writing under {self.path}; {then}", flush=True)

    def cleanup(self) -> None:
        if self.keep:
            return
        if self.made:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for entry in set(os.listdir(self.path)) - self.before:
            p = os.path.join(self.path, entry)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(p)


class _AsInfo(logging.Filter):
    def __init__(self, log: logging.Logger):
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            record.levelno, record.levelname = logging.INFO, "INFO"
        return self.log.isEnabledFor(logging.INFO)  # the level was checked before the filter ran


@contextlib.contextmanager
def as_info(logger_name: str = "umbp_nvme.store"):
    """Log records of ``logger_name`` at INFO while a benchmark causes on purpose what the store
    reports as a problem (a deleted index it rebuilds): shown with -v, never as an ERROR."""
    log = logging.getLogger(logger_name)
    f = _AsInfo(log)
    log.addFilter(f)
    try:
        yield
    finally:
        log.removeFilter(f)


_VERDICT = re.compile(r"\bNOT MET\b|\bMET\b", re.I)


def target_line(line: str, source: str = "") -> str:
    """A benchmark's own goal, labelled as one (never read as a test failure):
    'x = 0.8 (target >= 0.9) NOT MET' -> 'bench target (issue 12): x = 0.8 (goal >= 0.9) below'."""
    body = line.replace("(target", "(goal").replace("; target", "; goal")
    body = _VERDICT.sub(lambda m: "below" if m.group(0).upper() == "NOT MET" else "met", body)
    return f"bench target{f' ({source})' if source else ''}: {body}"


def finish(cfg, rows: list[dict], notes: Iterable[str], *, targets: Iterable[str] = (),
           plot_rows: list[dict] | None = None, title: str = "", source: str = "") -> None:
    """The end of every benchmark's main(): target and note lines, then --json and --plot.
    ``source``: where the targets come from (e.g. "issue 13"), printed with each."""
    for line in targets:
        print(target_line(line, source))
    for note in notes:
        print("note:", note)
    if cfg.json:
        write_json(rows, cfg.json)
        print(f"wrote {cfg.json}")
    if cfg.plot and plot(rows if plot_rows is None else plot_rows, cfg.plot, title=title):
        print(f"wrote {cfg.plot}")


def drop_caches() -> bool:
    """Drop the page cache (root only) so reads come from the disk; False when not allowed."""
    if os.geteuid() != 0:
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


def plot(rows: list[dict], path: str, *, title: str = "") -> bool:
    """GB/s against object size, one panel per (op, queue depth). False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed; no plot written to {path} (pip install matplotlib)")
        return False
    ops = sorted({r["op"] for r in rows})
    qds = sorted({r["queue_depth"] for r in rows})
    fig, axes = plt.subplots(len(ops), len(qds), figsize=(4.5 * len(qds), 3.5 * len(ops)), squeeze=False)
    for i, op in enumerate(ops):
        for j, qd in enumerate(qds):
            ax = axes[i][j]
            series: dict[str, list[dict]] = {}
            for r in rows:
                if r["op"] == op and r["queue_depth"] == qd:
                    label = r["system"] + (f" ({r['buffers']})" if r.get("buffers") else "")
                    series.setdefault(label, []).append(r)
            for label, rs in sorted(series.items()):
                rs.sort(key=lambda r: r["object_bytes"])
                xs = [r["object_bytes"] for r in rs]
                ax.errorbar(
                    xs,
                    [r["gbps"] for r in rs],
                    yerr=[
                        [r["gbps"] - r.get("gbps_min", r["gbps"]) for r in rs],
                        [r.get("gbps_max", r["gbps"]) - r["gbps"] for r in rs],
                    ],
                    marker="o",
                    capsize=2,
                    label=label,
                    linestyle="--" if "huge" in label else "-",
                )
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op} QD{qd}")
            ax.set_xlabel("object bytes")
            ax.set_ylabel("GB/s")
            ax.grid(True, alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
