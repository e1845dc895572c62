"""Numpy host pools and a config object with the interface SGLang's have, for driving
UMBPNvmeStore without the sglang wheel (docs/sglang.md §3)."""

from __future__ import annotations

import numpy as np

PAGE = 4  # tokens per page


class FakeMHAPool:
    """page_first MHA host pool over one numpy buffer: K half, then V half (docs/sglang.md §3)."""

    layout = "page_first"
    page_size = PAGE
    dtype = "uint8"

    def __init__(self, pages=16, token_bytes=256, layout="page_first"):
        self.layout = layout
        self.size = pages * PAGE
        self.token_bytes = token_bytes
        self.kv_buffer = np.zeros((2, self.size, token_bytes), np.uint8)

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]

    def get_page_buffer_meta(self, indices):
        base = self.kv_buffer.ctypes.data
        half = self.size * self.token_bytes
        ptrs, sizes = [], []
        for t0 in list(indices)[::PAGE]:
            k = base + int(t0) * self.token_bytes
            ptrs += [k, k + half]
            sizes += [PAGE * self.token_bytes] * 2
        return ptrs, sizes


class FakeSidePool:
    """A side pool with one object per page (page_size 1), no v_buffer."""

    page_size = 1

    def __init__(self, slots=8, nbytes=512):
        self.buf = np.zeros((slots, nbytes), np.uint8)

    def get_hybrid_pool_buffer(self):
        return [self.buf]

    def get_page_buffer_meta(self, indices):
        return [self.buf.ctypes.data + int(i) * self.buf.shape[1] for i in indices], [self.buf.shape[1]] * len(indices)


class Config:
    """The HiCacheStorageConfig fields the backend reads (a plain object, no sglang)."""

    def __init__(self, root, **kw):
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, 1, 0, 1
        self.is_mla_model = False
        self.enable_storage_metrics = False
        self.model_name = "m"
        self.extra_config = {
            "backend_name": "umbp_nvme",
            "module_path": "umbp_nvme.sglang_backend",
            "class_name": "UMBPNvmeStore",
            "interface_v1": 1,
            "ssd_storage_dir": root,
            "ssd_capacity_bytes": 16 << 20,
            "ssd_segment_size_bytes": 1 << 20,
            "ssd_durability_mode": "relaxed",
        }
        for k, v in kw.items():
            setattr(self, k, v)
