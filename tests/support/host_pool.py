"""Stand-in host pools and the byte oracle (importable by tests and tools without SGLang).

* ``HostPool``: a numpy/mmap-backed stand-in for SGLang's MHA / MLA host pools (docs/sglang.md §3,
  ``page_first``): ``kv_buffer`` (a torch tensor when torch imports), ``get_page_buffer_meta``
  computed exactly as SGLang does -- no validation, so bad indices make bad pointers, which the
  backend must refuse -- and canary guard zones around the pool memory that only an
  out-of-bounds write can change (``guards_intact``).
* ``oracle``: the bytes a key's component must hold, derived from the key alone, so a verifier
  in another process knows what every key must hold without any IPC.
* ``page_key``: 64-hex page hashes like SGLang's.
"""

from __future__ import annotations

import hashlib
import mmap

import numpy as np

try:  # torch is what SGLang's pools are made of; the stand-in works without it (numpy indices)
    import torch
except ImportError:  # pragma: no cover
    torch = None

PAGE = 4096
CANARY = 0x5C
KiB, MiB = 1 << 10, 1 << 20


def page_key(i: int, salt: str = "chaos") -> str:
    """A 64-hex page hash, as SGLang's controller computes them (deterministic per (salt, i))."""
    return hashlib.sha256(f"{salt}:{i}".encode()).hexdigest()


def _seed(key: str, comp: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}#{comp}".encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def oracle(key: str, comp: int, nbytes: int) -> np.ndarray:
    """The bytes component ``comp`` of page ``key`` must hold (uint8, deterministic)."""
    return np.frombuffer(np.random.Generator(np.random.PCG64(_seed(key, comp))).bytes(nbytes), dtype=np.uint8)


class HostPool:
    """Stand-in for ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (page_first by default).

    MHA: ``kv_buffer`` shape (2, S, L, H, D); per page K at ``base + t0*L*H*D*s`` and V at
    ``K + L*S*H*D*s`` (the whole K half further). MLA: shape (S, L, 1, kvd), one object per page.
    The memory is one anonymous mmap (page aligned, like SGLang's pools with pin_memory=False)
    with ``guard`` bytes of canary on both sides that are never registered.
    """

    def __init__(
        self,
        page_num: int = 64,
        page_size: int = 16,
        *,
        layer_num: int = 2,
        head_num: int = 2,
        head_dim: int = 64,
        kv_dim: int = 128,
        itemsize: int = 2,
        mla: bool = False,
        layout: str = "page_first",
        guard: int = 64 * KiB,
    ):
        self.page_size = page_size
        self.page_num = page_num
        self.size = page_num * page_size
        self.layer_num = layer_num
        self.layout = layout
        self.is_mla = mla
        self.itemsize = itemsize
        self.head_num, self.head_dim, self.kv_dim = head_num, head_dim, kv_dim
        if mla:
            self.token_bytes = layer_num * kv_dim * itemsize
            shape = (self.size, layer_num, 1, kv_dim)
            self.components = 1
        else:
            self.token_bytes = layer_num * head_num * head_dim * itemsize
            shape = (2, self.size, layer_num, head_num, head_dim)
            self.components = 2
        self.object_bytes = page_size * self.token_bytes
        self.nbytes = self.components * self.size * self.token_bytes
        self.guard = -(-guard // PAGE) * PAGE
        total = self.guard * 2 + -(-self.nbytes // PAGE) * PAGE
        self._mm = mmap.mmap(-1, total)
        self.mem = np.frombuffer(self._mm, dtype=np.uint8)
        self.mem[: self.guard] = CANARY
        self.mem[self.guard + self.nbytes :] = CANARY
        self.data = self.mem[self.guard : self.guard + self.nbytes]
        self.base = int(self.data.ctypes.data)
        self.stores_page_envelope = False
        dtype_name = {1: "uint8", 2: "bfloat16", 4: "float32"}[itemsize]
        if torch is not None:
            tdt = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[itemsize]
            self.kv_buffer = torch.frombuffer(self._mm, dtype=torch.uint8, offset=self.guard, count=self.nbytes).view(tdt).view(shape)
            self.dtype = tdt
        else:  # pragma: no cover
            self.kv_buffer = self.data
            self.dtype = dtype_name

    # --- the host-pool interface the backend uses ---

    def get_page_buffer_meta(self, indices):
        P = self.page_size
        firsts = indices[::P]
        firsts = firsts.tolist() if hasattr(firsts, "tolist") else list(firsts)
        ptrs: list = []
        sizes: list = []
        if self.is_mla:
            for t0 in firsts:
                ptrs.append(self.base + t0 * self.token_bytes)
                sizes.append(self.object_bytes)
        else:
            half = self.size * self.token_bytes
            for t0 in firsts:
                k = self.base + t0 * self.token_bytes
                ptrs += [k, k + half]
                sizes += [self.object_bytes, self.object_bytes]
        return ptrs, sizes

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]

    def get_size_per_token(self) -> int:
        return self.token_bytes * self.components

    def is_stride_page_aligned(self, align: int = PAGE) -> bool:
        return self.object_bytes % align == 0 and self.base % align == 0

    # --- helpers for tests ---

    def indices(self, first_page: int, n_pages: int):
        """Token-slot indices of pages [first_page, first_page + n_pages), as SGLang passes them."""
        a = np.arange(first_page * self.page_size, (first_page + n_pages) * self.page_size, dtype=np.int64)
        return torch.from_numpy(a) if torch is not None else a

    def component_views(self, page: int) -> list[np.ndarray]:
        off = page * self.object_bytes
        views = [self.data[off : off + self.object_bytes]]
        if not self.is_mla:
            off2 = self.size * self.token_bytes + off
            views.append(self.data[off2 : off2 + self.object_bytes])
        return views

    def fill(self, page: int, key: str) -> None:
        for c, v in enumerate(self.component_views(page)):
            v[:] = oracle(key, c, len(v))

    def clear_pages(self, first_page: int, n_pages: int, value: int = 0) -> None:
        for p in range(first_page, first_page + n_pages):
            for v in self.component_views(p):
                v[:] = value

    def holds(self, page: int, key: str) -> bool:
        return all(np.array_equal(v, oracle(key, c, len(v))) for c, v in enumerate(self.component_views(page)))

    def guards_intact(self) -> bool:
        return bool((self.mem[: self.guard] == CANARY).all() and (self.mem[self.guard + self.nbytes :] == CANARY).all())

    def close(self) -> None:
        self.kv_buffer = None
        self.data = self.mem = None
        try:
            self._mm.close()
        except BufferError:
            pass
