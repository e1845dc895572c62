"""No class over 400 lines inside umbp_nvme/ (issue 28): a class that long holds more than one
job; split it by job (the store's mixins show how). Nested classes count inside their outer one
and on their own. No module uses another's underscore names (issue 28): what crosses a module
boundary is public, so a reader sees every seam. No module over 600 lines (issue 35): split it by
job too, not by line count."""

from __future__ import annotations

import ast
import os
import re

import umbp_nvme

PACKAGE_DIR = os.path.dirname(os.path.abspath(umbp_nvme.__file__))
CLASS_LINES_MAX = 400
MODULE_LINES_MAX = 600


def class_lengths(package_dir: str) -> list[tuple[int, str, str]]:
    """(lines, file relative to the package, class name) for every class in every .py file."""
    out = []
    for d, _, files in os.walk(package_dir):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(d, f)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    first = min([dec.lineno for dec in node.decorator_list] + [node.lineno])
                    out.append((node.end_lineno - first + 1, os.path.relpath(path, package_dir), node.name))
    return out


def test_the_measure_sees_classes_and_their_length(tmp_path):
    (tmp_path / "m.py").write_text("class A:\n    x = 1\n\n    def f(self):\n        return 2\n\n\n@dec\nclass B:\n    pass\n")
    assert sorted(class_lengths(str(tmp_path))) == [(3, "m.py", "B"), (5, "m.py", "A")]  # a decorator counts


def test_no_class_is_over_400_lines():
    long = sorted((n, f, c) for n, f, c in class_lengths(PACKAGE_DIR) if n > CLASS_LINES_MAX)
    assert not long, "classes over %d lines: %s" % (CLASS_LINES_MAX, ", ".join(f"{f}:{c} ({n})" for n, f, c in long))


def module_lengths(package_dir: str) -> list[tuple[int, str]]:
    """(lines, file relative to the package) for every .py file."""
    out = []
    for d, _, files in os.walk(package_dir):
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    out.append((len(fh.read().splitlines()), os.path.relpath(os.path.join(d, f), package_dir)))
    return out


