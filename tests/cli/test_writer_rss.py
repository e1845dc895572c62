"""tools/writer_rss.py: a writer's RSS per object while it fills past its capacity (issue 36)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools",
                    "writer_rss.py")  # fmt: skip


def test_a_tiny_overfill_evicts_and_keeps_the_record_blocks_it_is_given(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, TOOL, "--capacity-objects", "1500", "--puts", "5000", "--segment-bytes",
                        str(1 << 20), "--record-cache-bytes", str(16 * 4096), "--durability", "strict", "--dir",
                        str(tmp_path / "d"), "--json", str(out)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["puts"] == 5000 and 1000 < r["objects"] < 2500 and r["evictions"] == 5000 - r["objects"]
    assert r["record_blocks_in_memory"] <= 16 + 2 * 16  # the cache, plus a batch's blocks being changed at most
    assert "writer at capacity (strict)" in p.stdout and "B/object anonymous" in p.stdout
    assert os.listdir(tmp_path / "d") == []  # its store is removed
