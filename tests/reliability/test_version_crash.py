"""Issue 25's version-aware crash cases (support/version_crash.py), quick mode in `make test`:
a strict put SIGKILLed between its synced data+records and its index commit, then the next session
deletes, re-puts (delete, then a new version) and clears, then each rebuild route (power loss,
deleted index, damaged index, `verify --rebuild-index`), then every key the workload touched is
checked against what was acknowledged: no wrong bytes, no stale version, no resurrected key, no
acknowledged key lost. Each version of a key has its own bytes, so a mix-up cannot pass as a hit.

UMBP_VERSION_CHAOS=full runs every layout of the full mode (both durability modes, two size
classes, more victims and pads); tools/chaos_report.py runs it too.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from support.version_crash import ACTIONS, ROUTES, kill_child, killed_records, layouts, names, run_case
from support.versions import read_log

FULL = os.environ.get("UMBP_VERSION_CHAOS", "") == "full"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """One killed session per layout: (layout, its directory, the model its ack log describes)."""
    out = []
    for i, c in enumerate(layouts(quick=not FULL)):
        d = tmp_path_factory.mktemp(f"versions-{i}")
        kill_child(c, str(d / "killed"), str(d / "acks"))
        out.append((c, str(d), read_log(str(d / "acks"))))
    return out


def test_the_kill_leaves_the_victims_records_on_disk(killed):
    """The hazard is there: every victim's killed put left a sound record (and no acknowledged state)."""
    for c, d, st in killed:
        assert killed_records(c, os.path.join(d, "killed")) == c.victims, c
        for v in names(c)[1]:
            s = st.model.keys[v]
            assert s.removed and not s.present and len(s.doubt) == 1, (c, v, s)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("action", ACTIONS)
def test_every_acknowledged_version_survives_the_rebuild(killed, action, route):
    for c, d, st in killed:
        t = asyncio.run(run_case(c, os.path.join(d, "killed"), st.model, st.next_version, action, route, d))
        f = t.figures()
        # two checks (after the kill, after the rebuild) of every key the workload touched
        assert f["versions_checked"] == 2 * sum(map(len, names(c))), (c, f)
        assert (f["wrong_bytes"], f["stale_served"], f["resurrected"], f["lost_acknowledged"]) == (0, 0, 0, 0), (
            c, f, t.examples)  # fmt: skip
