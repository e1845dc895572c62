"""Issue 35, packaging: one version written once, LICENSE and CHANGELOG shipped, the Python and
SGLang versions named alike everywhere, and the wheel scripts' choices of interpreter. All offline:
the wheels themselves are built and run by `make wheel` and tools/wheel_check.sh in .ci/run."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import tarfile

import pytest

import umbp_nvme
from conftest import ROOT

TOOLS = os.path.join(ROOT, "tools")


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return cfg


def _shell_list(path: str, name: str) -> list[str]:
    m = re.search(rf'^{name}="([^"]*)"$', _read(path), re.M)
    assert m, f"{path} has no {name}=\"...\" line"
    return m.group(1).split()


SUPPORTED_PYTHONS = _shell_list("tools/pythons.sh", "SUPPORTED_PYTHONS")
SUPPORTED_SGLANG = _shell_list("tools/install_sglang.sh", "SUPPORTED_SGLANG")


# ---------------------------------------------------------------------------------------------
# one version, one place


def test_the_version_is_written_once_and_read_from_there():
    assert re.fullmatch(r"\d+\.\d+\.\d+", umbp_nvme.__version__)
    assert _setup_cfg()["metadata"]["version"] == "attr: umbp_nvme.__version__"
    for name in ("setup.py", "pyproject.toml", "Makefile"):
        assert umbp_nvme.__version__ not in _read(name), f"{name} repeats the version"
    assert "version" not in _read("pyproject.toml").split("[build-system]")[0]


def test_umbp_nvme_version_says_the_package_version_and_python():
    p = subprocess.run([sys.executable, "-m", "umbp_nvme.cli.main", "--version"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    py = ".".join(map(str, sys.version_info[:3]))
    assert p.stdout.strip() == f"umbp-nvme {umbp_nvme.__version__} (Python {py})"


def test_the_changelog_has_the_version_under_a_dated_heading_and_unreleased_above_it():
    text = _read("CHANGELOG.md")
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert headings[0] == ("Unreleased", "")
    assert (umbp_nvme.__version__, headings[1][1]) == headings[1] and headings[1][1], headings
    assert "tools/tag_release.sh" in text and "vX.Y.Z" in text  # how a release is tagged


def _release_check(tree, version: str, changelog: str):
    """tools/tag_release.sh --check on a tree holding only what it reads."""
    (tree / "tools").mkdir(parents=True)
    (tree / "umbp_nvme").mkdir()
    shutil.copy(os.path.join(TOOLS, "tag_release.sh"), tree / "tools")
    (tree / "umbp_nvme" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    (tree / "CHANGELOG.md").write_text(changelog)
    return subprocess.run(["bash", str(tree / "tools" / "tag_release.sh"), "--check"], capture_output=True,
                          text=True, timeout=60)


def test_tag_release_checks_the_version_and_its_changelog_heading(tmp_path):
    ok = _release_check(tmp_path / "a", "1.2.3", "## [Unreleased]\n\n## [1.2.3] - 2026-12-06\n")
    assert ok.returncode == 0 and "v1.2.3 is ready to tag" in ok.stdout, ok.stderr
    bad = _release_check(tmp_path / "b", "1.2", "## [1.2] - 2026-12-06\n")
    assert bad.returncode == 1 and "'1.2', not X.Y.Z" in bad.stderr
    undated = _release_check(tmp_path / "c", "1.2.4", "## [Unreleased]\n\n## [1.2.3] - 2026-12-06\n")
    assert undated.returncode == 1 and "no '## [1.2.4] - YYYY-MM-DD' heading" in undated.stderr


def test_this_tree_is_ready_to_tag():
    p = subprocess.run(["bash", os.path.join(TOOLS, "tag_release.sh"), "--check"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"tag_release: v{umbp_nvme.__version__} is ready to tag"


# ---------------------------------------------------------------------------------------------
# LICENSE and CHANGELOG in what is shipped


def test_license_is_the_full_apache_2_text():
    text = _read("LICENSE")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for clause in ("1. Definitions.", "4. Redistribution.", "9. Accepting Warranty or Additional Liability.",
                   "END OF TERMS AND CONDITIONS"):
        assert clause in text
    assert len(text.splitlines()) > 190
    meta = _setup_cfg()["metadata"]
    assert meta["license"] == "Apache-2.0" and meta["license_files"].split() == ["LICENSE"]


def _source_copy(tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", "LICENSE", "CHANGELOG.md"):
        shutil.copy(os.path.join(ROOT, name), tree)
    for name in ("native", "docs"):
        shutil.copytree(os.path.join(ROOT, name), tree / name)
    shutil.copytree(os.path.join(ROOT, "umbp_nvme"), tree / "umbp_nvme",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    return tree


def _setup(tree, *args):
    p = subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=tree, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


def test_the_sdist_carries_license_and_changelog(tmp_path):
    pytest.importorskip("setuptools")
    tree = _source_copy(tmp_path)
    _setup(tree, "sdist", "-d", str(tmp_path / "dist"))
    (sdist,) = (tmp_path / "dist").iterdir()
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
        pkg_info = t.extractfile(f"umbp_nvme-{umbp_nvme.__version__}/PKG-INFO").read().decode()
    assert {"LICENSE", "CHANGELOG.md", "native/uring_module.c", "docs/sglang.md"} <= names
    assert "License-File: LICENSE" in pkg_info and "Requires-Python: >=3.10" in pkg_info


def test_the_built_package_carries_the_changelog_beside_the_docs(tmp_path):
    """What goes into the wheel's umbp_nvme/ (build_py; LICENSE goes to the dist-info)."""
    pytest.importorskip("setuptools")
    tree = _source_copy(tmp_path)
    _setup(tree, "build_py", "-d", str(tmp_path / "lib"))
    docs = tmp_path / "lib" / "umbp_nvme" / "docs"
    assert (docs / "CHANGELOG.md").read_text() == _read("CHANGELOG.md")
    assert (docs / "cli.md").is_file()


