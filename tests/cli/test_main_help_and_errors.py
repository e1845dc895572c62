"""`umbp-nvme` itself: help with examples, demo, bench dispatch, argument errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

import umbp_nvme.cli.main as cli

SUBCOMMANDS = ("warmup", "export", "stats", "verify", "compact", "inspect", "bench", "demo")


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_of_each_subcommand_shows_an_example(sub, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"umbp-nvme {sub}" in out


def test_no_subcommand_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "warmup" in capsys.readouterr().out


def test_demo_runs_round_trip_and_reports_ok(capsys):
    rc = cli.main(["demo"])  # how fast is what it prints (GB/s, CPU us/obj), not a bound here
    out = capsys.readouterr().out
    assert rc == 0
    assert "OK - every byte read back matches" in out and "GB/s" in out and "CPU us/obj" in out


def test_console_entry_point_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "umbp_nvme.cli", "stats", "--help"], cwd=ROOT, capture_output=True, timeout=60)
    assert r.returncode == 0 and b"umbp-nvme stats --store" in r.stdout


def test_bench_dispatches_to_tools_with_quick_plot_and_extra_args(monkeypatch):
    from umbp_nvme import bench

    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["bench", "store", "--quick", "--plot", "x.png", "--", "--runs", "1"]) == 0
    assert cli.main(["bench"]) == 0
    assert seen == [["store", "--quick", "--plot", "x.png", "--runs", "1"], ["engine"]]


def test_bad_sizes_and_missing_arguments_are_refused_clearly(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["stats", "--store", str(tmp_path), "--capacity", "lots"])
    assert e.value.code == 2 and "'lots' is not a size" in capsys.readouterr().err
    assert cli.main(["warmup", "--store", str(tmp_path / "s")]) == 2
    assert "at least one SOURCE" in capsys.readouterr().err
    assert cli.main(["warmup", "--replay", "p.jsonl"]) == 2
    assert "--server" in capsys.readouterr().err
    assert cli.main(["warmup", "--store", str(tmp_path / "s"), str(tmp_path / "nowhere")]) == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err


def test_parse_size():
    assert cli.parse_size("4096") == 4096
    assert cli.parse_size("64k") == 65536
    assert cli.parse_size("512MiB") == 512 << 20
    assert cli.parse_size("1.5g") == 3 << 29
