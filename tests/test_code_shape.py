"""No class over 400 lines inside umbp_nvme/ (issue 28): a class that long holds more than one
job; split it by job (the store's mixins show how). Nested classes count inside their outer one
and on their own."""

from __future__ import annotations

import ast
import os

import umbp_nvme

PACKAGE_DIR = os.path.dirname(os.path.abspath(umbp_nvme.__file__))
CLASS_LINES_MAX = 400


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


def private_reach(files: list[str]) -> list[str]:
    """Reads or writes of a class's underscore attribute (``obj._name`` or ``getattr(obj, "_name")``
    with ``obj`` not ``self`` / ``cls``) outside the file that defines that class, among ``files``.
    A name is a class's when one of the files' classes defines it (a method, a class attribute,
    or ``self._name = ...``); module-private names of other packages are not looked at."""
    trees = {f: ast.parse(open(f, encoding="utf-8").read(), f) for f in files}
    owners: dict[str, set[str]] = {}
    for f, tree in trees.items():
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = {n.name for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            names |= {t.id for n in c.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            names |= {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
            names |= {n.attr for n in ast.walk(c) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                      and isinstance(n.value, ast.Name) and n.value.id == "self"}  # fmt: skip
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    owners.setdefault(name, set()).add(f)
    out = []
    for f, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                obj, name = n.value, n.attr
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "setattr",
                  "hasattr") and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)):  # fmt: skip
                obj, name = n.args[0], n.args[1].value
            else:
                continue
            if name not in owners or (isinstance(obj, ast.Name) and obj.id in ("self", "cls")):
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


def test_no_store_module_reaches_into_another_class_s_underscore_attributes():
    store = os.path.join(PACKAGE_DIR, "store")
    files = sorted(os.path.join(store, f) for f in os.listdir(store) if f.endswith(".py"))
    assert private_reach(files) == []
