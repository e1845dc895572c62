"""``python -m umbp_nvme.bench engine|store|hicache [args]``: run tools/bench_<name>.py's main(argv).

tools/ is not a package (the benchmarks are scripts that also run on their own), so they are
loaded by path from the checkout, with tools/ on sys.path for their shared ``benchlib``.
"""

from __future__ import annotations

import importlib.util
import os
import sys

BENCHES = ("engine", "store", "hicache")


def tools_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(os.path.dirname(here), "tools")


def load(name: str):
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}; expected one of: {', '.join(BENCHES)}")
    tools = tools_dir()
    path = os.path.join(tools, f"bench_{name}.py")
    if not os.path.exists(path):
        raise SystemExit(f"{path} not found: the {name} benchmark runs from a source checkout (tools/ is not installed)")
    if tools not in sys.path:
        sys.path.insert(0, tools)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m umbp_nvme.bench {{{'|'.join(BENCHES)}}} [args]   (each takes --help)")
        return 0 if argv else 2
    return int(load(argv[0]).main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