def test_the_module_measure_counts_every_line(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.py").write_text("x = 1\n" * 601)
    (tmp_path / "n.py").write_text("\n\n# end, no newline")
    assert sorted(module_lengths(str(tmp_path))) == [(3, "n.py"), (601, os.path.join("sub", "m.py"))]


def test_no_module_is_over_600_lines():
    long = sorted((n, f) for n, f in module_lengths(PACKAGE_DIR) if n > MODULE_LINES_MAX)
    assert len(module_lengths(PACKAGE_DIR)) > 100
    assert not long, "modules over %d lines (split each by job): %s" % (
        MODULE_LINES_MAX, ", ".join(f"{f} ({n})" for n, f in long))


# Underscore names other modules may still use: the GDS package's replaceable names (tests and
# callers replace them on the package and its modules look them up there at call time; see
# engine/gds/__init__.py) and the compiled extension module ``umbp_nvme._uring``.
CROSS_MODULE_OK = frozenset({"_device_ops", "_import_kvikio", "_check_libcuda", "_check_torch_cuda", "_check_kvikio",
                             "_uring"})  # fmt: skip


def _private(name) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _owners(trees: dict) -> dict[str, set[str]]:
    """Underscore name -> the files that define it: a class's (a method, a class attribute,
    ``self._name = ...``) or a module's own (a top-level def, class or assignment)."""
    owners: dict[str, set[str]] = {}
    for f, tree in trees.items():
        names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        names |= {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        names |= {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names |= {n.name for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            names |= {t.id for n in c.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            names |= {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            names |= {n.attr for n in ast.walk(c) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                      and isinstance(n.value, ast.Name) and n.value.id == "self"}  # fmt: skip
        for name in names:
            if _private(name):
                owners.setdefault(name, set()).add(f)
    return owners


def _reaches(n: ast.AST):
    """(object, name) pairs node ``n`` uses: ``obj._name``, ``getattr/setattr/hasattr/delattr(obj,
    "_name")`` and ``monkeypatch.setattr(obj, "_name", ...)``; a dotted string target
    (``monkeypatch.setattr("umbp_nvme.m._name", ...)``) gives (None, name)."""
    if isinstance(n, ast.Attribute):
        yield n.value, n.attr
    elif isinstance(n, ast.Call) and n.args:
        f = n.func
        fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if fname in ("getattr", "setattr", "hasattr", "delattr") or (isinstance(f, ast.Attribute) and fname in
                                                                      ("setattr", "delattr", "setitem")):  # fmt: skip
            a0 = n.args[0]
            if len(n.args) >= 2 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
                yield a0, n.args[1].value
            elif isinstance(a0, ast.Constant) and isinstance(a0.value, str) and a0.value.startswith("umbp_nvme."):
                yield None, a0.value.rsplit(".", 1)[1]


def private_reach(files: list[str], owner_files: list[str] | None = None) -> list[str]:
    """Uses of an underscore name outside the file that defines it, among ``files``: a class's
    attribute read or written on an object other than ``self`` / ``cls``, a module's private
    function, class or constant used as ``module._name``, or imported (``from .m import _name``)
    from one of our modules. Names come from ``owner_files`` (``files`` unless given); underscore
    names of other packages (asyncio, os, prometheus_client) are not looked at; CROSS_MODULE_OK is."""
    trees = {f: ast.parse(open(f, encoding="utf-8").read(), f) for f in files}
    if owner_files is None:
        owners = _owners(trees)
    else:
        owners = _owners({f: ast.parse(open(f, encoding="utf-8").read(), f) for f in owner_files})
    out = []
    for f, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").split(".")[0] == "umbp_nvme"):
                bad = [a.name for a in n.names if _private(a.name) and a.name not in CROSS_MODULE_OK]
                if bad:
                    out.append(f"{os.path.relpath(f, PACKAGE_DIR)}:{n.lineno}: import {', '.join(bad)}")
                continue
            for obj, name in _reaches(n):
                if not _private(name) or name not in owners or name in CROSS_MODULE_OK:
                    continue
                if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
                    continue
                if owners[name] != {f}:
                    out.append(f"{os.path.relpath(f, PACKAGE_DIR)}:{n.lineno}: {ast.unparse(n)}")
    return out


def test_the_reach_check_sees_a_private_read_from_another_file(tmp_path):
    (tmp_path / "a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n\n    def _f(self):\n"
                                   "        return self._x\n")  # fmt: skip
    (tmp_path / "b.py").write_text("def g(a):\n    return a._x + getattr(a, '_f')()\n")
    found = private_reach([str(tmp_path / "a.py"), str(tmp_path / "b.py")])
    assert [line.split(": ", 1)[1] for line in found] == ["a._x", "getattr(a, '_f')"]


def test_the_reach_check_sees_module_private_names_used_from_another_file(tmp_path):
    (tmp_path / "a.py").write_text("_LIMIT = 3\n\n\ndef _helper():\n    return _LIMIT\n")
    (tmp_path / "b.py").write_text("from . import a\nfrom .a import _helper\n\n\ndef g(mp):\n"
                                   "    mp.setattr(a, '_helper', None)\n    return a._LIMIT\n")  # fmt: skip
    found = private_reach([str(tmp_path / "a.py"), str(tmp_path / "b.py")])
    got = [line.split(": ", 1)[1] for line in found]
    assert got == ["import _helper", "mp.setattr(a, '_helper', None)", "a._LIMIT"]


def package_files() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(PACKAGE_DIR) for f in fs if f.endswith(".py"))


def test_no_module_reaches_into_another_module_s_underscore_names():
    assert private_reach(package_files()) == []


def private_reach_in_strings(files: list[str], owner_files: list[str]) -> list[str]:
    """``name._x`` inside string constants of ``files`` (code a test runs in a child process),
    ``_x`` an underscore name of ``owner_files``; docstrings count too, so name a module instead."""
    owners = _owners({f: ast.parse(open(f, encoding="utf-8").read(), f) for f in owner_files})
    out = []
    for f in files:
        for n in ast.walk(ast.parse(open(f, encoding="utf-8").read(), f)):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                for m in re.finditer(r"\b\w+\.(_[A-Za-z]\w*)", n.value):
                    name = m.group(1)
                    if name in owners and not name.startswith("__") and name not in CROSS_MODULE_OK:
                        out.append(f"{os.path.relpath(f, PACKAGE_DIR)}:{n.lineno}: {m.group(0)} (in a string)")
    return out


def test_the_string_check_sees_a_reach_in_a_child_script(tmp_path):
    (tmp_path / "a.py").write_text("class A:\n    def __init__(self):\n        self._x = 1\n")
    (tmp_path / "t.py").write_text('CHILD = """\nprint(a._x, a.x, gds._device_ops)\n"""\n')
    found = private_reach_in_strings([str(tmp_path / "t.py")], [str(tmp_path / "a.py")])
    assert [line.split(": ", 1)[1] for line in found] == ["a._x (in a string)"]


def test_no_test_reaches_into_our_underscore_names():
    """Tests use what a caller can: public calls, read-only properties and stats, and the seams
    docs/architecture.md lists ("Seams tests use"); tests/support/ and child scripts included."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    tests = sorted(os.path.join(d, f) for d, _, fs in os.walk(tests_dir) for f in fs if f.endswith(".py"))
    assert private_reach(tests, package_files()) + private_reach_in_strings(tests, package_files()) == []
