"""Test support: what SGLang 0.5.23 lacks to serve on CPU with HiCache, applied on import.

Loaded by this directory's ``sitecustomize`` in every process of a server started through
umbp_nvme/bench/server_launch.py (/work/shared/docs/sglang-cpu-server.md has the facts):

* host KV pools: ``ALLOC_MEMORY_FUNCS["cpu"]`` calls ``cudaHostRegister``; plain CPU tensors do.
* host <-> device copies: on CPU, ``MHATokenToKVPoolHost.load_to_device_per_layer``,
  ``backup_from_device_all_layer`` and ``get_dummy_flat_data_page`` reach CUDA-only kernels (or
  pin memory); torch indexing between the two CPU tensors does the same copy.
* dummy weights: SGLang's +-1e-3 makes a tiny model answer in 2-token loops, so "same output"
  would prove little; +-0.08 (``UMBP_SGLANG_DUMMY_WEIGHT_RANGE``) gives varied greedy answers.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

DUMMY_WEIGHT_RANGE = float(os.environ.get("UMBP_SGLANG_DUMMY_WEIGHT_RANGE", "0.08"))


def _alloc_plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
    return allocator.allocate(dims, dtype=dtype, device=device)


def _patch_pool_host_common(mod) -> None:
    mod.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_plain


def _host_rows(pool, indices, layer: int, k: bool):
    """The host pool's rows at ``indices`` for one layer, as an indexable view."""
    buf = pool.k_buffer if k else pool.v_buffer
    if pool.layout == "page_first":
        return buf[:, layer] if indices is None else buf[indices, layer]
    if pool.layout == "layer_first":
        return buf[layer] if indices is None else buf[layer][indices]
    raise ValueError(f"CPU test shim: host layout {pool.layout!r} is not supported (page_first, layer_first)")


def _load_to_device_per_layer(self, device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False):
    if not is_draft and not 0 <= layer_id < self.target_layer_num:
        return
    self.device_k_buffers[layer_id][device_indices] = _host_rows(self, host_indices, layer_id, True)
    self.device_v_buffers[layer_id][device_indices] = _host_rows(self, host_indices, layer_id, False)


def _backup_from_device_all_layer(self, device_pool, host_indices, device_indices, io_backend):
    for layer in range(self.target_layer_num):
        for k, dev in ((True, self.device_k_buffers[layer]), (False, self.device_v_buffers[layer])):
            rows = dev[device_indices]
            if self.layout == "page_first":
                (self.k_buffer if k else self.v_buffer)[host_indices, layer] = rows
            elif self.layout == "layer_first":
                (self.k_buffer if k else self.v_buffer)[layer][host_indices] = rows
            else:
                _host_rows(self, None, layer, k)  # raises: unsupported layout


def _get_dummy_flat_data_page(self):
    import torch

    return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                       dtype=self.dtype, device=self.device).flatten()


def _patch_pool_host_mha(mod) -> None:
    cls = mod.MHATokenToKVPoolHost
    cls.load_to_device_per_layer = _load_to_device_per_layer
    cls.backup_from_device_all_layer = _backup_from_device_all_layer
    cls.get_dummy_flat_data_page = _get_dummy_flat_data_page


def _patch_weight_utils(mod) -> None:
    fn = mod.initialize_dummy_weights
    low, high, *rest = fn.__defaults__
    fn.__defaults__ = (-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, *rest)  # in place: every importer sees it


PATCHES = {
    "sglang.srt.mem_cache.pool_host.common": _patch_pool_host_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_pool_host_mha,
    "sglang.srt.model_loader.weight_utils": _patch_weight_utils,
}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        patch = PATCHES.get(name)
        if patch is None:
            return None
        others = [f for f in sys.meta_path if f is not self]
        for finder in others:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())
    for name, patch in PATCHES.items():  # already imported (e.g. by the launcher itself)
        if name in sys.modules:
            patch(sys.modules[name])
