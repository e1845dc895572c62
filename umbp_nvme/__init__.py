"""umbp_nvme: an asyncio key -> object store for LLM KV-cache pages on local NVMe.

Start here::

    from umbp_nvme import PageStore, StoreConfig      # asyncio
    from umbp_nvme import SyncPageStore               # the same calls, blocking, any thread
    from umbp_nvme import UMBPNvmeStore               # SGLang's HiCache L3 backend class

``PageStore.open(path, config)`` opens (a writer creates) a store directory; ``put_many`` /
``get_many`` / ``exists_many`` / ``exists_prefix`` / ``delete_many`` take lists of keys and
buffers and answer one bool per key (False: that key failed or is absent; I/O errors never
raise). ``load_config(extra_config)`` builds a StoreConfig from SGLang's extra_config keys and
``UMBP_*`` variables. The README's example is the shortest complete program.

Every name here is imported on first use (PEP 562), so ``import umbp_nvme`` costs almost nothing,
the ``umbp-nvme`` command starts fast, and nothing imports SGLang or torch until you ask for
``UMBPNvmeStore``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "PageStore": ".store.page_store",
    "SyncPageStore": ".store.sync",
    "StoreConfig": ".config",
    "load_config": ".config",
    "UMBPNvmeStore": ".sglang.backend",
    "StoreError": ".errors",
    "StoreLockedError": ".errors",
    "NamespaceMismatchError": ".errors",
    "ReadOnlyStoreError": ".errors",
    "CapacityShrinkError": ".errors",
    "NotAStoreError": ".errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:  # static analysers and IDEs see the real objects
    from .config import StoreConfig, load_config
    from .errors import (
        CapacityShrinkError,
        NamespaceMismatchError,
        NotAStoreError,
        ReadOnlyStoreError,
        StoreError,
        StoreLockedError,
    )
    from .sglang.backend import UMBPNvmeStore
    from .store.page_store import PageStore
    from .store.sync import SyncPageStore


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'umbp_nvme' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
