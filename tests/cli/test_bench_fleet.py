"""`bench fleet --quick` with our own subscriber (issues 27, 34): two node processes, each a backend
with its own store and event endpoint; after backups, evictions, deletes, a restart of A, a
restart of A without its second drive, drops from a one-item event queue on A and a clear of B,
the subscribers' DISK tallies equal what each store holds, and B's prompt prefers B.
(The same run against Dynamo's indexer is `umbp-nvme bench fleet --dynamo-python ...`.)"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from umbp_nvme.bench import fleet
from umbp_nvme.bench.fleet_node import PAGE_TOKENS


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("UMBP_NVME_NO_SGLANG", "1")  # the nodes start in a second instead of importing sglang
    try:
        cfg = NS(quick=True, dynamo_python="", dir=str(tmp_path_factory.mktemp("fleet")), keep=False)
        yield fleet.run(cfg)
    finally:
        mp.undo()


def rows(result, step):
    return {r["node"]: r for r in result["rows"] if r["step"] == step}


def test_every_step_leaves_no_phantom_and_no_missing_block_on_either_node(result):
    assert [r["step"] for r in result["rows"]][::2] == ["backups", "evictions on A", "deletes on B", "restart of A",
                                                       "A without drive 1", "drops on A", "clear of B"]  # fmt: skip
    for r in result["rows"]:
        assert (r["ours_phantom"], r["ours_missing"]) == (0, 0), r
        assert r["ours_announced"] == r["held"]
    assert fleet.failures(result) == []


def test_the_scenario_did_what_it_says(result):
    sc, p = result["scenario"], result["scenario"]["pages"]
    first, evicted, deleted = rows(result, "backups"), rows(result, "evictions on A"), rows(result, "deletes on B")
    restarted, cleared = rows(result, "restart of A"), rows(result, "clear of B")
    lost, dropped = rows(result, "A without drive 1"), rows(result, "drops on A")
    per_node = 1 + (sc["convs"] + 1) * (p - 1)  # the shared system page once, the rest per conversation
    assert first["A"]["held"] == first["B"]["held"] == per_node
    assert result["earlier_runs"]["A"][0]["evictions"] > 0  # A's first run (counters restart with it)
    assert evicted["A"]["held"] < per_node + sc["evict_convs"] * (sc["evict_pages"] - 1)
    assert deleted["B"]["held"] == per_node - (p - p // 2) - 1
    # what A held is re-announced, less the pages the backup right after the restart evicted first
    assert restarted["A"]["held"] > 0 and result["earlier_runs"]["A"][1]["reannounced_pages"] >= deleted["A"]["held"] - p
    ex = result["exercised"]
    assert ex["lost_pages"] > 0 and lost["A"]["held"] == restarted["A"]["held"] - ex["lost_pages"]
    assert ex["dropped_pages"] > 0 and ex["reannounced_removed"] >= ex["lost_pages"]
    assert cleared["B"]["held"] == p and cleared["A"]["held"] == dropped["A"]["held"]


def test_the_prompt_only_b_holds_prefers_b(result):
    q = result["query"]
    assert q["ours_matched_tokens"] == {"A": PAGE_TOKENS, "B": q["prompt_tokens"]}  # A: the shared system page
    assert q["ours_prefers_b"]


def test_a_phantom_or_a_wrong_preference_is_reported():
    bad = {"rows": [{"step": "s", "node": "A", "ours_phantom": 1, "ours_missing": 0}],
           "query": {"ours_prefers_b": True, "dynamo_prefers_b": False}}  # fmt: skip
    assert len(fleet.failures(bad)) == 2


def dynamo_python() -> str:
    import os

    from umbp_nvme.bench.fleet_dynamo import available

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    py = os.environ.get("UMBP_DYNAMO_PYTHON") or os.path.join(root, ".venv-dynamo", "bin", "python")
    why = available(py)
    if why:
        pytest.skip(f"Dynamo's indexer: {why}; tools/install_dynamo.sh installs it")
    return py


def test_dynamos_own_indexer_agrees_and_its_overlap_prefers_b(tmp_path, monkeypatch):
    """The issue's acceptance run: NVIDIA Dynamo's standalone indexer (ai-dynamo-runtime)
    registered on both nodes; its disk-tier blocks per worker (/dump) equal what each store holds
    after every step, and its /query overlap for B's prompt is larger on B."""
    py = dynamo_python()
    monkeypatch.setenv("UMBP_NVME_NO_SGLANG", "1")
    res = fleet.run(NS(quick=True, dynamo_python=py, dir=str(tmp_path), keep=False))
    for r in res["rows"]:
        assert (r["dynamo_phantom"], r["dynamo_missing"]) == (0, 0), r
        assert r["dynamo_announced"] == r["held"]
    q = res["query"]
    assert q["dynamo_disk_tokens"] == {"A": PAGE_TOKENS, "B": q["prompt_tokens"]} and q["dynamo_prefers_b"]
    assert fleet.failures(res) == []
