"""tools/chaos_report.py --quick: the whole suite in about a minute, every must-be-zero figure 0.

This is where crash survival (SIGKILL of the SGLang backend in every phase, both durability modes,
with and without eviction, a rebuild of the index by one route in turn after the kills, every
page checked against its acknowledged version), the version cases (a put killed between its
records and its commit, then delete / re-put / clear, then every rebuild route), injected and real faults through the backend, the three-controller-
thread soak with a follower, the bad-input checkers, the file-system hygiene checks and the KV
events (a subscriber's DISK view through event-queue drops, restarts, kills and lost drives) are
run and asserted, once: each part's own figures are checked below, not only the report's totals.
Also checks the fuzzers' harness itself (tools/chaos_fuzz.py): a child that dies of SIGBUS, raises,
logs a traceback or hangs is counted, and an undamaged store and archive pass every check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)

import chaos_fuzz  # noqa: E402


def test_chaos_report_quick(tmp_path):
    out = tmp_path / "chaos.json"
    r = subprocess.run(
        # 9 kills per durability mode: 4 without eviction, 5 evicting (every phase at least once)
        [sys.executable, os.path.join(ROOT, "tools", "chaos_report.py"), "--quick", "--kills", "9", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads(out.read_text())
    figures = {k: v for k, v in report.items() if k not in ("details", "parts")}
    for k in ("kills", "kills_survived", "faults_injected", "bad_inputs_tried", "wrong_bytes",
              "lost_acknowledged", "hangs", "raised_from_v1", "soak_seconds", "versions_checked",
              "resurrected", "stale_served", "metadata_damage_trials", "key_fuzz_cases", "archive_fuzz_cases", "crashes",
              "isolation_failures", "refused_to_serve", "phantom_pages", "missing_pages"):
        assert k in figures, k
    fuzz = report["details"]
    # what failed, reproducibly: damage kind -> failure, with the first cases of each
    why = json.dumps({"figures": figures, "signatures": fuzz.get("fuzz_failure_signatures"),
                      "first": fuzz.get("fuzz_failures")}, default=str)[:6000]
    assert fuzz["fuzz_harness"]["ok"], why
    assert figures["crashes"] == 0, why
    assert figures["wrong_bytes"] == 0 and figures["lost_acknowledged"] == 0, why
    assert figures["hangs"] == 0 and figures["raised_from_v1"] == 0, why
    assert figures["resurrected"] == 0 and figures["stale_served"] == 0, (why, fuzz.get("version_mix_ups"))
    by_part = fuzz["versions_checked_by_part"]
    assert by_part["crash"] > 1000 and by_part["versions"] > 1000 and by_part["soak"] > 100, (
        by_part, {k: report["parts"]["soak"].get(k) for k in ("calls", "errors", "follower", "soak_seconds", "hangs")})
    assert figures["versions_checked"] == sum(by_part.values()), by_part
    assert figures["isolation_failures"] == 0, why
    assert figures["phantom_pages"] == 0 and figures["missing_pages"] == 0, report["parts"]["events"]
    assert figures["kills"] >= 16 and figures["kills_survived"] == figures["kills"]
    assert figures["faults_injected"] > 0 and figures["bad_inputs_tried"] > 100 and figures["soak_seconds"] > 0
    assert figures["metadata_damage_trials"] >= 50 and figures["key_fuzz_cases"] >= 300
    assert figures["archive_fuzz_cases"] >= 50
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    _check_crash_parts(report["parts"]["crash"])
    _check_version_part(report["parts"]["versions"])
    _check_fault_part(report["parts"]["faults"])
    _check_soak_part(report["parts"]["soak"])
    _check_bad_input_parts(report["parts"]["fuzz"], report["parts"]["hygiene"])
    _check_event_part(report["parts"]["events"])


def _check_crash_parts(crash: list) -> None:
    """Each (mode, evicting) run: no wrong byte, lost ack, unreadable page or over-capacity store
    after any kill; every kill survived; the children wrote; evicting stores keep filling."""
    assert sorted((c["mode"], c["evicting"]) for c in crash) == [("relaxed", False), ("relaxed", True),
                                                                  ("strict", False), ("strict", True)]
    for c in crash:
        tag = (c["mode"], c["evicting"], c)
        assert c["errors"] == [], tag
        assert c["wrong_bytes"] == 0 and c["lost_acknowledged"] == 0, tag
        assert c["unreadable"] == 0, tag  # what batch_exists reports is readable
        assert c["over_capacity"] == 0, tag
        assert c["raised_from_v1"] == 0 and c["hangs"] == 0, tag
        assert c["kills"] == (5 if c["evicting"] else 4) and c["kills_survived"] == c["kills"], tag
        assert c["existing_max"] > 0, tag  # the children did write between kills
        assert c["versions_checked"] > 0 and c["stale_served"] == 0 and c["resurrected"] == 0, tag
        # kill 0 is always the parent's; the others die in their phase, or the parent kills them
        assert c["phases"].get("parent", 0) >= 1 and sum(c["phases"].values()) == c["kills"], tag
        if c["evicting"]:
            assert c["fill_failed_batches"] == 0, tag  # space freed by evictions and crashes is reused
    # a plain reopen and every rebuild route came after some kill
    routes = {r for c in crash for r in c["rebuilds"]}
    assert routes == {"reopen", "power_loss", "index_lost", "index_damaged", "verify"}, routes


def _check_version_part(vr: dict) -> None:
    """Each (action, route) after the killed put: every key checked twice, no mix-up, the hazard
    (the victims' records of the killed put) on disk before each case."""
    assert vr["errors"] == [], vr["errors"]
    assert sorted((c["action"], c["route"]) for c in vr["cases"]) == sorted(
        (a, r) for a in ("mixed", "clear") for r in ("power_loss", "index_lost", "index_damaged", "verify"))
    for c in vr["cases"]:
        assert c["versions_checked"] > 400, c
        assert (c["wrong_bytes"], c["stale_served"], c["resurrected"], c["lost_acknowledged"]) == (0, 0, 0, 0), c


def _check_fault_part(fr: dict) -> None:
    """Every v1 call answered in bounded time with no wrong byte; each scenario kept serving what is
    intact; a damaged index is moved aside and the writer opens with an empty one."""
    assert fr["errors"] == [], fr["errors"]
    assert fr["wrong_bytes"] == 0 and fr["hangs"] == 0 and fr["raised_from_v1"] == 0, fr
    assert fr["faults_injected"] > 50, fr
    for name, sc in fr["scenarios"].items():
        if "skipped" not in sc:
            assert sc["serves_intact"], (name, sc)
    assert fr["corrupt_index_outcome"] == "opened", fr


def _check_soak_part(sr: dict) -> None:
    """SGLang's three controller threads, eviction under a tight cap and a follower process."""
    assert sr["errors"] == [] and sr["wrong_bytes"] == 0 and sr["hangs"] == 0 and sr["raised_from_v1"] == 0, sr
    assert sr["stale_served"] == 0 and sr["versions_checked"] > 0, sr
    assert sr["calls"]["backup"] > 10 and sr["calls"]["io"] > 10 and sr["calls"]["hits"] > 0, sr
    assert sr["evictions"] > 0 and sr["bytes_used"] <= sr["capacity"], sr
    assert sr["follower"].get("hits", 0) > 0, sr["follower"]
    assert sr["rss_growth_mib"] < 64 and sr["threads_leaked"] == 0, sr


def _check_bad_input_parts(fuzz: dict, hygiene: dict) -> None:
    """The bad-input checkers (config values, keys, index tensors, pointer/size pairs, layout and
    namespace mismatches, the legacy raw-pointer get) and the hygiene checks (modes 0600/0700,
    symlinks not followed, the writer lock naming its holder, a foreign owner refused): no finding."""
    assert fuzz["n_findings"] == 0 and fuzz["findings"] == [], fuzz["findings"]
    assert fuzz["bad_inputs_tried"] > 100, fuzz
    assert hygiene["findings"] == [], hygiene["findings"]
    assert hygiene["checks"] >= 10, hygiene


def _check_event_part(er: dict) -> None:
    """Quick mode: 3 restarts (one of them a SIGKILL), drops, drive events, every check with the
    subscriber exactly on what the store holds."""
    assert er["errors"] == [], er["errors"]
    assert er["restarts"] == 3 and er["kills"] == 1 and er["checks"] == 2 * (er["restarts"] + 2), er
    assert sum(er["lost_drive_events"].values()) == er["restarts"], er
    assert er["event_queue_drops"] > 20 and er["dropped_pages"] > 20, er
    assert er["held_max"] > 20 and er["reannounced_removed"] > 0, er
    assert er["phantom_pages"] == 0 and er["missing_pages"] == 0, er


def test_fuzz_harness_counts_what_it_must(tmp_path):
    """SIGBUS, an uncaught exception, a logged traceback and a hang are each counted; a clean child is not."""
    z = chaos_fuzz.Zygote(str(tmp_path / "z"))
    try:
        st = chaos_fuzz.selftest(z, str(tmp_path))
        assert st["outcomes"] == {"ok": "ok", "sigbus": "crash", "raise": "crash", "logged": "crash", "hang": "hang",
                                  "swapped_records": 2}, st
        assert st["ok"] and st["crash_kinds"].get("signal SIGBUS(-7)") == 1, st
        assert st["crash_kinds"].get("traceback RuntimeError") == 1 and st["crash_kinds"].get("traceback ZeroDivisionError") == 1, st
        # a crash in the middle of a family is counted once per child, with what it takes to reproduce it
        t = chaos_fuzz.Tally("t")
        reply = z.run(dict(op="selftest", kind="sigbus"))
        assert t.child(reply, dict(file="index.lmdb", damage="truncate", op="follower open+get")) == "crash"
        assert t.crashes == 1 and t.failures[0]["signal"] == "SIGBUS(-7)" and t.failures[0]["damage"] == "truncate"
        # an exit code outside the allowed set is a crash, inside it is not
        reply = z.run(dict(op="cli", argv=["verify", "--store", str(tmp_path / "nothing-here")]))
        assert reply["rc"] == 2 and not reply["traceback"], reply
        assert t.child(reply, dict(op="verify"), (0, 1, 2)) == "ok"
        assert t.child(reply, dict(op="verify"), (0, 1)) == "crash"
    finally:
        z.close()


def test_fuzz_controls_are_clean(tmp_path):
    """Undamaged metadata and an intact archive pass every check (no false crashes, no wrong bytes)."""
    r = chaos_fuzz.run_fuzzers(str(tmp_path / "w"), quick=True, families=("metadata", "archive"),
                               targets={"metadata": 0, "archive": 0}, workers=1)
    assert r["harness"]["ok"], r["harness"]
    assert r["metadata"]["control_ok"], r["metadata"]["control_failures"]
    ctl = r["archive"]["control"]
    assert ctl["ok"] and ctl["file"]["rc"] == 0 and ctl["file"]["hits"] == r["archive"]["records"], ctl
    assert r["figures"]["crashes"] == 0 and r["figures"]["wrong_bytes"] == 0 and r["figures"]["hangs"] == 0, r["figures"]


def test_forked_cli_matches_a_real_umbp_nvme_process(tmp_path):
    """The fuzzers run `umbp-nvme` as cli.main in a forked child; a real process must end the same way."""
    z = chaos_fuzz.Zygote(str(tmp_path / "z"))
    try:
        d = str(tmp_path / "s")
        r = z.run(dict(op="build", path=d, keys=[chaos_fuzz.hexkey(i, "x") for i in range(40)]))
        assert r["result"]["stored"] == 40, r
        for damage in (None, dict(file="index.lmdb", damage="truncate", size=8192), dict(file="MANIFEST.json", damage="empty")):
            if damage:
                chaos_fuzz.apply_damage(d, damage)
            forked = z.run(dict(op="cli", argv=["verify", "--store", d]))
            real = subprocess.run([sys.executable, "-m", "umbp_nvme.cli", "verify", "--store", d], capture_output=True,
                                  text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
            want = -forked["signal"] if forked["signal"] else forked["rc"]
            assert real.returncode == want, (damage, forked, real.returncode, real.stderr[-500:])
            assert forked["traceback"] == ("Traceback (most recent call last)" in real.stderr), (damage, forked, real.stderr[-500:])
    finally:
        z.close()