# ---------------------------------------------------------------------------------------------
# the Python versions: said alike in setup.cfg, the wheel scripts and the README


def test_the_supported_pythons_are_the_same_everywhere():
    assert SUPPORTED_PYTHONS == ["3.10", "3.11", "3.12", "3.13"]
    meta, opts = _setup_cfg()["metadata"], _setup_cfg()["options"]
    assert opts["python_requires"].strip() == f">={SUPPORTED_PYTHONS[0]}"
    classified = re.findall(r"Programming Language :: Python :: (3\.\d+)", meta["classifiers"])
    assert classified == SUPPORTED_PYTHONS
    assert f"CPython {SUPPORTED_PYTHONS[0]}-{SUPPORTED_PYTHONS[-1]}" in _read("README.md")
    assert sys.version_info[:2] >= tuple(map(int, SUPPORTED_PYTHONS[0].split(".")))


def _find_python(version: str, env: dict) -> subprocess.CompletedProcess:
    script = f'source "{TOOLS}/pythons.sh"; find_python {version}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env)


def _fake_python(path, answers: str):
    """An executable that answers like `python -c '...version...'` with `answers`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{answers}'\n")
    path.chmod(0o755)


def test_find_python_skips_a_shim_that_is_not_that_version_and_takes_pyenvs_newest(tmp_path):
    bin_dir, root = tmp_path / "bin", tmp_path / "pyenv"
    _fake_python(bin_dir / "python3.12", "pyenv: python3.12: command not found")  # a shim, version not enabled
    _fake_python(root / "versions" / "3.12.1" / "bin" / "python3.12", "3.12")
    _fake_python(root / "versions" / "3.12.10" / "bin" / "python3.12", "3.12")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYENV_ROOT": str(root), "HOME": str(tmp_path)}
    p = _find_python("3.12", env)
    assert p.returncode == 0 and p.stdout.strip() == str(root / "versions" / "3.12.10" / "bin" / "python3.12")
    assert _find_python("3.99", env).returncode == 1  # none: nothing printed, exit 1


def _build_wheel(tmp_path, **env):
    run_env = {"PATH": "/usr/bin:/bin", "PYENV_ROOT": str(tmp_path / "no-pyenv"), "HOME": str(tmp_path), **env}
    return subprocess.run(["bash", os.path.join(TOOLS, "build_wheel.sh"), "/nonexistent/python"], capture_output=True,
                          text=True, timeout=60, env=run_env, cwd=tmp_path)


def test_make_wheel_refuses_a_python_it_does_not_support(tmp_path):
    p = _build_wheel(tmp_path, PYTHONS="3.9 3.11")
    assert p.returncode == 2 and "Python 3.9 is not one umbp_nvme supports (3.10 3.11 3.12 3.13)" in p.stderr


def test_make_wheel_says_a_missing_interpreter_and_stops_when_pythons_names_it(tmp_path):
    p = _build_wheel(tmp_path, PYTHONS="3.13")  # PATH without pyenv's shims; an empty PYENV_ROOT
    if shutil.which("python3.13", path="/usr/bin:/bin"):
        pytest.skip("this machine has /usr/bin/python3.13")
    assert p.returncode == 1
    assert "build_wheel: no CPython 3.13 on this machine" in p.stderr
    assert "stopped: no interpreter for 3.13 (PYTHONS names it)" in p.stderr


def test_make_wheel_in_ci_stops_on_any_missing_supported_python(tmp_path):
    missing = [v for v in SUPPORTED_PYTHONS if not shutil.which(f"python{v}", path="/usr/bin:/bin")]
    if not missing:
        pytest.skip("every supported Python is in /usr/bin here")
    p = _build_wheel(tmp_path, CI="true")
    assert p.returncode == 1
    for v in missing:
        assert f"build_wheel: no CPython {v} on this machine" in p.stderr
    assert f"stopped: no interpreter for {' '.join(missing)} (CI builds every supported version)" in p.stderr


def test_make_wheel_passes_pythons_through():
    p = subprocess.run(["make", "-n", "wheel", "PYTHONS=3.12 3.13"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert 'PYTHONS="3.12 3.13" bash tools/build_wheel.sh' in p.stdout


# ---------------------------------------------------------------------------------------------
# the README's install lines are the ones wheel_check runs


def test_the_readme_installs_from_the_wheels_as_wheel_check_does():
    readme, check = _read("README.md"), _read("tools/wheel_check.sh")
    assert "pip install --find-links dist 'umbp_nvme[metrics]'" in readme
    assert "--find-links dist 'umbp_nvme[metrics]'" in check
    one_file = re.search(r"pip install 'dist/(umbp_nvme-[^']+\.whl)\[metrics\]'", readme)
    assert one_file and one_file.group(1).startswith(f"umbp_nvme-{umbp_nvme.__version__}-cp3")
    assert '"$whl[metrics]"' in check
    # a bare `pip install 'umbp_nvme[...]'` only works from an index, where umbp_nvme is not
    assert not re.search(r"pip install '?umbp_nvme\[", readme)


# ---------------------------------------------------------------------------------------------
# the SGLang releases


def test_the_sglang_range_is_the_same_in_the_scripts_readme_and_docs():
    assert SUPPORTED_SGLANG[-1] == "0.5.23" and len(SUPPORTED_SGLANG) >= 3
    span = f"SGLang {SUPPORTED_SGLANG[0]}-{SUPPORTED_SGLANG[-1]}"
    assert span in _read("README.md")
    assert span in _read("docs", "sglang.md")
    assert re.search(r"^sglang==0\.5\.23$", _read("tools", "requirements-sglang.txt"), re.M)  # the default


def test_install_sglang_refuses_a_release_outside_the_range_before_installing_anything(tmp_path):
    p = subprocess.run(["bash", os.path.join(TOOLS, "install_sglang.sh"), "/nonexistent/python", "--version", "0.5.9"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip() == (f"install_sglang.sh: sglang 0.5.9 is not one the backend is tested against "
                                f"({' '.join(SUPPORTED_SGLANG)})")
