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
