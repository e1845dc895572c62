#!/usr/bin/env python3
"""Crash, fault and abuse suite over the whole stack (UMBPNvmeStore -> PageStore -> engine).

    python tools/chaos_report.py --quick --json /tmp/chaos.json     # CI: <= 2 min
    python tools/chaos_report.py --json chaos.json                  # full: <= 9 min
    python tools/chaos_report.py --minutes 30 --json soak.json      # a longer soak

Prints the figures and writes them as JSON:
{"kills", "kills_survived", "faults_injected", "bad_inputs_tried", "wrong_bytes",
 "lost_acknowledged", "hangs", "raised_from_v1", "soak_seconds", "versions_checked",
 "resurrected", "stale_served", "metadata_damage_trials", "key_fuzz_cases",
 "archive_fuzz_cases", "crashes", "isolation_failures", "refused_to_serve", "phantom_pages",
 "missing_pages"} plus the details of each part.

Every page the crash, version and soak parts write carries its key and version
(tests/support/versions.py), and every read is checked against what was acknowledged:
``stale_served`` counts reads of another version than the acknowledged one (an older one, one a
kill left in doubt and a later acknowledged put replaced, one whose put answered False),
``resurrected`` reads of a key an acknowledged delete or clear removed, ``versions_checked``
every key so checked. The version part (tests/support/version_crash.py) kills a put between its
data+records and its commit, then deletes, re-puts and clears, then rebuilds the index by every
route (power loss, deleted, damaged, ``verify --rebuild-index``); the crash part rebuilds by one
route in turn after its kills. The flush part (tests/support/flush_kills.py) kills a relaxed
flush before and after each of its engine calls; its kills count in ``kills``.

The events part (tests/support/event_chaos.py) runs a node of `bench fleet` over three drives with
a one-item KV-event queue and our subscriber through clean restarts, SIGKILLs and lost drives
(removed, wiped, failing to open, brought back behind, a shrink): ``phantom_pages`` counts pages
the subscriber believes the store holds and it does not, ``missing_pages`` the reverse, at every
check (full mode: at least 1,000 event-queue drops and 20 restarts).

The last part runs the fuzzers of tools/chaos_fuzz.py (damaged metadata files, hostile keys,
damaged archives), every check in a child process: ``crashes`` counts children that died of a
signal, printed a traceback, exited with a code outside the allowed set, raised from an API
that must answer per key, or outgrew their address-space budget. ``details.fuzz_failures``
lists the first failures of each kind with the file, damage, command, exit code and the last
stderr line; ``details.fuzz_failure_signatures`` counts them all by kind.
Exit status 1 when a must-be-zero figure is not zero, a kill was not survived, the harness
self-test or a fuzzer's undamaged control fails, a version case did not leave its hazard on disk,
or (full mode) a fuzzer ran fewer cases than its target, fewer than 10,000 versions were checked,
or the events part saw fewer than 1,000 event-queue drops or 20 restarts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")  # tests/support/: the harness (not shipped in the package)
for _p in (TESTS, ROOT):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["PYTHONPATH"] = os.pathsep.join((ROOT, TESTS, os.environ.get("PYTHONPATH", "")))  # forkserver children


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CI mode: about a minute")
    ap.add_argument("--minutes", type=float, default=None, help="soak length in minutes (default 1, quick 0.2)")
    ap.add_argument("--kills", type=int, default=None, help="kills per durability mode (default 56, quick 8)")
    ap.add_argument("--json", metavar="PATH", help="write the figures here")
    ap.add_argument("--dir", help="keep each run's work directory in here (default: a temporary one, removed afterwards)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fuzz-only", action="store_true", help="run only the fuzzers (development)")
    ap.add_argument("--workers", type=int, default=None, help="fuzzer child processes at a time (default min(2, cores))")
    ap.add_argument("--event-restarts", type=int, default=None, help="restarts in the KV-events part (default 22, quick 3)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)

    logging.basicConfig(level=logging.WARNING if a.verbose else logging.CRITICAL, format="%(levelname)s %(name)s: %(message)s")
    from support.bad_input import check_legacy_pointer, fuzz_run
    from support.crash_survival import crash_run
    from support.event_chaos import event_run
    from support.fault_runs import fault_run
    from support.hygiene import hygiene_run
    from support.soak import soak_run
    from support.flush_kills import flush_kill_run
    from support.version_crash import run_version_cases

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from chaos_fuzz import FULL_TARGETS, run_fuzzers

    kills = a.kills if a.kills is not None else (8 if a.quick else 56)
    soak_s = 60.0 * (a.minutes if a.minutes is not None else (0.2 if a.quick else 1.0))
    fuzz_cases = 150 if a.quick else 1200
    fault_rounds = 20 if a.quick else 120
    if a.dir:  # a fresh run directory inside it, kept: a second run into the same --dir must not collide
        os.makedirs(a.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="umbp-chaos-", dir=a.dir or None)
    say = (lambda s: print(s, flush=True)) if a.verbose else (lambda s: None)
    t0 = time.monotonic()
    report: dict = {}
    parts: dict = {}
    try:
        crash, fr, sr, zr, hr = [], _EMPTY_FAULTS, _EMPTY_SOAK, _EMPTY_FUZZ, {"checks": 0, "findings": []}
        er = _EMPTY_EVENTS
        vr = _EMPTY_VERSIONS
        fk = _EMPTY_FLUSH
        if not a.fuzz_only:
            # 1. crash survival: both durability modes, without and with eviction
            crash = []
            for mode in ("strict", "relaxed"):
                keep = kills // 2
                for evicting, n in ((False, keep), (True, kills - keep)):
                    d = os.path.join(work, f"crash-{mode}-{'evict' if evicting else 'keep'}")
                    os.makedirs(d, exist_ok=True)
                    r = crash_run(d, mode=mode, kills=n, evicting=evicting, seed=a.seed, log=say)
                    r.update(mode=mode, evicting=evicting)
                    crash.append(r)
                    print(f"crash {mode:7s} {'evicting' if evicting else 'no-evict'}: {r['kills_survived']}/{r['kills']} survived, "
                          f"wrong={r['wrong_bytes']} lost={r['lost_acknowledged']} unreadable={r['unreadable']} "
                          f"phases={r['phases']}", flush=True)
            parts["crash"] = crash
            # 1b. a put killed between its records and its commit, then delete / re-put / clear, then every rebuild route
            vr = run_version_cases(os.path.join(work, "versions"), quick=a.quick, log=say)
            parts["versions"] = vr
            print(f"versions: {vr['layouts']} kills x {len(vr['cases']) // max(1, vr['layouts'])} cases, "
                  f"{vr['versions_checked']} checked, wrong={vr['wrong_bytes']} stale={vr['stale_served']} "
                  f"resurrected={vr['resurrected']} lost={vr['lost_acknowledged']} errors={vr['errors']}", flush=True)
            # 1c. a relaxed flush killed before and after each of its engine calls (quick: the test suite's
            # tests/reliability/test_flush_kills.py runs the same, so CI does not pay for it twice)
            if a.quick:
                print("flush kills: not run in --quick (tests/reliability/test_flush_kills.py runs them)", flush=True)
            else:
                fk = flush_kill_run(os.path.join(work, "flush-kills"), log=say)
                parts["flush_kills"] = {k: v for k, v in fk.items() if k != "examples"}
                print(f"flush kills: {fk['kills_survived']}/{fk['kills']} survived ({fk['flush_calls']} engine calls), "
                      f"{fk['versions_checked']} checked, wrong={fk['wrong_bytes']} stale={fk['stale_served']} "
                      f"resurrected={fk['resurrected']} lost={fk['lost_acknowledged']}", flush=True)
            # 2. faults
            fr = fault_run(os.path.join(work, "faults"), rounds=fault_rounds, seed=a.seed, log=say)
            parts["faults"] = fr
            print(f"faults: {fr['faults_injected']} injected, wrong={fr['wrong_bytes']} hangs={fr['hangs']} "
                  f"raised={fr['raised_from_v1']}; corrupt index: {fr.get('corrupt_index_outcome')}", flush=True)
            # 3. races
            sr = soak_run(os.path.join(work, "soak"), seconds=soak_s, log=say)
            parts["soak"] = sr
            print(f"soak: {sr['soak_seconds']} s, calls={sr['calls']}, evictions={sr['evictions']}, "
                  f"follower hits={sr['follower'].get('hits')}, rss +{sr['rss_growth_mib']} MiB, "
                  f"wrong={sr['wrong_bytes']} stale={sr['stale_served']} hangs={sr['hangs']} "
                  f"raised={sr['raised_from_v1']}", flush=True)
            # 4. bad input
            zr = fuzz_run(os.path.join(work, "fuzz"), cases=fuzz_cases, seed=a.seed, log=say)
            legacy = check_legacy_pointer(os.path.join(work, "fuzz"))
            zr["bad_inputs_tried"] += 1
            zr["findings"] += legacy
            zr["n_findings"] += len(legacy)
            parts["fuzz"] = zr
            print(f"bad input: {zr['bad_inputs_tried']} tried, {zr['n_findings']} findings", flush=True)
            # 5. hygiene
            hr = hygiene_run(os.path.join(work, "hygiene"), log=say)
            parts["hygiene"] = hr
            print(f"hygiene: {hr['checks']} checks, {len(hr['findings'])} findings", flush=True)
            # 5b. KV events: a subscriber's DISK view against the store through drops, restarts, lost drives
            restarts = a.event_restarts if a.event_restarts is not None else (3 if a.quick else EVENT_RESTARTS_TARGET + 2)
            er = event_run(os.path.join(work, "events"), restarts=restarts, backups=(3, 6) if a.quick else (8, 12),
                           seed=a.seed, log=say)  # fmt: skip
            parts["events"] = er
            print(f"events: {er['restarts']} restarts ({er['kills']} killed), {er['event_queue_drops']} event-queue "
                  f"drops, drive events {er['lost_drive_events']}, {er['pages_lost_at_open']} pages lost at open, "
                  f"{er['checks']} checks: phantom={er['phantom_pages']} missing={er['missing_pages']} "
                  f"({er['seconds']} s)", flush=True)  # fmt: skip
        # 6. fuzzers: damaged metadata, hostile keys, damaged archives (each check in a child process)
        fz = run_fuzzers(os.path.join(work, "fuzzers"), quick=a.quick, seed=a.seed, log=say, workers=a.workers)
        parts["fuzzers"] = fz
        fg = fz["figures"]
        print(f"fuzzers: metadata {fg['metadata_damage_trials']} trials, keys {fg['key_fuzz_cases']} cases, "
              f"archives {fg['archive_fuzz_cases']} cases in {round(sum(fz[f]['seconds'] for f in ('metadata', 'keys', 'archive')), 1)} s: "
              f"crashes={fg['crashes']} wrong={fg['wrong_bytes']} hangs={fg['hangs']} "
              f"isolation={fg['isolation_failures']} refused_to_serve={fg['refused_to_serve']} "
              f"harness={'ok' if fz['harness_ok'] else 'BROKEN'}", flush=True)
        for fam in ("metadata", "keys", "archive"):
            for sig, n in list(fz[fam]["failure_signatures"].items())[:8]:
                print(f"  {fam}: {n} x {sig}", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)

    report = {
        "kills": sum(r["kills"] for r in crash) + fk["kills"],
        "kills_survived": sum(r["kills_survived"] for r in crash) + fk["kills_survived"],
        "faults_injected": fr["faults_injected"],
        "bad_inputs_tried": zr["bad_inputs_tried"],
        "wrong_bytes": (sum(r["wrong_bytes"] for r in crash) + fr["wrong_bytes"] + sr["wrong_bytes"] + vr["wrong_bytes"]
                        + fk["wrong_bytes"]),
        "lost_acknowledged": (sum(r["lost_acknowledged"] for r in crash) + vr["lost_acknowledged"]
                              + fk["lost_acknowledged"]),
        "hangs": sum(r["hangs"] for r in crash) + fr["hangs"] + sr["hangs"],
        "raised_from_v1": sum(r["raised_from_v1"] for r in crash) + fr["raised_from_v1"] + sr["raised_from_v1"],
        "soak_seconds": sr["soak_seconds"],
        "versions_checked": (sum(r["versions_checked"] for r in crash) + vr["versions_checked"] + sr["versions_checked"]
                             + fk["versions_checked"]),
        "resurrected": sum(r["resurrected"] for r in crash) + vr["resurrected"] + fk["resurrected"],
        "stale_served": (sum(r["stale_served"] for r in crash) + vr["stale_served"] + sr["stale_served"]
                         + fk["stale_served"]),
        "phantom_pages": er["phantom_pages"],
        "missing_pages": er["missing_pages"],
    }
    report["wrong_bytes"] += fg["wrong_bytes"]
    report["hangs"] += fg["hangs"]
    for k in ("metadata_damage_trials", "key_fuzz_cases", "archive_fuzz_cases", "crashes", "isolation_failures",
              "refused_to_serve"):
        report[k] = fg[k]
    extra = {
        "mode": "quick" if a.quick else "full",
        "seconds": round(time.monotonic() - t0, 1),
        "kills_by_mode": dict({f"{r['mode']}{'-evicting' if r['evicting'] else ''}": r["kills"] for r in crash},
                              flush=fk["kills"]),
        "kills_by_phase": _sum_dicts(r["phases"] for r in crash),
        "rebuilds_after_kills": _sum_dicts(r["rebuilds"] for r in crash),
        "versions_checked_by_part": {"crash": sum(r["versions_checked"] for r in crash),
                                     "versions": vr["versions_checked"], "soak": sr["versions_checked"],
                                     "flush_kills": fk["versions_checked"]},
        "version_mix_ups": [e for r in crash for e in r["examples"]][:8] + vr["examples"][:8] + fk["examples"][:8],
        "unreadable_after_crash": sum(r["unreadable"] for r in crash),
        "over_capacity": sum(r["over_capacity"] for r in crash),
        "fill_after_crash_failed_batches": sum(r["fill_failed_batches"] for r in crash),
        "soak_rss_growth_mib": sr["rss_growth_mib"],
        "soak_threads_leaked": sr["threads_leaked"],
        "bad_input_findings": zr["findings"],
        "hygiene_findings": hr["findings"],
        "corrupt_index_outcome": fr.get("corrupt_index_outcome"),
        "event_queue_drops": er["event_queue_drops"],
        "event_restarts": er["restarts"],
        "event_kills": er["kills"],
        "event_drive_events": er["lost_drive_events"],
        "event_pages_lost_at_open": er["pages_lost_at_open"],
        "errors": [e for r in crash for e in r["errors"]][:10] + vr["errors"][:5] + fr["errors"][:5] + sr["errors"][:5]
        + er["errors"][:5] + fk["errors"][:5],
        "fuzz_harness": {"ok": fz["harness_ok"], "self_test": fz["harness"],
                         "metadata_control_ok": fz["metadata"]["control_ok"], "archive_control": fz["archive"]["control"]},
        "fuzz_failure_signatures": {f: fz[f]["failure_signatures"] for f in ("metadata", "keys", "archive")},
        "fuzz_failures": {f: fz[f]["failures"] for f in ("metadata", "keys", "archive")},
        "fuzz_seconds": {f: fz[f]["seconds"] for f in ("metadata", "keys", "archive")},
    }
    print(json.dumps(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(report, details=extra, parts=parts), f, indent=1, default=str)
    short = {k: report[k] for k, v in FULL_TARGETS.items() if not a.quick and report[k] < v}
    if short:
        print(f"fuzzers ran fewer cases than their targets: {short} (targets {FULL_TARGETS})", flush=True)
    few_versions = not a.quick and not a.fuzz_only and report["versions_checked"] < VERSIONS_TARGET
    if few_versions:
        print(f"{report['versions_checked']} versions checked, fewer than {VERSIONS_TARGET}", flush=True)
    few_events = not a.quick and not a.fuzz_only and (er["event_queue_drops"] < EVENT_DROPS_TARGET
                                                      or er["restarts"] < EVENT_RESTARTS_TARGET)  # fmt: skip
    if few_events:
        print(f"the events part saw {er['event_queue_drops']} drops and {er['restarts']} restarts, fewer than "
              f"{EVENT_DROPS_TARGET} and {EVENT_RESTARTS_TARGET}", flush=True)  # fmt: skip
    bad = (report["wrong_bytes"] or report["lost_acknowledged"] or report["hangs"] or report["raised_from_v1"]
           or report["resurrected"] or report["stale_served"] or vr["errors"] or fk["errors"]
           or report["phantom_pages"] or report["missing_pages"] or er["errors"] or few_events
           or report["kills_survived"] != report["kills"] or report["crashes"] or report["isolation_failures"]
           or not fz["harness_ok"] or short or few_versions)
    return 1 if bad else 0


VERSIONS_TARGET = 10_000  # full mode: keys checked against their acknowledged version
EVENT_DROPS_TARGET = 1_000  # full mode: KV-event queue drops the subscriber must come through
EVENT_RESTARTS_TARGET = 20  # full mode: restarts (clean and killed) in the events part
_EMPTY_FLUSH = {"kills": 0, "kills_survived": 0, "versions_checked": 0, "wrong_bytes": 0, "stale_served": 0,
                "resurrected": 0, "lost_acknowledged": 0, "flush_calls": 0, "errors": [], "examples": []}
_EMPTY_EVENTS = {"phantom_pages": 0, "missing_pages": 0, "event_queue_drops": 0, "restarts": 0, "kills": 0,
                 "lost_drive_events": {}, "pages_lost_at_open": 0, "checks": 0, "errors": [], "seconds": 0.0}
_EMPTY_VERSIONS = {"versions_checked": 0, "wrong_bytes": 0, "stale_served": 0, "resurrected": 0, "lost_acknowledged": 0,
                   "layouts": 0, "cases": [], "examples": [], "errors": []}
_EMPTY_FAULTS = {"faults_injected": 0, "wrong_bytes": 0, "hangs": 0, "raised_from_v1": 0, "errors": []}
_EMPTY_SOAK = {"soak_seconds": 0.0, "wrong_bytes": 0, "stale_served": 0, "versions_checked": 0, "hangs": 0,
               "raised_from_v1": 0, "errors": [], "rss_growth_mib": 0, "threads_leaked": 0}
_EMPTY_FUZZ = {"bad_inputs_tried": 0, "findings": [], "n_findings": 0}


def _sum_dicts(ds) -> dict:
    out: dict = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


if __name__ == "__main__":
    sys.exit(main())
