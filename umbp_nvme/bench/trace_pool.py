"""The backend and host pool ``bench trace`` replays through.

With sglang installed (``--pool sglang``, the default when it imports): SGLang's own
``MHATokenToKVPoolHost`` (page_first, bf16) and ``UMBPNvmeStore`` made by its dynamic loader,
as the cache controller makes them (bench/sglang_pools.py). Without it (``--pool standin``): a
page_first pool of the same geometry in anonymous memory that answers ``get_page_buffer_meta``
as SGLang's does, and ``UMBPNvmeStore`` constructed directly on it. Either way the replay reaches
the store only through ``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``.

Geometry: page_size 16 tokens, 1 layer, 1 head, bf16; head_dim makes a K (or V) object
``object_bytes`` long. ``words(page)`` gives the pool's K and V objects of a pool page as
uint64 views, which the replay fills and checks in place.
"""

from __future__ import annotations

import mmap
import types

import numpy as np

PAGE_SIZE = 16  # tokens per page
MIN_OBJECT_BYTES = 4096


def geometry(object_bytes: int) -> dict:
    if object_bytes < MIN_OBJECT_BYTES or object_bytes % (PAGE_SIZE * 2 * 8):
        raise ValueError(f"object size {object_bytes} B: must be >= {MIN_OBJECT_BYTES} and a multiple of "
                         f"{PAGE_SIZE * 2 * 8} (page {PAGE_SIZE} tokens x bf16 x 8-byte words)")  # fmt: skip
    return dict(page_size=PAGE_SIZE, layers=1, heads=1, head_dim=object_bytes // (PAGE_SIZE * 2))


class StandinPool:
    """page_first MHA host pool in anonymous memory: K of token t at ``t * token_bytes``, V half a
    pool further, as MHATokenToKVPoolHost lays them out."""

    layout = "page_first"
    stores_page_envelope = False
    dtype = "bfloat16"

    def __init__(self, pages: int, object_bytes: int):
        self.page_size = PAGE_SIZE
        self.token_bytes = object_bytes // PAGE_SIZE
        self.size = pages * PAGE_SIZE
        self.nbytes = 2 * self.size * self.token_bytes
        self._mm = mmap.mmap(-1, self.nbytes)
        self.kv_buffer = np.frombuffer(self._mm, np.uint8)
        self.base = int(self.kv_buffer.ctypes.data)

    def get_page_buffer_meta(self, indices):
        firsts = np.asarray(indices)[:: self.page_size].tolist()
        half, ob = self.size * self.token_bytes, self.page_size * self.token_bytes
        ptrs = []
        for t0 in firsts:
            k = self.base + t0 * self.token_bytes
            ptrs += [k, k + half]
        return ptrs, [ob] * len(ptrs)

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]

    def close(self) -> None:
        self.kv_buffer = None


class HostSide:
    """A backend, its host pool, and uint64 views of each pool page's K and V objects."""

    def __init__(self, backend, host, indices, flat_u8: np.ndarray, base: int, object_bytes: int, keep=None):
        self.backend, self.host, self.keep = backend, host, keep
        self.indices = indices  # token slots, page after page
        self.object_bytes = object_bytes
        self._u64 = flat_u8.view(np.uint64)
        self._base = base

    def slots(self, first_page: int, pages: int):
        return self.indices[first_page * PAGE_SIZE : (first_page + pages) * PAGE_SIZE]

    def words(self, page: int) -> list[np.ndarray]:
        """The K and V objects of pool page ``page`` as uint64 views (in get_page_buffer_meta order)."""
        ptrs, _ = self.host.get_page_buffer_meta(self.slots(page, 1))
        w = self.object_bytes // 8
        return [self._u64[(int(p) - self._base) // 8 : (int(p) - self._base) // 8 + w] for p in ptrs]

    def close(self) -> None:
        try:
            self.backend.close()
        finally:
            self.backend = self.host = self.keep = self.indices = None
            self._u64 = None


def open_backend(kind: str, directory: str, pages: int, object_bytes: int, extra: dict) -> HostSide:
    """``kind``: "sglang" or "standin"; ``extra``: the store's extra_config (dynamic-loader keys added)."""
    geo = geometry(object_bytes)
    if kind == "sglang":
        from .hicache import load_sglang

        env = load_sglang()
        torch = env.sglang_imports().torch
        bundle = env.mha_pool("page_first", pages=pages, page_size=geo["page_size"], layers=geo["layers"],
                              heads=geo["heads"], head_dim=geo["head_dim"], dtype=torch.bfloat16)  # fmt: skip
        host = bundle.host
        indices = bundle.alloc_pages(pages)
        backend = env.load_backend(env.storage_config(directory, extra=extra), host)
        flat = host.kv_buffer.view(-1).view(torch.uint8).numpy()
        return HostSide(backend, host, indices, flat, int(host.kv_buffer.data_ptr()), object_bytes, keep=bundle)
    if kind != "standin":
        raise ValueError(f"pool kind {kind!r}: expected sglang or standin")
    from ..sglang.backend import UMBPNvmeStore

    host = StandinPool(pages, object_bytes)
    config = types.SimpleNamespace(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False, model_name="bench-trace",
        enable_storage_metrics=False, extra_config={"interface_v1": 1, "ssd_storage_dir": directory, **extra},
    )  # fmt: skip
    backend = UMBPNvmeStore(config, host)
    indices = np.arange(pages * PAGE_SIZE, dtype=np.int64)
    return HostSide(backend, host, indices, host.kv_buffer, host.base, object_bytes, keep=host)
