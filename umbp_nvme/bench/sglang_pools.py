"""SGLang's own host pools and dynamic loader, on CPU, for `bench hicache` and the tests.

Ships with the package so `umbp-nvme bench hicache` runs from a wheel; the tests reach it through
tests/support/sglang_env.py (which adds `require_sglang()`, a module-level skip). Install the
wheel with `tools/install_sglang.sh`.

What is here:
- `sglang_imports()`: the SGLang names the tests use (after putting the inert torchvision
  shim from umbp_nvme/bench/sglang_shims on sys.path when the real torchvision is missing or broken).
- Host pools built exactly as SGLang's assembler builds them, on device "cpu" with
  `pin_memory=False`: MHA (page_first / page_first_direct / page_head), MLA, Mamba, and an MHA
  `swa` side pool. Each returns a `PoolBundle` holding the device pool too (the host pool only
  references the device buffers it was described by).
- `storage_config(...)`: a HiCacheStorageConfig as the cache controller fills it, with the
  dynamic-loader keys in extra_config.
- `load_backend(config, host_pool, side_pools)`: StorageBackendFactory.create_backend("dynamic",
  ...) then the controller's registration sequence.
- `page_hashes(...)`: chained SHA-256 page hashes from SGLang's own (JIT-built, native)
  `get_hash_str`.
- Byte helpers that work for every layout through `get_page_buffer_meta` pointers.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import inspect
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds umbp_nvme/
SHIMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_shims")
INSTALL_HINT = "sglang==0.5.23 is not installed; run tools/install_sglang.sh"

MODEL = "test-org/tiny-model"
PAGE_SIZE = 16
LAYERS = 2
HEADS = 2
HEAD_DIM = 32
MLA_KV_LORA_RANK = 48
MLA_ROPE_DIM = 16


def _use_torchvision_shim() -> None:
    """Make `import torchvision` work: the real one if it loads, the inert shim otherwise."""
    if "torchvision" in sys.modules:
        return
    if importlib.util.find_spec("torchvision") is not None:
        try:
            importlib.import_module("torchvision")
            return
        except Exception:  # noqa: BLE001 - PyPI torchvision beside CPU torch fails in many ways
            for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
                del sys.modules[name]
    if SHIMS_DIR not in sys.path:
        sys.path.insert(0, SHIMS_DIR)


def subprocess_env() -> dict:
    """Environment for a child process that imports sglang and umbp_nvme like this one."""
    env = dict(os.environ)
    parts = [SHIMS_DIR, REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def sglang_installed() -> bool:
    """The sglang wheel is importable. tests/sglang/ (a folder, no __init__.py) is found as a
    namespace package when tests/ is on sys.path; only a spec with an origin is the wheel."""
    spec = importlib.util.find_spec("sglang")
    return spec is not None and spec.origin is not None


class _Namespace:
    pass


_NS: Any = None


def sglang_imports():
    """The SGLang classes and functions the tests use, imported once."""
    global _NS
    if _NS is not None:
        return _NS
    _use_torchvision_shim()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Only CUDA ... support ..." at import on CPU
        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.mem_cache import hicache_storage as hs
        from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        from sglang.srt.mem_cache.utils import get_hash_str
    ns = _Namespace()
    ns.torch = torch
    ns.hs = hs
    for name in (
        "HiCacheStorage",
        "HiCacheStorageConfig",
        "HiCacheStorageExtraInfo",
        "PoolName",
        "PoolHitPolicy",
        "PoolTransfer",
        "PoolTransferResult",
        "HiCacheFile",
        "STORAGE_BATCH_SIZE",
        "count_pool_hits",
    ):
        setattr(ns, name, getattr(hs, name))
    ns.MHATokenToKVPool, ns.MLATokenToKVPool, ns.MambaPool = MHATokenToKVPool, MLATokenToKVPool, MambaPool
    ns.MHATokenToKVPoolHost, ns.MLATokenToKVPoolHost, ns.MambaPoolHost = (
        MHATokenToKVPoolHost,
        MLATokenToKVPoolHost,
        MambaPoolHost,
    )
    ns.Mamba2CacheParams, ns.Mamba2StateDType, ns.Mamba2StateShape = Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    ns.StorageBackendFactory = StorageBackendFactory
    ns.get_hash_str = get_hash_str
    _NS = ns
    return ns


# ---------------------------------------------------------------------------------------------
# Pools


@dataclass
class PoolBundle:
    """A host pool and the device pool it mirrors (keep both alive together)."""

    host: Any
    device: Any
    name: str = "kv"
    allocated: list = field(default_factory=list)

    @property
    def page_size(self) -> int:
        return int(self.host.page_size)

    def alloc_pages(self, pages: int):
        """Host token slots for `pages` whole pages, as the cache controller allocates them."""
        idx = self.host.alloc(pages * self.page_size)
        assert idx is not None, f"host pool {self.name} is full"
        self.allocated.append(idx)
        return idx


def _takes_device_pool(host_cls) -> bool:
    """SGLang up to 0.5.22 builds a host pool from the device pool itself (Mamba's up to 0.5.21);
    0.5.23 from the device pool's buffer_info and capacities."""
    return list(inspect.signature(host_cls.__init__).parameters)[1:2] == ["device_pool"]


def _token_pool(device_cls, host_cls, dims, layout, pages, page_size, layers, dtype, pool_label, host_kw=None):
    """A CPU TokenToKVPool (dims: what comes between dtype and layer_num) and its host pool, as
    hybrid_pool_assembler builds them; host_kw(device) adds the host class's own arguments."""
    ns = sglang_imports()
    dtype = dtype or ns.torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        device = device_cls(page_size * 4, page_size, dtype, *dims, layers, "cpu", False, start_layer=0, end_layer=layers - 1)
        if _takes_device_pool(host_cls):  # SGLang <= 0.5.22: the size is a ratio to the device pool's
            accepted = inspect.signature(host_cls.__init__).parameters
            kw = {k: v for k, v in (host_kw(device) if host_kw else {}).items() if k in accepted}
            host = host_cls(device, pages * page_size / device.size, 0, page_size, layout, pin_memory=False, **kw)
            return PoolBundle(host, device, pool_label)
        host = host_cls(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            page_size,
            layout,
            pin_memory=False,
            device_capacity_tokens=device.size,
            start_layer=device.start_layer,
            end_layer=device.end_layer,
            host_token_capacity=pages * page_size,
            **(host_kw(device) if host_kw else {}),
        )
    return PoolBundle(host, device, pool_label)


def mha_pool(
    layout: str = "page_first",
    *,
    pages: int = 300,
    page_size: int = PAGE_SIZE,
    layers: int = LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    dtype=None,
    pool_label: str = "kv",
) -> PoolBundle:
    """MHATokenToKVPoolHost over a CPU MHATokenToKVPool, as hybrid_pool_assembler builds it."""
    ns = sglang_imports()
    return _token_pool(
        ns.MHATokenToKVPool, ns.MHATokenToKVPoolHost, (heads, head_dim), layout, pages, page_size, layers, dtype,
        pool_label, lambda device: {"pool_label": pool_label},
    )  # fmt: skip


def swa_pool(layout: str = "page_first", **kw) -> PoolBundle:
    """An MHA sliding-window side pool (same pool class as KV, label "swa")."""
    return mha_pool(layout, pool_label="swa", **kw)


def mla_pool(
    layout: str = "page_first",
    *,
    pages: int = 300,
    page_size: int = PAGE_SIZE,
    layers: int = LAYERS,
    dtype=None,
) -> PoolBundle:
    ns = sglang_imports()
    return _token_pool(
        ns.MLATokenToKVPool, ns.MLATokenToKVPoolHost, (MLA_KV_LORA_RANK, MLA_ROPE_DIM), layout, pages, page_size,
        layers, dtype, "kv",
        lambda device: {"target_layer_num": device.layer_num, "override_kv_cache_dim": device.kv_cache_dim},
    )  # fmt: skip


def mamba_pool(layout: str = "page_first", *, slots: int = 64, mamba_layers=(0, 1)) -> PoolBundle:
    """MambaPoolHost (page_size 1: one state per page) over a CPU MambaPool."""
    ns = sglang_imports()
    torch = ns.torch
    shape = ns.Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=4, head_dim=16, state_size=8, conv_kernel=4
    )
    params = ns.Mamba2CacheParams(
        shape=shape,
        layers=list(mamba_layers),
        dtype=ns.Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        device = ns.MambaPool(size=slots // 2, spec_state_size=0, cache_params=params, mamba_layer_ids=list(mamba_layers), device="cpu")
        if _takes_device_pool(ns.MambaPoolHost):  # SGLang <= 0.5.21
            return PoolBundle(ns.MambaPoolHost(device, 2.0, 0, pin_memory=False, layout=layout), device, "mamba")
        host = ns.MambaPoolHost(
            device.get_device_pool_infos()[0].buffer_info,
            2.0,
            0,
            device_capacity=device.size,
            pin_memory=False,
            layout=layout,
        )
    return PoolBundle(host, device, "mamba")


# ---------------------------------------------------------------------------------------------
# Config, loading, hashes


def storage_config(
    storage_dir: str,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    is_mla: bool = False,
    layout: str = "page_first",
    model_name: str | None = MODEL,
    interface_v1: bool = True,
    enable_storage_metrics: bool = False,
    extra: dict | None = None,
    **fields_,
):
    """HiCacheStorageConfig as the cache controller builds it for a `dynamic` umbp_nvme backend."""
    ns = sglang_imports()
    extra_config = {
        "backend_name": "umbp_nvme",
        "module_path": "umbp_nvme.sglang_backend",
        "class_name": "UMBPNvmeStore",
        "ssd_storage_dir": storage_dir,
        "ssd_capacity_bytes": 64 << 20,
        "ssd_segment_size_bytes": 4 << 20,
        "ssd_durability_mode": "relaxed",
        "ssd_io_backend": "io_uring",
    }
    if interface_v1:
        extra_config["interface_v1"] = 1
    extra_config.update(extra or {})
    return ns.HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=enable_storage_metrics,
        is_page_first_layout=layout == "page_first",
        model_name=model_name,
        extra_config=extra_config,
        **fields_,
    )


def load_backend(config, host_pool, side_pools: dict | None = None):
    """Create the backend the way the cache controllers do, and register the pools.

    `side_pools` maps a PoolName (or its value) to a host pool; the KV anchor is registered
    through v2 as well, as the hybrid controller does (and must be ignored there).
    """
    ns = sglang_imports()
    backend = ns.StorageBackendFactory.create_backend("dynamic", config, host_pool)
    backend.register_mem_pool_host(host_pool)
    if side_pools is not None:
        backend.register_mem_host_pool_v2(host_pool, ns.PoolName.KV)
        for name, pool in side_pools.items():
            backend.register_mem_host_pool_v2(pool, ns.PoolName(name) if isinstance(name, str) else name)
    backend.on_host_pools_registered()
    return backend


def page_hashes(pages: int, page_size: int = PAGE_SIZE, *, seed: int = 0, prior: str | None = None) -> list[str]:
    """Chained SHA-256 page hashes of a synthetic token sequence, from sglang's get_hash_str."""
    ns = sglang_imports()
    tokens = [(seed * 1_000_003 + i * 7919) % 151_936 for i in range(pages * page_size)]
    hashes = ns.get_hash_str(tokens, prior, page_size=page_size)
    assert len(hashes) == pages
    return hashes


def extra_info(prefix_keys=None):
    return sglang_imports().HiCacheStorageExtraInfo(prefix_keys=prefix_keys)


def chunks(seq, size: int | None = None):
    """Split like the controller: STORAGE_BATCH_SIZE (128) pages per call."""
    size = size or sglang_imports().STORAGE_BATCH_SIZE
    return [seq[i : i + size] for i in range(0, len(seq), size)]


# ---------------------------------------------------------------------------------------------
# Bytes of pages, layout-agnostic (through get_page_buffer_meta pointers)


def page_objects(host_pool, host_indices) -> list[tuple[int, int]]:
    """(address, nbytes) of every object of the given pages, in get_page_buffer_meta order."""
    ptrs, sizes = host_pool.get_page_buffer_meta(host_indices)
    if isinstance(sizes, int):
        sizes = [sizes] * len(ptrs)
    return list(zip((int(p) for p in ptrs), (int(s) for s in sizes)))


def read_pages(host_pool, host_indices) -> list[bytes]:
    return [ctypes.string_at(a, n) for a, n in page_objects(host_pool, host_indices)]


def fill_random(host_pool, host_indices, seed: int) -> list[bytes]:
    """Write random bytes into every object of the pages; returns what was written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for a, n in page_objects(host_pool, host_indices):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        ctypes.memmove(a, data, n)
        out.append(data)
    return out


def zero_pages(host_pool, host_indices) -> None:
    for a, n in page_objects(host_pool, host_indices):
        ctypes.memset(a, 0, n)
