"""What the backend costs SGLang's scheduler thread: ``get_stats()`` as the scheduler calls it on
every pass with storage metrics on (docs/sglang.md §2), and ``clear()``.

    umbp-nvme bench scheduler [--quick] [--dir DIR | --roots D0,D1,D2,D3] [--baseline-src DIR]
    python tools/bench_scheduler.py [same args]

For 1, 2 and 4 drives (``--drives``; separate directories under ``--dir``, or the mount points
``--roots`` names, e.g. fake-drives'), a child process (bench/sched_probe.py) runs each scenario
on a fresh backend loaded through SGLang's factory over its real MHA host pool, with storage
metrics on and Prometheus in multiprocess mode as under ``--enable-metrics``:

  idle          nothing else runs
  backups       a thread writes fresh 64-page batches with batch_set_v1 back to back (evicting
                once the store is full)
  hung          the same, with the last drive's I/O never completing (an engine hook, as io_uring
                sees a stalled drive; with ``--stall-tool`` fake-drives stalls it in the kernel);
                the drive is degraded after io_timeout_s (1 s here)
  loop_blocked  the same, with the hook blocking the store's event-loop thread itself

and times ``--calls`` get_stats() calls on its main thread, one every ``--interval-s`` (the rest
of a scheduler pass sleeps, releasing the GIL as a wait for the GPU does; at most 15 s of calls
per cell: a call that waits for a blocked loop takes its whole timeout), then ``clear()``. Between
two calls the same timing around a call that does nothing is taken (``floor_*``): what the machine
itself adds under the same load (preemption, other threads, garbage collections). A call over 1 ms
is explained: its thread CPU time (the rest it was off the CPU) and any collection it overlapped.
p50 / p99 / max per cell are medians over ``--rounds`` (max: the worst round too).
``--baseline-src DIR`` runs the same probe file against another checkout's ``umbp_nvme`` (e.g.
/work/main) in the same rounds, alternating which goes first, and adds ``vs_baseline_p50`` / ``_p99`` / ``_max`` (this / baseline, median of per-round ratios).
Goals (issue 39): p50 <= 10 us, p99 <= 50 us, max <= 1 ms in every cell, none waiting on the
hung drive. Rows: bench "scheduler", system ("this" | "baseline"), op, drives, scenario, p50_us,
p99_us, max_us, max_us_worst, floor_p50_us / _p99_us / _max_us, calls, first_us, clear_ms,
open_ms (construct and register: the store opens), close_ms, slow_calls (slow_in_gc,
slow_off_cpu, slow_max_cpu_us), runs, backup_pages_ok, pages_reported_ok (the pages get_stats()
reported equal those the backups acknowledged, every round).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

from .common import WorkDir, finish
from .sched_probe import SCENARIOS

BENCH = "scheduler"
PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sched_probe.py")
THIS_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds umbp_nvme/
SHIMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_shims")
GOALS_US = {"p50_us": 10.0, "p99_us": 50.0, "max_us": 1000.0}
# runs the probe file with sys.path[0] = the cwd (a temp dir), not bench/ (whose module names,
# trace.py among them, would shadow others)
_RUN_PROBE = "import runpy, sys; sys.argv = [sys.argv[0]] + sys.argv[1:]; runpy.run_path({path!r}, run_name='__main__')"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="umbp-nvme bench scheduler", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", help="where the drives' directories go (default umbp-bench-scheduler in the temp "
                   "dir); what the run makes there is removed at the end unless --keep")
    p.add_argument("--roots", help="one directory per drive, comma-separated (e.g. fake-drives' mount points); "
                   "N drives use the first N")
    p.add_argument("--keep", action="store_true", help="keep what the run wrote in --dir")
    p.add_argument("--drives", default="1,2,4", help="drive counts, comma-separated (default 1,2,4)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {', '.join(SCENARIOS)}")
    p.add_argument("--calls", type=int, default=0, help="get_stats() calls per cell (default 2000, --quick 1000)")
    p.add_argument("--interval-s", type=float, default=0.0005, help="sleep between two calls (default 0.0005)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 3, --quick 1)")
    p.add_argument("--stall-tool", help="hung: stall the drive with fake-drives (this tool) instead of the engine "
                   "hook; --roots must be its mount points d0, d1, ... in order, and the run inside `fake-drives run`")
    p.add_argument("--baseline-src", help="another checkout (the directory holding its umbp_nvme/), measured "
                   "beside this one in the same rounds")
    p.add_argument("--quick", action="store_true", help="1 round of 1000 calls")
    p.add_argument("--smoke", action="store_true", help="tiny run in a temp dir (tests)")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("-v", "--verbose", action="store_true", help="the children's store log lines")
    cfg = p.parse_args(argv)
    cfg.plot = None
    cfg.drive_counts = [int(x) for x in cfg.drives.split(",") if x.strip()]
    if not cfg.drive_counts or min(cfg.drive_counts) < 1:
        p.error(f"--drives takes positive counts, got {cfg.drives!r}")
    cfg.scenario_list = [x.strip() for x in cfg.scenarios.split(",") if x.strip()]
    bad = [x for x in cfg.scenario_list if x not in SCENARIOS]
    if bad:
        p.error(f"unknown scenario(s) {', '.join(bad)}; expected some of {', '.join(SCENARIOS)}")
    cfg.root_list = [r for r in (cfg.roots or "").split(",") if r]
    if cfg.roots and len(cfg.root_list) < max(cfg.drive_counts):
        p.error(f"--roots names {len(cfg.root_list)} directories; --drives asks for {max(cfg.drive_counts)}")
    if cfg.stall_tool and not cfg.roots:
        p.error("--stall-tool needs --roots: fake-drives' mount points d0, d1, ... in order")
    if cfg.baseline_src and not os.path.isfile(os.path.join(cfg.baseline_src, "umbp_nvme", "__init__.py")):
        p.error(f"--baseline-src {cfg.baseline_src}: no umbp_nvme/ package there (give the checkout's root)")
    cfg.calls = cfg.calls or (50 if cfg.smoke else 1000 if cfg.quick else 2000)
    cfg.rounds = cfg.rounds or (1 if cfg.quick or cfg.smoke else 3)
    return cfg


def _env(src: str, prom_dir: str) -> dict:
    """The child's environment: ``src``'s umbp_nvme first on the path, Prometheus multiprocess."""
    env = dict(os.environ)
    rest = [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q and os.path.abspath(q) != THIS_SRC]
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(src), SHIMS_DIR] + rest)
    env["PROMETHEUS_MULTIPROC_DIR"] = prom_dir  # what SGLang's --enable-metrics sets: the push thread runs
    return env


def run_probe(cfg, src: str, roots: list[str], tmp: str) -> list[dict]:
    """One child: every scenario for one drive count, against ``src``'s umbp_nvme."""
    out = os.path.join(tmp, "probe.json")
    prom = tempfile.mkdtemp(prefix="prom-", dir=tmp)
    args = ["--roots", ",".join(roots), "--scenarios", ",".join(cfg.scenario_list), "--calls", str(cfg.calls),
            "--interval-s", str(cfg.interval_s), "--json", out] + (["-v"] if cfg.verbose else [])  # fmt: skip
    if cfg.smoke:
        args += ["--settle-s", "0.1", "--clears", "1", "--cell-s", "5"]
    if cfg.stall_tool:
        args += ["--stall-tool", cfg.stall_tool]
    r = subprocess.run([sys.executable, "-c", _RUN_PROBE.format(path=PROBE)] + args, env=_env(src, prom), cwd=tmp,
                       capture_output=not cfg.verbose, text=True, timeout=1800)  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"probe against {src} failed (exit {r.returncode}): {(r.stderr or '')[-2000:]}")
    with open(out) as f:
        got = json.load(f)
    if os.path.realpath(got["umbp_nvme"]) != os.path.realpath(os.path.join(src, "umbp_nvme")):
        raise RuntimeError(f"the probe imported {got['umbp_nvme']}, not {src}/umbp_nvme: check PYTHONPATH")
    return got["cells"]


