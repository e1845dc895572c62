"""Tiny hand-made traces for the trace simulator's tests, and tools/*.py loaded as modules."""

from __future__ import annotations

import importlib.util
import os

import numpy as np

from umbp_nvme.bench.trace_file import Trace

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


def trace_of(reqs: list[list[int]], tokens: list[int] | None = None) -> Trace:
    """A Trace of these block-id lists (512 tokens a block unless ``tokens`` says otherwise)."""
    arrays = [np.asarray(r, np.int64) for r in reqs]
    n = max(max(r) for r in reqs) + 1
    toks = np.asarray(tokens if tokens is not None else [512 * len(r) for r in reqs], np.int64)
    return Trace(arrays, toks, np.zeros(len(reqs)), np.arange(n))


def load_tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(TOOLS, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
