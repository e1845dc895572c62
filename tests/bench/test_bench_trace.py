"""`bench trace` end to end on a small generated trace, through the real backend (stand-in host
pool, so it runs without sglang): every byte read back is checked, and a corrupted page is counted."""

from __future__ import annotations

import json

import numpy as np

from umbp_nvme.bench import trace as bench_trace

ARGS = ["--synthetic", "150", "--pool", "standin"]


def _run(tmp_path, capacity: str, **kw) -> tuple[int, list[dict]]:
    out = tmp_path / "rows.json"
    rc = bench_trace.main(ARGS + ["--capacity", capacity, "--dir", str(tmp_path / "d"), "--json", str(out)], **kw)
    with open(out) as f:
        return rc, json.load(f)


def test_replay_reads_back_every_byte_and_matches_the_simulator_without_eviction(tmp_path):
    rc, rows = _run(tmp_path, "100,1000")
    assert rc == 0 and [r["capacity_blocks"] for r in rows] == [100, 1000]
    small, large = rows
    for r in rows:
        assert (r["wrong_bytes"], r["wrong_pages"], r["get_missed"], r["set_failed"]) == (0, 0, 0, 0)
        assert 0 < r["hit_rate"] <= r["infinite_hit_rate"] and r["requests"] == 150
    assert small["evictions"] > 0 and small["effective_blocks"] <= small["configured_blocks"]
    # 795 distinct blocks fit in 1,000: nothing leaves, so every repeat is a hit, as LRU's
    assert large["evictions"] == 0 and large["declined"] == 0
    assert large["hit_rate"] == large["infinite_hit_rate"] == large["lru_hit_rate"]


def test_a_corrupted_page_is_counted_as_wrong_bytes(tmp_path):
    hit = []

    def corrupt(i, block, views):  # flip one byte of the first page read back
        if not hit:
            hit.append(block)
            views[1].view(np.uint8)[100] ^= 0x5A

    rc, rows = _run(tmp_path, "1000", corrupt=corrupt)
    assert hit and rc == 1
    assert (rows[0]["wrong_bytes"], rows[0]["wrong_pages"]) == (1, 1)
