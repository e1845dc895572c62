"""A relaxed writer's flush killed before and after each of its engine calls, and after it returned
(support/flush_kills.py): the reopened store, and a rebuild from its records alone, serve every
acknowledged key's newest version, no deleted key and no older version. Each version has its
own bytes, so a mix-up cannot pass as a hit."""

from __future__ import annotations

import asyncio
import os

from support.flush_kills import FlushKill, run_child, survive


def _run(tmp_path, c: FlushKill, name: str) -> tuple[str, str, str]:
    d = tmp_path / name
    d.mkdir()
    path, log, count = str(d / "store"), str(d / "acks"), str(d / "count")
    run_child(c, path, log, count)
    return path, log, count


def test_a_flush_killed_at_every_step_loses_and_mixes_up_nothing(tmp_path):
    path, log, count = _run(tmp_path, FlushKill(), "whole")
    calls, ok = map(int, open(count).read().split())
    # every sync, and per segment a read-back of the blocks that left and a write of them: no less
    assert ok == 1 and calls >= 2 * 2 + 2 * 2, calls
    points = [(-1, False)] + [(k, after) for k in range(calls) for after in (False, True)]
    for k, after in points:
        c = FlushKill(k=k, after=after)
        path, log, count = (path, log, count) if k < 0 else _run(tmp_path, c, f"k{k}-{int(after)}")
        assert os.path.exists(count) == (k < 0)  # a kill at a counted call ends the flush there
        f = asyncio.run(survive(c, path, log))
        assert f.versions_checked == 2 * c.keys
        assert (f.wrong_bytes, f.stale_served, f.resurrected, f.lost_acknowledged) == (0, 0, 0, 0), (k, after,
                                                                                                     f.examples)
