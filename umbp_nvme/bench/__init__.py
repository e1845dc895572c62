"""``umbp-nvme bench engine|store|hicache|gds|mixed|trace|fleet|scheduler|server [args]`` (or ``python -m umbp_nvme.bench ...``).

Each benchmark is a module here with ``main(argv)``; ``tools/bench_<name>.py`` are thin scripts
over them. Shared helpers (row format, alternating runs, tables, plots) are in ``common``. They
ship with the package, so the benchmarks run from any install, not only from a checkout.
"""

from __future__ import annotations

import importlib
import sys

BENCHES = ("engine", "store", "hicache", "gds", "mixed", "trace", "fleet", "scheduler", "server")


def load(name: str):
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}; expected one of: {', '.join(BENCHES)}")
    return importlib.import_module(f"{__name__}.{name}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: python -m umbp_nvme.bench {{{'|'.join(BENCHES)}}} [args]   (each takes --help)")
        return 0 if argv else 2
    return int(load(argv[0]).main(argv[1:]) or 0)
