#!/usr/bin/env python3
"""Mutation report for the pure-logic modules (`make mutation`; issue 17).

Tool: mutmut 3 (pip extra `mutation`). For each module it copies the package and the tests
into build/mutation/<module>/, appends a [mutmut] section to the copy's setup.cfg that
mutates only that module and selects that module's tests, runs `mutmut run` with one worker,
and reads the verdicts. Survivors listed in tools/mutation/equivalents.md (with a reason) are
judged equivalent; the score is killed / (mutants - equivalents). Writes
tools/mutation/report.md and exits 1 when a module is under its target or a survivor is
neither killed nor listed.

    python tools/mutation/run.py [keys hits config config_values segments] [--jobs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tools" / "mutation"
WORK = ROOT / "build" / "mutation"

# The SGLang backend tests (real 0.5.23 wheel) also exercise keys and hits; --with-sglang adds
# them. Off by default: they need tools/install_sglang.sh and make each mutant ~3x slower (their
# fixtures start stores and threads), and the unit and contract tests kill the same mutants.
SGLANG_TESTS = ["tests/sglang/test_backend_on_real_wheel.py", "tests/sglang/test_split_heads_envelopes_groups.py"]
# module -> (target score, tests run against its mutants)
MODULES: dict[str, tuple[float, list[str]]] = {
    "keys": (0.95, ["tests/sglang/test_key_formats.py", "tests/sglang/test_key_contract.py"]),
    "hits": (0.95, ["tests/sglang/test_prefix_hits.py", "tests/sglang/test_prefix_hits_contract.py"]),
    "config": (0.90, ["tests/store/test_config_layering.py", "tests/store/test_config_contract.py"]),
    # the value parsers config.py used to hold (issue 35 split them out); the same tests
    "config_values": (0.90, ["tests/store/test_config_layering.py", "tests/store/test_config_contract.py"]),
    "segments": (0.90, ["tests/store/test_segment_allocator.py", "tests/store/test_allocator_contract.py"]),
}

# where each module lives under umbp_nvme/ (the allocator in the store package, keys and hits in the SGLang adapter)
PATHS = {"segments": "store/segments", "keys": "sglang/keys", "hits": "sglang/hits"}

# mutmut statuses that count as detected; "survived", "no tests", "not checked" ... do not.
# Mutants outside the scored part of a module (reported, not scored): segments.py's SegmentFiles
# opens and preallocates files; the store tests cover it, the allocator tests do not.
OUT_OF_SCOPE = {"segments": re.compile(r"xǁSegmentFilesǁ")}

# The tests each module had before issue 17 (for --baseline: what the new tests added).
BASELINE_TESTS = {
    "keys": ["tests/sglang/test_key_formats.py"],
    "hits": ["tests/sglang/test_prefix_hits.py"],
    "config": ["tests/store/test_config_layering.py"],
    "config_values": ["tests/store/test_config_layering.py"],
    "segments": ["tests/store/test_segment_allocator.py"],
}

KILLED = {"killed", "timeout", "segfault", "suspicious", "caught by type check"}


def equivalents() -> dict[str, str]:
    """mutant name -> reason, from the `- `name`: reason` lines of equivalents.md."""
    out = {}
    path = HERE / "equivalents.md"
    if path.exists():
        for line in path.read_text().splitlines():
            m = re.match(r"^- `([^`]+)`:?\s*(.*)$", line.strip())
            if m:
                out[m.group(1)] = m.group(2)
    return out


def prepare(module: str, tests: list[str]) -> Path:
    work = WORK / module
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis")
    shutil.copytree(ROOT / "umbp_nvme", work / "umbp_nvme", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    cfg = (ROOT / "setup.cfg").read_text()
    cfg += "\n[mutmut]\nsource_paths = umbp_nvme\n"
    cfg += f"only_mutate = umbp_nvme/{PATHS.get(module, module)}.py\n"
    cfg += "pytest_add_cli_args_test_selection =\n" + "".join(f"    {t}\n" for t in tests if (ROOT / t).exists())
    cfg += "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n    -p\n    no:randomly\n"
    cfg += "use_git_change_detection = false\n"
    # A mutant that loops forever is stopped at 5x its tests' normal time (mutmut's default
    # is 15x; a hypothesis test under an endless-loop mutant would hold the run for minutes).
    cfg += "timeout_multiplier = 5.0\n"
    # The SGLang backend tests start threads (the store's event loop, controller threads); a
    # worker forked from that process can inherit a held lock and hang. A fork server that only
    # collected the tests forks clean workers.
    cfg += "process_isolation = forkserver\n"
    (work / "setup.cfg").write_text(cfg)
    return work


def verdicts(work: Path, module: str) -> dict[str, str]:
    """mutant name -> mutmut's status ("killed", "survived", "timeout", ...), from its .meta file."""
    from mutmut.stats import status_by_exit_code

    meta = work / "mutants" / "umbp_nvme" / f"{PATHS.get(module, module)}.py.meta"
    data = json.loads(meta.read_text())
    return {name: status_by_exit_code[code] for name, code in data["exit_code_by_key"].items()}


def run_module(module: str, jobs: int, with_sglang: bool) -> dict:
    target, tests = MODULES[module]
    if with_sglang and module in ("keys", "hits"):
        tests = tests + SGLANG_TESTS
    work = prepare(module, tests)
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seconds = time.monotonic() - t0
    (work / "mutmut.log").write_text(proc.stdout)
    if proc.returncode != 0:
        # e.g. the selected tests fail on the unmutated code: mutmut stops before checking any
        # mutant, and scoring its "not checked" verdicts would report every mutant as a survivor
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip() and not ln.lstrip().startswith(tuple("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"))]
        raise RuntimeError(f"mutmut run exited {proc.returncode}: {lines[-1] if lines else '(no output)'} (log: {work / 'mutmut.log'})")
    row = score(module, work, seconds, tests)
    row["jobs"] = jobs
    return row


