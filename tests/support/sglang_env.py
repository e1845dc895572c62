"""The SGLang test environment: umbp_nvme/bench/sglang_pools.py (SGLang's own host pools and
loader, shipped for `bench hicache`) plus what only tests need: a module-level skip without the wheel."""

from __future__ import annotations

import dataclasses
import os

import pytest

from umbp_nvme.bench.sglang_pools import *  # noqa: F403 - the tests use the module's names as E.<name>
from umbp_nvme.bench.sglang_pools import INSTALL_HINT, sglang_imports, sglang_installed

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def require_sglang():
    """Skip the calling test module unless the sglang wheel imports; returns its namespace."""
    if not sglang_installed():
        pytest.skip(INSTALL_HINT, allow_module_level=True)
    try:
        return sglang_imports()
    except ImportError as e:
        pytest.skip(f"sglang is installed but does not import here ({e}); rerun tools/install_sglang.sh", allow_module_level=True)


def config_has(config_cls, field: str) -> bool:
    """This SGLang release's HiCacheStorageConfig has `field` (its fields grow between releases:
    docs/sglang.md, "SGLang versions")."""
    return field in {f.name for f in dataclasses.fields(config_cls)}


def skip_unless_config_has(config_cls, field: str, what: str, since: str, *, module: bool = False):
    """Skip a test of a feature the installed SGLang release predates, saying which release has it."""
    if not config_has(config_cls, field):
        import sglang

        pytest.skip(f"sglang {sglang.__version__} has no {what} (HiCacheStorageConfig.{field}, sglang {since}+)",
                    allow_module_level=module)


def sglang_version() -> str:
    """The installed sglang release, for skip reasons ("none" without the wheel)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "none"
