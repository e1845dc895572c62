"""Crash survival (issue item 1): the SGLang backend in a child process, SIGKILLed at random
moments and in chosen phases (mid-write, after the write before the commit, at fdatasync, around
the index commit, around an eviction commit), in both durability modes. After every kill the
store is reopened through UMBPNvmeStore and every page batch_exists reports is read back.

The full run (56 kills per mode) is ``tools/chaos_report.py``; this is the CI-sized one.
"""

from __future__ import annotations

import pytest

from support.testing import crash_run


@pytest.mark.parametrize("mode", ["strict", "relaxed"])
@pytest.mark.parametrize("evicting", [False, True], ids=["no-evict", "evicting"])
def test_sigkill_never_wrong_bytes_lost_acks_or_space(tmp_path, mode, evicting):
    r = crash_run(str(tmp_path), mode=mode, kills=5 if evicting else 4, evicting=evicting, seed=11)
    assert r["errors"] == []
    assert r["wrong_bytes"] == 0, r
    assert r["lost_acknowledged"] == 0, r
    assert r["unreadable"] == 0, r  # what batch_exists reports is readable
    assert r["over_capacity"] == 0, r
    assert r["raised_from_v1"] == 0 and r["hangs"] == 0
    assert r["kills_survived"] == r["kills"]
    assert r["existing_max"] > 0  # the children did write between kills
    # kill 0 is always the parent's; the others die in their phase, or the parent kills them
    assert r["phases"].get("parent", 0) >= 1 and sum(r["phases"].values()) == r["kills"]
    if evicting:
        assert r["fill_failed_batches"] == 0  # space freed by evictions and crashes is reused
