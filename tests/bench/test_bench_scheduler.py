"""``umbp-nvme bench scheduler --smoke``: one child over two drives, its rows and what they check
(the pages get_stats() reported equal those the backups acknowledged; every drive has its row).
Timings are the benchmark's business, not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import sglang_env

sglang_env.require_sglang()

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_scheduler_bench_smoke(tmp_path):
    out = tmp_path / "s.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, "-m", "umbp_nvme.bench", "scheduler", "--smoke", "--drives", "2", "--scenarios",
         "idle,backups,hung", "--dir", str(tmp_path / "d"), "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted(r["scenario"] for r in rows) == ["backups", "hung", "idle"]
    for r in rows:
        assert r["bench"] == "scheduler" and r["system"] == "this" and r["drives"] == 2
        assert r["drive_rows"] == 2 and r["calls"] == 50 and r["pages_reported_ok"] is True
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"] <= r["max_us_worst"]
        assert r["clear_ms"] is not None
    by = {r["scenario"]: r for r in rows}
    assert by["idle"]["backup_pages_ok"] == 0 and by["backups"]["backup_pages_ok"] > 0
    assert by["hung"]["hang_met"] is True  # the hang was in force while get_stats() was timed
    assert "bench target (issue 39)" in proc.stdout
    for r in rows:  # the no-op timed between the calls
        assert 0 < r["floor_p50_us"] <= r["floor_max_us"] <= r["floor_max_us_worst"]
    assert not (tmp_path / "d").exists()  # the run made it, and removed it
