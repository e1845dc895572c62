"""Issue 29: the README is a front page that cannot rot.

Its Python example runs here exactly as printed; the paths it names exist; it stays short, with
the two commands on its first screen; every measured table lives in docs/benchmarks.md under a
heading that carries its full date.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT

README = os.path.join(ROOT, "README.md")
BENCHMARKS = os.path.join(ROOT, "docs", "benchmarks.md")
MARKER = "<!-- readme-example"
MONTH_DAY = re.compile(r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)\w* \d{1,2}\b")
FULL_DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def readme_example() -> str:
    text = _read(README)
    after = text[text.index(MARKER):]
    m = re.search(r"```python\n(.*?)```", after, re.S)
    assert m, "the README's example block is missing after its marker"
    return m.group(1)


def test_the_readme_example_runs_and_prints_what_its_comments_say(tmp_path):
    code = readme_example()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["[True, True, True, True]", "[True, True, True, True]", "4"]
    assert os.path.isfile(tmp_path / "umbp-example" / "MANIFEST.json")  # it made a real store where it said


def test_the_readme_example_is_short_and_imports_from_the_top_level():
    code = readme_example()
    assert len(code.strip().splitlines()) <= 22
    assert "from umbp_nvme import PageStore, StoreConfig" in code


def test_the_readme_is_a_front_page():
    lines = _read(README).splitlines()
    assert len(lines) < 180
    first_screen = "\n".join(lines[:25])
    assert "make demo" in first_screen and "make test" in first_screen
    assert "python3.11-dev" in first_screen and "gcc" in first_screen  # the prerequisites, before anything fails
    tables = [i for i, ln in enumerate(lines) if ln.startswith("|---")]
    assert len(tables) == 1, "one table of headline figures; the others live in docs/"
    assert not MONTH_DAY.search("\n".join(lines)), "dates carry their year"


def test_every_path_the_readme_names_exists():
    text = _read(README)
    named = set(re.findall(r"\b((?:docs|tools|tests)/[\w./-]+\.\w+)", text))
    assert named, "the README names its docs"
    missing = sorted(p for p in named if not os.path.exists(os.path.join(ROOT, p)))
    assert missing == []


def test_ci_runs_the_readme_test_command():
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    assert re.search(r"^make test$", ci, re.M)
    assert "make test" in _read(README)


def test_every_table_in_docs_benchmarks_sits_under_a_dated_heading_with_its_command():
    headings: list[tuple[int, str]] = []  # the open heading chain: (level, text)
    section_has_command = False
    undated = []
    for ln in _read(BENCHMARKS).splitlines():
        m = re.match(r"^(#+) (.*)", ln)
        if m:
            level = len(m.group(1))
            headings = [h for h in headings if h[0] < level] + [(level, m.group(2))]
            section_has_command = False
            continue
        if "bench" in ln and "`" in ln or "tools/" in ln:
            section_has_command = True
        if ln.startswith("|---") and not any(FULL_DATE.search(t) for _, t in headings):
            undated.append(headings[-1][1])
        if ln.startswith("|---") and not section_has_command and len(headings) < 3:
            undated.append("no command: " + headings[-1][1])
    assert undated == []
    assert not MONTH_DAY.search(_read(BENCHMARKS))


def test_the_readme_sglang_config_is_one_the_backend_accepts(caplog):
    import json

    from umbp_nvme.config import load_config

    text = _read(README)
    raw = re.search(r"--hicache-storage-backend-extra-config '(\{.*?\})'", text, re.S).group(1)
    extra = json.loads(raw)
    assert extra["module_path"] == "umbp_nvme.sglang_backend" and extra["class_name"] == "UMBPNvmeStore"
    cfg = load_config(extra, env={})
    assert cfg.ssd_capacity_bytes == 512 << 30 and cfg.ssd_durability_mode == "relaxed"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # no key the backend does not know
