"""Issue 35: the package and its tests run on every supported CPython (3.10-3.13; setup.cfg's
python_requires). `make test-pythons` runs the suites on each; this checks, on whichever Python
runs it, that no module uses syntax or a standard-library name newer than the oldest supported
one unless it is behind a check (as store/put_path.py's asyncio.timeout is)."""

from __future__ import annotations

import ast
import os

import pytest

from conftest import ROOT

OLDEST = (3, 10)
# standard-library names that Python 3.10 lacks: (module, attribute) -> the release that added it
NEWER = {
    ("asyncio", "timeout"): "3.11", ("asyncio", "timeout_at"): "3.11", ("asyncio", "TaskGroup"): "3.11",
    ("asyncio", "Runner"): "3.11", ("datetime", "UTC"): "3.11", ("typing", "Self"): "3.11",
    ("typing", "LiteralString"): "3.11", ("typing", "Never"): "3.11", ("typing", "assert_never"): "3.11",
    ("typing", "reveal_type"): "3.11", ("typing", "NotRequired"): "3.11", ("typing", "Required"): "3.11",
    ("enum", "StrEnum"): "3.11", ("contextlib", "chdir"): "3.11", ("hashlib", "file_digest"): "3.11",
    ("itertools", "batched"): "3.12", ("typing", "override"): "3.12",
}
NEWER_MODULES = {"tomllib": "3.11", "wsgiref.types": "3.11"}
NEWER_BUILTINS = {"ExceptionGroup": "3.11", "BaseExceptionGroup": "3.11"}


def _sources():
    for top in ("umbp_nvme", "tests", "tools"):
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(folder, f)
                    yield os.path.relpath(path, ROOT), path


def _guarded(node, parents) -> bool:
    """Inside `if <check>:` where the check names the feature or the version (hasattr, a flag set
    from hasattr, sys.version_info), or in a try whose handler catches its absence."""
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "version_info" in test or "hasattr" in test or test.lstrip("not ").isupper():
                return True
        if isinstance(node, ast.Try) and any(
            h.type is not None and any(n in ast.unparse(h.type) for n in ("ImportError", "AttributeError"))
            for h in node.handlers
        ):
            return True
    return False


def _findings(rel: str, tree: ast.AST) -> list[str]:
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out = []
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            hit = NEWER.get((node.value.id, node.attr))
            name = f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module:
            hit = NEWER_MODULES.get(node.module) or next(
                (NEWER[(node.module, a.name)] for a in node.names if (node.module, a.name) in NEWER), None)
            name = f"from {node.module} import ..."
        elif isinstance(node, ast.Import):
            hit = next((NEWER_MODULES[a.name] for a in node.names if a.name in NEWER_MODULES), None)
            name = "import " + ", ".join(a.name for a in node.names)
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            hit, name = NEWER_BUILTINS[node.id], node.id
        if hit and not _guarded(node, parents):
            out.append(f"{rel}:{node.lineno}: {name} (Python {hit}+)")
    return out


def test_no_module_needs_a_python_newer_than_the_oldest_supported():
    findings = []
    for rel, path in _sources():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:  # syntax: except*, PEP 695 type parameters, etc. are refused at 3.10's grammar
            tree = ast.parse(text, filename=rel, feature_version=OLDEST)
        except SyntaxError as e:
            findings.append(f"{rel}:{e.lineno}: syntax newer than Python 3.10: {e.msg}")
            continue
        findings += _findings(rel, tree)
    assert findings == []


@pytest.mark.parametrize("snippet, found", [
    ("import asyncio\nasync def f():\n    async with asyncio.timeout(1):\n        pass\n", True),
    ("import asyncio, sys\nif sys.version_info >= (3, 11):\n    T = asyncio.TaskGroup\n", False),
    ("import asyncio\nHAS = hasattr(asyncio, 'timeout')\nif HAS:\n    t = asyncio.timeout\n", False),
    ("import tomllib\n", True),
    ("try:\n    import tomllib\nexcept ImportError:\n    tomllib = None\n", False),
    ("from datetime import UTC\n", True),
    ("raise ExceptionGroup('x', [ValueError()])\n", True),
])
def test_the_check_sees_what_3_10_lacks_and_lets_a_guarded_use_pass(snippet, found):
    assert bool(_findings("x.py", ast.parse(snippet))) is found
