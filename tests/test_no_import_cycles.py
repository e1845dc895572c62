"""No import cycle inside umbp_nvme/ (issue 28): every ``import`` / ``from ... import`` anywhere in
a module (top level, inside functions, under ``if TYPE_CHECKING``) is an edge to the module it
names; a cycle among them fails the test and is listed. The same edges show the layers: the core
(``store/``, ``engine/``) imports none of the folders that serve callers (``sglang/``, ``cli/``,
``bench/``, ``doctor/``, the ``sglang_backend`` alias), and the SGLang adapter (``sglang/``) and the
doctor (``doctor/``, shown by the command line and logged by the adapter) import nothing of the
command line (``cli/``) (issue 35).

A ``from pkg import name`` is an edge to ``pkg.name`` when that is a module (a compiled extension
included), else to ``pkg``. The implicit import of a parent package that every submodule import
makes is not an edge: a package's ``__init__`` re-exporting its modules is not a cycle.
"""

from __future__ import annotations

import ast
import os

import umbp_nvme

PACKAGE_DIR = os.path.dirname(os.path.abspath(umbp_nvme.__file__))


def modules(package_dir: str, package: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py file and compiled extension under the package."""
    out = {}
    for d, _, files in os.walk(package_dir):
        for f in files:
            if not (f.endswith(".py") or f.endswith(".so")):
                continue
            rel = os.path.relpath(os.path.join(d, f), package_dir)
            parts = [package, *rel.split(os.sep)]
            parts[-1] = parts[-1].split(".")[0]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = os.path.join(d, f)
    return out


def _known(name: str, mods: dict) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: str, mods: dict) -> set[str]:
    """The package's modules that ``name`` (at ``path``) imports, anywhere in its source."""
    if path.endswith(".so"):
        return set()
    here = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            out.update(_known(a.name, mods) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in mods else _known(base, mods))
    out.discard(None)
    out.discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def import_graph(package_dir: str, package: str) -> dict[str, set[str]]:
    mods = modules(package_dir, package)
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


CORE = ("store", "engine")
EDGES = ("sglang", "cli", "bench", "doctor", "sglang_backend")
# (folders, folders they never import): the core below every caller; the command line above the
# SGLang adapter and the doctor (the adapter logs the doctor's report; neither needs the CLI)
LAYERS = ((CORE, EDGES), (("sglang", "doctor"), ("cli",)))


def upward_imports(graph: dict[str, set[str]], package: str, layers=LAYERS) -> list[str]:
    """``a -> b`` for every import of a folder that ``a``'s folder may not import (``layers``)."""
    def under(name: str, folders) -> bool:
        return any(name == f"{package}.{f}" or name.startswith(f"{package}.{f}.") for f in folders)

    return sorted({f"{a} -> {b}" for low, high in layers for a, bs in graph.items() if under(a, low)
                   for b in bs if under(b, high)})


def test_the_store_and_the_engines_import_nothing_of_the_sglang_adapter_the_cli_or_the_benchmarks():
    graph = import_graph(PACKAGE_DIR, "umbp_nvme")
    assert any(n.startswith("umbp_nvme.sglang.") for n in graph) and any(n.startswith("umbp_nvme.cli.") for n in graph)
    assert not upward_imports(graph, "umbp_nvme"), "modules import a layer above:\n" + "\n".join(upward_imports(graph, "umbp_nvme"))


def test_the_sglang_adapter_reaches_the_doctor_without_the_command_line():
    graph = import_graph(PACKAGE_DIR, "umbp_nvme")
    assert "umbp_nvme.doctor.report" in graph["umbp_nvme.sglang.stores"]  # the report at open (doctor_at_start)
    assert "umbp_nvme.doctor.report" in graph["umbp_nvme.cli.commands"]  # umbp-nvme doctor
    assert upward_imports({"umbp_nvme.sglang.stores": {"umbp_nvme.cli.doctor"}}, "umbp_nvme") == [
        "umbp_nvme.sglang.stores -> umbp_nvme.cli.doctor"]  # the import issue 35 removed is one the rule names


def test_the_layer_check_finds_an_upward_import_at_function_level(tmp_path):
    pkg = tmp_path / "pkg"
    for d in ("store", "engine", "sglang", "cli"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "config.py").write_text("")
    (pkg / "store" / "a.py").write_text("from ..config import x\ndef f():\n    from ..sglang import keys\n")
    (pkg / "sglang" / "keys.py").write_text("import pkg.engine.b\n")  # downward: allowed
    (pkg / "engine" / "b.py").write_text("import pkg.cli.main\n")
    (pkg / "cli" / "main.py").write_text("")
    assert upward_imports(import_graph(str(pkg), "pkg"), "pkg") == ["pkg.engine.b -> pkg.cli.main", "pkg.store.a -> pkg.sglang.keys"]


def test_no_import_cycles_inside_the_package():
    graph = import_graph(PACKAGE_DIR, "umbp_nvme")
    assert len(graph) > 50 and graph["umbp_nvme.store.sync"]  # the walk saw the package and its imports
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        "  " + " <-> ".join(c) + "  (" + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) + ")"
        for c in found
    )


def test_the_check_finds_module_level_function_level_and_type_checking_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .b import B\nA = 1\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\nB = 2\n")  # function level
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..sub.d import D\n")
    (pkg / "sub" / "d.py").write_text("import pkg.sub.c\nD = 3\n")
    (pkg / "leaf.py").write_text("from pkg import a\nfrom .sub import c\n")  # imports only: no cycle
    found = cycles(import_graph(str(pkg), "pkg"))
    assert sorted(found) == [["pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