def score(module: str, work: Path, seconds: float, tests: list[str]) -> dict:
    target = MODULES[module][0]
    result = verdicts(work, module)
    skip = OUT_OF_SCOPE.get(module)
    out_of_scope = {n: v for n, v in result.items() if skip and skip.search(n)}
    result = {n: v for n, v in result.items() if n not in out_of_scope}
    equiv = equivalents()
    survived = sorted(n for n, s in result.items() if s not in KILLED)
    listed = [n for n in survived if n in equiv]
    unexplained = [n for n in survived if n not in equiv]
    killed = sum(1 for s in result.values() if s in KILLED)
    scored = len(result) - len(listed)
    value = killed / scored if scored else 1.0
    return dict(
        module=module,
        target=target,
        mutants=len(result),
        killed=killed,
        survived=len(survived),
        equivalent=len(listed),
        unexplained=unexplained,
        score=value,
        seconds=seconds,
        tests=tests,
        out_of_scope=len(out_of_scope),
        out_of_scope_killed=sum(1 for v in out_of_scope.values() if v in KILLED),
        work=work,
    )


def diff_of(work: Path, name: str) -> str:
    p = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, capture_output=True, text=True)
    return p.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", default=list(MODULES))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--report", default=str(HERE / "report.md"))
    ap.add_argument("--with-sglang", action="store_true", help="also run the SGLang backend tests on keys/hits mutants")
    ap.add_argument(
        "--rescore", action="store_true", help="re-read the last run's verdicts (after editing equivalents.md); run nothing"
    )
    ap.add_argument("--baseline", action="store_true", help="only the pre-issue-17 tests; build/mutation-baseline, baseline.md")
    args = ap.parse_args()
    global WORK
    if args.baseline:
        WORK = ROOT / "build" / "mutation-baseline"
        for m in MODULES:
            MODULES[m] = (MODULES[m][0], BASELINE_TESTS[m])
        if args.report == str(HERE / "report.md"):
            args.report = str(HERE / "baseline.md")
    errors: dict[str, str] = {}
    for module in args.modules:
        if args.rescore:
            old = json.loads((WORK / module / "result.json").read_text())
            row = score(module, WORK / module, old["seconds"], old["tests"])
            row["finished"] = old["finished"]
        else:
            print(f"== mutating umbp_nvme/{PATHS.get(module, module)}.py", flush=True)
            try:
                row = run_module(module, args.jobs, args.with_sglang)
            except RuntimeError as e:  # no result.json: the report says the module was not measured
                print(f"   FAILED: {e}", flush=True)
                errors[module] = str(e)
                continue
            row["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        row["diffs"] = {name: diff_of(row["work"], name) for name in row["unexplained"]}
        row["work"] = str(row["work"])
        (WORK / module / "result.json").write_text(json.dumps(row, indent=1))
        print(
            f"   {row['mutants']} mutants, {row['killed']} killed, {row['survived']} survived "
            f"({row['equivalent']} listed equivalent), score {row['score']:.1%} in {row['seconds']:.0f} s",
            flush=True,
        )
    # The report covers every module's latest run (so one module can be re-run alone).
    rows = []
    for module in MODULES:
        path = WORK / module / "result.json"
        if path.exists():
            rows.append(json.loads(path.read_text()))
    total = sum(r["seconds"] for r in rows)
    lines = [
        "# Mutation report",
        "",
        f"`make mutation` (tools/mutation/run.py, mutmut {_mutmut_version()}, "
        f"{'/'.join(sorted({str(r.get('jobs', 1)) for r in rows}))} worker(s)): "
        f"{total / 60:.1f} min for the modules below. Score = killed / (mutants - listed equivalents); "
        "timeouts count as killed. Equivalent survivors and their reasons: tools/mutation/equivalents.md.",
        "",
        "| module | mutants | killed | survived | listed equivalent | unexplained | score | target | time | run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    failed = bool(errors)
    for r in rows:
        ok = r["score"] >= r["target"] and not r["unexplained"]
        failed |= not ok
        lines.append(
            f"| `{r['module']}.py` | {r['mutants']} | {r['killed']} | {r['survived']} | {r['equivalent']} | "
            f"{len(r['unexplained'])} | {r['score']:.1%} | {r['target']:.0%} | {r['seconds']:.0f} s | {r['finished']} |"
        )
    for module, err in errors.items():
        lines.append(f"| `{module}.py` | not measured: the run failed (below) | | | | | | {MODULES[module][0]:.0%} | | |")
    lines.append("")
    for module, err in errors.items():
        lines.append(f"- `{module}.py` run failed: {err}")
    for r in rows:
        lines.append(f"- `{r['module']}.py` mutants run against: {', '.join(r['tests'])}")
    for r in rows:
        if r.get("out_of_scope"):
            lines.append(
                f"\n`{r['module']}.py` also has {r['out_of_scope']} mutants in code outside the scored part "
                f"({OUT_OF_SCOPE[r['module']].pattern}); the selected tests kill {r['out_of_scope_killed']} of them."
            )
    for r in rows:
        if r["unexplained"]:
            lines += ["", f"## Unexplained survivors in `{r['module']}.py`", ""]
            for name in r["unexplained"]:
                lines += [f"### `{name}`", "", "```diff", r["diffs"].get(name, ""), "```", ""]
    Path(args.report).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 8 + 2 * len(rows)]))
    return 1 if failed else 0


def _mutmut_version() -> str:
    try:
        from importlib.metadata import version

        return version("mutmut")
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