def _drive_dirs(cfg, base: str, n: int) -> list[str]:
    dirs = [os.path.join(r, "umbp-bench-scheduler") for r in cfg.root_list[:n]] if cfg.root_list else [
        os.path.join(base, f"drive{i}") for i in range(n)]  # fmt: skip
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    return dirs


def _ratio(a: list[dict], b: list[dict], key: str) -> float | None:
    rs = [x[key] / y[key] for x, y in zip(a, b) if y[key] > 0]
    return round(statistics.median(rs), 3) if rs else None


def make_rows(cells: dict) -> list[dict]:
    """cells: (system, drives, scenario) -> one probe cell per round."""
    rows = []
    for (system, n, scenario), runs in sorted(cells.items()):
        row = {"bench": BENCH, "system": system, "op": "get_stats", "drives": n, "scenario": scenario, "runs": len(runs)}
        for k in ("p50_us", "p99_us", "max_us", "first_us"):
            row[k] = round(statistics.median(c[k] for c in runs), 1)
        row["max_us_worst"] = round(max(c["max_us"] for c in runs), 1)
        for k in ("floor_p50_us", "floor_p99_us", "floor_max_us"):  # a no-op timed between the calls
            row[k] = round(statistics.median(c[k] for c in runs), 1)
        row["floor_max_us_worst"] = round(max(c["floor_max_us"] for c in runs), 1)
        row["calls"] = min(c["calls"] for c in runs)
        row["first_in_process_us"] = round(max((c["first_us"] for c in runs if c["first_in_process"]), default=0), 1)
        clears = [x for c in runs for x in c["clear_us"]]
        row["clear_ms"] = round(statistics.median(clears) / 1e3, 1) if clears else None
        row["clear_ms_max"] = round(max(clears) / 1e3, 1) if clears else None
        row["drive_rows"] = min(c["drive_rows"] for c in runs)
        row["open_ms"] = round(statistics.median(c["open_s"] for c in runs) * 1e3, 1)  # construct + register
        row["close_ms"] = round(statistics.median(c["close_s"] for c in runs) * 1e3, 1)
        slow = [x for c in runs for x in c.get("slow", [])]
        row["slow_calls"] = len(slow)  # over 1 ms, all rounds
        row["slow_off_cpu"] = sum(1 for x in slow if x["cpu_us"] < 0.5 * x["wall_us"] and not x["gc"])
        row["slow_in_gc"] = sum(1 for x in slow if x["gc"])
        row["slow_max_cpu_us"] = max((x["cpu_us"] for x in slow), default=None)
        row["backup_pages_ok"] = sum(c["backup_pages_ok"] for c in runs)
        row["pages_reported_ok"] = all(c["backup_pages_reported"] == c["backup_pages_ok"] for c in runs)
        row["hang_met"] = all(c["hang_met"] for c in runs) if scenario in ("hung", "loop_blocked") else None
        row["last_drive_degraded"] = all(c.get("last_drive_degraded") for c in runs)  # seen in get_stats().drives
        base = cells.get(("baseline", n, scenario))
        if system == "this" and base:
            for k in ("p50_us", "p99_us", "max_us"):
                row[f"vs_baseline_{k[:-3]}"] = _ratio(runs, base, k)
        rows.append(row)
    return rows


