"""tools/chaos_report.py --quick: the whole suite in about a minute, every must-be-zero figure 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_chaos_report_quick(tmp_path):
    out = tmp_path / "chaos.json"
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "chaos_report.py"), "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    figures = json.loads(out.read_text())
    for k in ("kills", "kills_survived", "faults_injected", "bad_inputs_tried", "wrong_bytes",
              "lost_acknowledged", "hangs", "raised_from_v1", "soak_seconds"):
        assert k in figures, k
    assert figures["wrong_bytes"] == 0 and figures["lost_acknowledged"] == 0
    assert figures["hangs"] == 0 and figures["raised_from_v1"] == 0
    assert figures["kills"] >= 16 and figures["kills_survived"] == figures["kills"]
    assert figures["faults_injected"] > 0 and figures["bad_inputs_tried"] > 100 and figures["soak_seconds"] > 0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
