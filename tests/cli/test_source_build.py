"""Issue 29: building from source on a machine without a compiler fails with one line that names
what to install (setup.py), instead of setuptools' `No such file or directory: 'gcc'` deep in a
traceback. (The wheel side, installed and run with no compiler on PATH, is tools/wheel_check.sh
in .ci/run.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT

# the headers package named is the running Python's own (python3.10-dev ... python3.13-dev)
LINE = re.compile(r"^umbp_nvme: building its C extension needs a C compiler \((\S+) is not on PATH\): on "
                  rf"Debian/Ubuntu `apt-get install gcc python{sys.version_info[0]}\.{sys.version_info[1]}-dev`, "
                  r"or install a prebuilt wheel instead \(`make wheel` on a machine that has them, then "
                  r"`pip install --find-links dist umbp_nvme`\)$", re.M)


def _source_tree(tmp_path):
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    shutil.copytree(os.path.join(ROOT, "native"), tmp_path / "native")
    (tmp_path / "umbp_nvme").mkdir()
    shutil.copy(os.path.join(ROOT, "umbp_nvme", "__init__.py"), tmp_path / "umbp_nvme")
    bin_dir = tmp_path / "bin"  # PATH holds nothing: no gcc, cc or make
    bin_dir.mkdir()
    return bin_dir


def _build(tmp_path, bin_dir, **env):
    # this venv's python by its path (a symlink to it elsewhere would run the base interpreter,
    # without the venv's setuptools)
    return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PATH": str(bin_dir), "HOME": str(tmp_path), **env})


def test_no_compiler_on_path_is_one_line_naming_what_to_install(tmp_path):
    bin_dir = _source_tree(tmp_path)
    p = _build(tmp_path, bin_dir)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr and "No such file or directory" not in p.stderr
    m = LINE.search(p.stderr)
    assert m, p.stderr[-2000:]
    assert not list(tmp_path.glob("umbp_nvme/*.so"))


def test_the_line_names_the_compiler_cc_asks_for(tmp_path):
    bin_dir = _source_tree(tmp_path)
    p = _build(tmp_path, bin_dir, CC="clang-99 -O2")
    m = LINE.search(p.stderr)
    assert p.returncode != 0 and m and m.group(1) == "clang-99", p.stderr[-2000:]