def print_rows(rows: list[dict]) -> None:
    head = ["drives", "scenario", "system", "p50 us", "p99 us", "max us (worst)", "no-op p50/p99/max (worst)",
            "first us", "clear ms (max)", "rows", "vs base p50/p99/max"]  # fmt: skip
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["drives"], SCENARIOS.index(r["scenario"]), r["system"] != "baseline")):
        vs = "/".join("" if r.get(f"vs_baseline_{k}") is None else f"{r[f'vs_baseline_{k}']:.3g}" for k in ("p50", "p99", "max"))
        lines.append([str(r["drives"]), r["scenario"], r["system"], f"{r['p50_us']:.1f}", f"{r['p99_us']:.1f}",
                      f"{r['max_us']:.0f} ({r['max_us_worst']:.0f})",
                      f"{r['floor_p50_us']:.1f}/{r['floor_p99_us']:.1f}/{r['floor_max_us']:.0f} ({r['floor_max_us_worst']:.0f})",
                      f"{r['first_us']:.0f}",
                      "" if r["clear_ms"] is None else f"{r['clear_ms']:.1f} ({r['clear_ms_max']:.1f})",
                      str(r["drive_rows"]), vs if vs.strip("/") else ""])  # fmt: skip
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())


def targets(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if r["system"] != "this":
            continue
        worst = {k: r["max_us_worst"] if k == "max_us" else r[k] for k in GOALS_US}
        met = all(worst[k] <= g for k, g in GOALS_US.items())
        out.append(f"get_stats {r['drives']} drive(s) {r['scenario']}: p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us, "
                   f"max {r['max_us_worst']:.0f} us (target p50 <= 10, p99 <= 50, max <= 1000 us) "
                   f"{'MET' if met else 'NOT MET'}")  # fmt: skip
    return out


def main(argv=None) -> int:
    cfg = parse_args(argv)
    work = WorkDir(cfg, os.path.join(tempfile.gettempdir(), "umbp-bench-scheduler"), "umbp-sched-", "bench scheduler")
    systems = [("this", THIS_SRC)] + ([("baseline", cfg.baseline_src)] if cfg.baseline_src else [])
    cells: dict = {}
    notes = [f"get_stats() once every {cfg.interval_s * 1e3:g} ms, {cfg.calls} calls per cell; io_timeout_s 1 s; "
             "clear() after them (once where a drive hangs)"]  # fmt: skip
    try:
        with tempfile.TemporaryDirectory(prefix="umbp-sched-run-") as tmp:
            for rnd in range(cfg.rounds):
                order = systems if rnd % 2 == 0 else systems[::-1]
                for n in cfg.drive_counts:
                    for system, src in order:
                        print(f"bench scheduler: round {rnd + 1}/{cfg.rounds}, {n} drive(s), {system} ({src})", flush=True)
                        for c in run_probe(cfg, src, _drive_dirs(cfg, work.path, n), tmp):
                            cells.setdefault((system, n, c["scenario"]), []).append(c)
    finally:
        work.cleanup()
        for r in cfg.root_list:  # the probe removed what it wrote inside
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(r, "umbp-bench-scheduler"))
    rows = make_rows(cells)
    print_rows(rows)
    for system in ("this", "baseline"):
        mine = [r for r in rows if r["system"] == system]
        n_slow = sum(r["slow_calls"] for r in mine)
        if mine and n_slow:
            cpu = max(r["slow_max_cpu_us"] for r in mine if r["slow_max_cpu_us"] is not None)
            notes.append(f"{system}: {n_slow} of {sum(r['calls'] * r['runs'] for r in mine)} calls over 1 ms; "
                         f"{sum(r['slow_in_gc'] for r in mine)} overlapped a garbage collection, "
                         f"{sum(r['slow_off_cpu'] for r in mine)} others were mostly off the CPU (preempted, or "
                         f"waiting for the GIL); the most CPU one of them used: {cpu:.0f} us")  # fmt: skip
    bad = [r for r in rows if not r["pages_reported_ok"]]
    if bad:
        notes.append("pages reported by get_stats() differ from those acknowledged in: " +
                     ", ".join(f"{r['system']} {r['drives']} drives {r['scenario']}" for r in bad))  # fmt: skip
    finish(cfg, rows, notes, targets=targets(rows), source="issue 39")
    return 0


if __name__ == "__main__":
    sys.exit(main())
