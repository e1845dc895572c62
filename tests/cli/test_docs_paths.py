"""The docs name only modules that exist (issue 28 moved most of them into folders).

Checked in README.md and docs/*.md: every ``umbp_nvme/...py`` file and ``umbp_nvme/<dir>/``
folder, every folder-qualified module (``store/x.py``, ``sglang/x.py``, ...) and every dotted
module name (``umbp_nvme.cli.main``; a name after the module must occur in its source). Old paths
may appear only in the before column of docs/architecture.md's "Before / after" table; there each
one must be gone, unless its row's after column names it again (a module that stayed and gave
functions away), and a "(same names)" row's modules must exist in the folder that row names.
"""

from __future__ import annotations

import glob
import os
import re

from conftest import ROOT

PKG = "umbp_nvme"
# a file or folder path under the package; a bare name without .py or a trailing / is not one
FULL = re.compile(r"(?<![\w/.-])umbp_nvme/(?:\w+/)*(?:\w+\.py)?(?![\w.*-])")
FOLDERS = ("store", "engine", "sglang", "cli", "bench", "doctor")
RELATIVE = re.compile(r"(?<![\w/.-])(?:%s)/(?:\w+/)*\w+\.py(?!\w)" % "|".join(FOLDERS))
DOTTED = re.compile(r"(?<![\w/.-])umbp_nvme(?:\.\w+)+")
BEFORE_AFTER = "### Before / after"


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _module_file(root: str, parts: list[str]) -> str | None:
    """The source of the module or package ``parts`` names, "" for a compiled one, None if none."""
    base = os.path.join(root, *parts)
    for cand in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(cand):
            return cand
    return "" if glob.glob(base + ".*.so") else None


def _dotted_problem(root: str, name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        src = _module_file(root, parts[:i])
        if src is not None:
            break
    if i == 1 and len(parts) > 1 and src is not None and not re.search(rf"\b{parts[1]}\b", _read(src)):
        return name  # umbp_nvme.<x>: neither a module nor a name the package defines
    if i > 1 and i < len(parts) and src and not re.search(rf"\b{parts[i]}\b", _read(src)):
        return name  # module.<x>: the module has no such name
    return None


def _before_after_rows(text: str) -> list[tuple[str, str, str]]:
    """(line, before cell, after cell) of each row of the "Before / after" table."""
    if BEFORE_AFTER not in text:
        return []
    section = text[text.index(BEFORE_AFTER):]
    end = section.find("\n#")
    rows = []
    for ln in (section if end < 0 else section[:end]).splitlines():
        if ln.startswith("| ") and not ln.startswith("| before"):
            cells = [c.strip() for c in ln.strip().strip("|").split(" | ")]
            assert len(cells) == 2, f"a before/after row has two cells: {ln}"
            rows.append((ln, cells[0], cells[1]))
    return rows


def path_problems(text: str, root: str = ROOT) -> list[str]:
    """Every module path ``text`` names that does not resolve under ``root``."""
    problems = []
    rows = _before_after_rows(text)
    for line, before, after in rows:
        named_after = set(FULL.findall(after))
        for old in FULL.findall(before):
            if old not in named_after and os.path.exists(os.path.join(root, old)):
                problems.append(f"before/after: {old} still exists")
        if "(same names)" in after:
            (folder,) = [p for p in named_after if p.endswith("/")]
            for old in FULL.findall(before):
                new = folder + os.path.basename(old)
                if not os.path.isfile(os.path.join(root, new)):
                    problems.append(f"before/after: {new} (from {old}) does not exist")
        text = text.replace(line, after)  # old paths may appear in the before cells only
    for p in FULL.findall(text):
        if not os.path.exists(os.path.join(root, p)):
            problems.append(p)
    for p in RELATIVE.findall(text):
        if not os.path.isfile(os.path.join(root, PKG, p)):
            problems.append(p)
    for name in DOTTED.findall(text):
        bad = _dotted_problem(root, name)
        if bad:
            problems.append(bad)
    return sorted(set(problems))


def _docs() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def test_every_module_path_the_docs_name_exists():
    missing = {os.path.relpath(d, ROOT): path_problems(_read(d)) for d in _docs()}
    assert {d: p for d, p in missing.items() if p} == {}


def test_the_checks_see_the_paths_they_check():
    arch = _read(os.path.join(ROOT, "docs", "architecture.md"))
    assert len(set(FULL.findall(arch))) > 80  # the module table: every module by its full path
    assert len(set(RELATIVE.findall(arch))) > 10 and DOTTED.search(arch)
    rows = _before_after_rows(arch)
    assert len(rows) >= 8 and sum("(same names)" in a for _, _, a in rows) == 2
    assert DOTTED.search(_read(os.path.join(ROOT, "README.md")))  # module_path umbp_nvme.sglang_backend


def test_a_wrong_path_of_each_kind_is_reported():
    table = (
        f"{BEFORE_AFTER}\n| before | after |\n|---|---|\n"
        "| `umbp_nvme/config.py` | `umbp_nvme/store/` |\n"  # an old path that still exists
        "| `umbp_nvme/nope_a.py` | `umbp_nvme/sglang/` (same names) |\n"  # not in the new folder
        "| `umbp_nvme/store/page_store.py` | `umbp_nvme/store/page_store.py` stays |\n"  # fine
        "\n## next\n"
    )
    text = (
        "`umbp_nvme/store/nope_b.py`, `umbp_nvme/nope_dir/`, `store/nope_c.py`, `umbp_nvme.nope_d`,"
        " `umbp_nvme.cli.main.nope_e`, fine: `umbp_nvme/store/state.py`, `store/state.py`,"
        " `umbp_nvme.cli.main:main`, `umbp_nvme.sglang_backend.UMBPNvmeStore`, `umbp_nvme._uring.crc32c`,"
        " not paths: `tests/store/nope.py`, `umbp_nvme/_uring*.so`\n" + table
    )
    assert path_problems(text) == [
        "before/after: umbp_nvme/config.py still exists",
        "before/after: umbp_nvme/sglang/nope_a.py (from umbp_nvme/nope_a.py) does not exist",
        "store/nope_c.py",
        "umbp_nvme.cli.main.nope_e",
        "umbp_nvme.nope_d",
        "umbp_nvme/nope_dir/",
        "umbp_nvme/store/nope_b.py",
    ]
