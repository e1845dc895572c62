"""A relaxed writer's flush killed before and after each of its engine calls, and after it returned,
and likewise its settle of a full segment with the put that starts it (support/flush_kills.py):
the reopened store, and a rebuild from its records alone, serve every acknowledged key's newest
version, no deleted key and no older version. Each version has its own bytes, so a mix-up cannot
pass as a hit. tools/chaos_report.py runs the flush part too."""

from __future__ import annotations

from support.flush_kills import FlushKill, flush_kill_run


def test_a_flush_killed_at_every_step_loses_and_mixes_up_nothing(tmp_path):
    r = flush_kill_run(str(tmp_path))
    # every sync, and per segment a read-back of the blocks that left and a write of them: no less
    assert r["flush_calls"] >= 2 * 2 + 2 * 2, r
    assert r["kills"] == r["kills_survived"] == 1 + 2 * r["flush_calls"] and r["errors"] == [], r
    assert r["versions_checked"] == r["kills"] * 2 * FlushKill().keys
    assert (r["wrong_bytes"], r["stale_served"], r["resurrected"], r["lost_acknowledged"]) == (0, 0, 0, 0), r


def test_a_settle_killed_at_every_step_loses_and_mixes_up_nothing(tmp_path):
    r = flush_kill_run(str(tmp_path), phase="settle")
    # the batch's data and record writes, then the settle's sync and its block write
    assert r["flush_calls"] >= 4, r
    assert r["kills"] == r["kills_survived"] == 1 + 2 * r["flush_calls"] and r["errors"] == [], r
    assert r["versions_checked"] == r["kills"] * 2 * FlushKill().keys
    assert (r["wrong_bytes"], r["stale_served"], r["resurrected"], r["lost_acknowledged"]) == (0, 0, 0, 0), r
