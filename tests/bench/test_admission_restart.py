"""tools/admission_restart.py: the restarted replay drops the admission state exactly once, at the
restart point, and keeps the cache's contents; the hit rate counts only the requests after it."""

from __future__ import annotations

import json

from umbp_nvme.bench import trace_file, trace_sim
from support.traces import load_tool, trace_of

tool = load_tool("admission_restart")


def test_state_dropped_once_at_the_restart_point_contents_kept():
    t = trace_of([[0, 1], [0, 1], [2], [0, 1, 2]])
    c = tool.Restarted(10, at=2)
    first = c.admission
    trace_sim.simulate(t.head(2), c)
    assert c.admission is first and c.at == 2
    trace_sim.simulate(t, c)  # requests 0-1 again, then the restart
    assert c.admission is not first and c.at is None
    assert len(c) == 3  # the contents survived the restart


def test_hit_rate_counts_only_requests_after_the_restart():
    # LRU, capacity 10: [0,1] misses, [0,1] hits 2, [2] misses, [0,1,2] hits 3.
    # After request 2 (the last two requests): 3 hits of 4 blocks.
    t = trace_of([[0, 1], [0, 1], [2], [0, 1, 2]])
    r = tool.rates(t, 10, at=2)
    assert r["lru"] == 3 / 4
    assert r["restarted"] == r["adaptive"] == 3 / 4  # a cold adaptive store admits everything


def test_restart_at_zero_is_the_kept_run(tmp_path):
    recs = trace_file.synthetic(300, seed=5)
    t = trace_of([r["hash_ids"] for r in recs])
    r = tool.rates(t, 200, at=0)
    assert r["restarted"] == r["adaptive"]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in recs))
    assert tool.main(["--trace", str(path), "--capacity", "100,200"]) == 0
