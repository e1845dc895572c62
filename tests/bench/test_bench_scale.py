"""`umbp-nvme bench store --scale N` (bench/scale.py): fills a store, measures it in fresh
processes, and prints a verdict line per issue-36 target; a refilled store is reused."""

from __future__ import annotations

import json

import pytest

from umbp_nvme.bench import store as bench_store
from umbp_nvme.bench.scale import parse_count


def test_scale_fills_measures_and_judges(tmp_path, capsys):
    out = tmp_path / "rows.json"
    args = ["--scale", "3k", "--runs", "1", "--exists-calls", "20", "--dir", str(tmp_path / "d"), "--keep",
            "--json", str(out)]  # fmt: skip
    assert bench_store.main(args) == 0
    text = capsys.readouterr().out
    assert "fill " in text and "3000 objects" in text
    for what in ("filling writer RSS (anonymous)", "writer RSS (anonymous)", "reader RSS (anonymous)", "writer first answer",
                 "reopen =", "writer exists(128)", "reader exists(128)"):
        assert f"bench target (issue 36): {what}" in text
    rows = json.loads(out.read_text())
    opened = {r["system"]: r for r in rows if r["op"] == "scale_open"}
    assert set(opened) == {"umbp_store", "umbp_store_ro"}
    assert opened["umbp_store_ro"]["runs"][0]["key_set"] == "ready"  # the reader measured from its key set
    assert opened["umbp_store"]["objects"] == 3000 and opened["umbp_store"]["reopen_s"] > 0
    assert bench_store.main(args) == 0  # the kept store is reused, not refilled
    assert "scale store: reused" in capsys.readouterr().out


def test_scale_counts_are_checked():
    assert parse_count("10m") == 10_000_000 and parse_count("1.5k") == 1500
    for bad in ("ten", "100", "1.00001k"):
        with pytest.raises(ValueError):
            parse_count(bad)
