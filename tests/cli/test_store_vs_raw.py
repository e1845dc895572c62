"""tools/store_vs_raw.py: the store against the raw engine on the same extents, rounds alternated in
one process (docs/benchmarks.md's put analysis). A tiny run of each op on a temporary directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools",
                    "store_vs_raw.py")  # fmt: skip


@pytest.mark.parametrize("args", [["--op", "put", "--keys", "sglang"], ["--op", "get", "--cold", "--keys", "short"]])
def test_a_tiny_run_reports_the_ratio_and_for_puts_the_index_commits(tmp_path, args):
    p = subprocess.run([sys.executable, TOOL, *args, "--rounds", "2", "--batches", "2", "--objects", "8",
                        "--object-bytes", "8192", "--segment-bytes", str(1 << 20), "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"store/raw (\d+\.\d+) .*store (\d+\.\d+) raw (\d+\.\d+)", p.stdout)
    assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0 and float(m.group(3)) > 0, p.stdout
    assert ("index commits" in p.stdout) == (args[1] == "put")
    assert os.listdir(tmp_path) == []  # its store went with its temporary directory


def test_steps_time_each_put_step_inside_the_whole_call(tmp_path):
    p = subprocess.run([sys.executable, TOOL, "--op", "put", "--steps", "--rounds", "2", "--batches", "2", "--objects",
                        "8", "--object-bytes", "8192", "--segment-bytes", str(1 << 20), "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("steps, median us per batch: "))
    steps = dict((k, float(v)) for k, v in (s.rsplit(" ", 1) for s in line.split(": ", 1)[1].split(", ")))
    assert set(steps) == {"put_many", "reserve", "write", "await_io", "records_landed", "sync_written", "publish"}
    assert all(v > 0 for v in steps.values())
    # they nest: the call holds every step, the data write its I/O wait and its records' landing
    # (a median keeps the order that holds call by call)
    assert steps["put_many"] == max(steps.values()) and steps["write"] > steps["await_io"]


def test_bad_shapes_are_refused():
    p = subprocess.run([sys.executable, TOOL, "--objects", "7"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--objects must be even" in p.stderr
    p = subprocess.run([sys.executable, TOOL, "--op", "get", "--steps"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--steps times the put path" in p.stderr
