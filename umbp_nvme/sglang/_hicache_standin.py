"""Local stand-ins for the few SGLang HiCache types the backend uses, for when sglang is absent.

`umbp_nvme` must import without SGLang (docs/sglang.md §1; design: SGLang is optional).
`backend.py` imports the real classes when `sglang.srt.mem_cache.hicache_storage`
imports, and these otherwise. They mirror SGLang's methods and fields (not its code): a backend
built on them behaves the same way, and the same tests drive it with or without SGLang.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, List, Optional


class PoolName(str, Enum):
    """The pool names the backend treats specially; the value is what keys and dicts use."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"

    def __str__(self) -> str:
        return self.value


class PoolHitPolicy(str, Enum):
    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"
    BLOCK_GROUPS = "block_groups"


@dataclass
class HiCacheStorageExtraInfo:
    prefix_keys: Optional[List[str]] = None
    extra_info: Optional[dict] = None


@dataclass
class PoolTransfer:
    name: Any
    host_indices: Any = None
    device_indices: Any = None
    keys: Optional[List[str]] = None
    hit_policy: Any = PoolHitPolicy.ALL_PAGES
    nodes_to_load: Optional[List[Any]] = None
    indices_from_pool: Any = None
    block_pages: int = 0
    group_pages: int = 0


@dataclass
class PoolTransferResult:
    kv_hit_pages: int
    extra_pool_hit_pages: dict
    restorable_prefix_pages: Optional[List[int]] = None


@dataclass
class StorageMetrics:
    """Same fields as sglang.srt.observability.metrics_collector.StorageMetrics."""

    prefetch_pgs: List[int] = field(default_factory=list)
    backup_pgs: List[int] = field(default_factory=list)
    prefetch_bandwidth: List[float] = field(default_factory=list)
    backup_bandwidth: List[float] = field(default_factory=list)


class HiCacheStorage(ABC):
    """The methods of sglang's HiCacheStorage base class, with the same defaults."""

    def register_mem_pool_host(self, mem_pool_host) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        if not hasattr(self, "registered_pools"):
            self.registered_pools = {}
        self.registered_pools[host_pool_name] = host_pool

    def on_host_pools_registered(self) -> None:
        return None

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        raise NotImplementedError()

    def batch_get_v2(self, transfers, extra_info=None):
        raise NotImplementedError()

    def batch_set_v2(self, transfers, extra_info=None):
        raise NotImplementedError()

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        raise NotImplementedError()

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        raise NotImplementedError()

    @abstractmethod
    def get(self, key, target_location=None, target_sizes=None):
        ...

    @abstractmethod
    def batch_get(self, keys, target_locations=None, target_sizes=None):
        ...

    @abstractmethod
    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        ...

    @abstractmethod
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        ...

    @abstractmethod
    def exists(self, key) -> bool:
        ...

    def batch_exists(self, keys, extra_info=None) -> int:
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def clear(self) -> None:
        return None

    def get_stats(self):
        return None
