"""A machine without the sglang wheel, in a child process: put this folder first on PYTHONPATH.

The installed sglang package (any path entry holding sglang/__init__.py) and its distribution
metadata are invisible; everything else imports as usual. tests/cli/test_first_week.py runs
the SGLang tests under it to prove they skip (issue 35).
"""

import importlib.machinery
import importlib.metadata
import os
import sys


def _holds_sglang(entry: str) -> bool:
    return os.path.isfile(os.path.join(entry or ".", "sglang", "__init__.py"))


class _PathsWithoutSglang:
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" and path is None:
            path = [p for p in sys.path if not _holds_sglang(p)]
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    def find_distributions(self, context=None):
        ctx = context or importlib.metadata.DistributionFinder.Context()
        return (d for d in importlib.machinery.PathFinder.find_distributions(ctx)
                if (d.metadata["Name"] or "").lower() != "sglang")

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()


sys.meta_path[:] = [_PathsWithoutSglang() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
