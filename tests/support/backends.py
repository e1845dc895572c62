"""The backend as SGLang builds and calls it: ``storage_config`` / ``make_backend`` (a
``UMBPNvmeStore`` configured like SGLang configures it), ``Caller`` (timing and checking every v1
call), and what a store directory may hold (``find_store_dirs``, ``unexpected_files``)."""

from __future__ import annotations

import os
import time as _time
import types

from .host_pool import MiB, HostPool

# files a store directory may hold (anything else appearing there or outside is a finding)
STORE_FILE_PREFIXES = ("LOCK", "MANIFEST.json", "index.lmdb", "seg-")


def storage_config(extra: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, model: str = "chaos/model"):
    """A HiCacheStorageConfig like SGLang's controller builds (the real class when sglang imports)."""
    fields = dict(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config=extra,
    )
    if os.environ.get("UMBP_NVME_NO_SGLANG", "") not in ("1", "true", "yes"):
        try:
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # type: ignore

            return HiCacheStorageConfig(**fields)
        except Exception:  # noqa: BLE001
            pass
    ns = types.SimpleNamespace(**fields)
    ns.is_storage_writer = (not mla) or tp_size <= 1 or tp_rank == 0
    return ns


def backend_extra(store_dir: str, *, mode: str = "strict", capacity: int = 64 * MiB, segment: int = 1 * MiB, **more) -> dict:
    extra = {
        "backend_name": "umbp_nvme",
        "module_path": "umbp_nvme.sglang_backend",
        "class_name": "UMBPNvmeStore",
        "interface_v1": 1,
        "ssd_storage_dir": store_dir,
        "ssd_capacity_bytes": capacity,
        "ssd_segment_size_bytes": segment,
        "ssd_durability_mode": mode,
        "ssd_queue_depth": 64,
    }
    extra.update(more)
    return extra


def make_backend(store_dir: str, pool: HostPool | None = None, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 engine_factory=None, **extra_kw):  # fmt: skip
    """UMBPNvmeStore built the way SGLang's dynamic loader builds it: cls(config, {}), then register."""
    from umbp_nvme.sglang.backend import UMBPNvmeStore

    be = UMBPNvmeStore(
        storage_config(backend_extra(store_dir, **extra_kw), mla=mla, tp_rank=tp_rank, tp_size=tp_size), {},
        engine_factory=engine_factory,
    )  # fmt: skip
    if pool is not None:
        be.register_mem_pool_host(pool)
    return be


def object_keys(be, pages: list[str]) -> list[str]:
    """The object keys a backend stores these pages under (one per component, in page order)."""
    sfx = be.scheme.v1_suffixes()
    return [p + x for p in pages for x in sfx]


def find_store_dirs(root: str) -> list[str]:
    """Directories under root that hold a store (a MANIFEST.json)."""
    out = []
    for d, _dirs, files in os.walk(root):
        if "MANIFEST.json" in files:
            out.append(d)
    return sorted(out)


def unexpected_files(root: str) -> list[str]:
    """Paths under root that no store creates (what a path-like key might have produced)."""
    bad = []
    for d, dirs, files in os.walk(root):
        for f in files:
            if not f.startswith(STORE_FILE_PREFIXES):
                bad.append(os.path.join(d, f))
    return bad


class Caller:
    """Calls the backend like SGLang's threads do, timing and checking every call."""

    def __init__(self, be, pool: HostPool, bound_s: float):
        self.be, self.pool, self.bound_s = be, pool, bound_s
        self.raised = self.hangs = self.wrong = self.calls = 0
        self.max_s = 0.0
        self.errors: list[str] = []

    def _timed(self, fn, *a):
        t0 = _time.monotonic()
        self.calls += 1
        try:
            r = fn(*a)
        except Exception as e:  # noqa: BLE001 - counted: must never happen for v1 calls
            self.raised += 1
            self.errors.append(f"{fn.__name__} raised {e!r}")
            r = None
        dt = _time.monotonic() - t0
        self.max_s = max(self.max_s, dt)
        if dt > self.bound_s:
            self.hangs += 1
            self.errors.append(f"{fn.__name__} took {dt:.1f} s > {self.bound_s:.1f} s")
        return r

    def set(self, keys, first_page=0) -> list:
        for p, k in enumerate(keys):
            self.pool.fill(first_page + p, k)
        r = self._timed(self.be.batch_set_v1, keys, self.pool.indices(first_page, len(keys)))
        if r is not None and (not isinstance(r, list) or len(r) != len(keys)):
            self.raised += 1
            self.errors.append(f"batch_set_v1 returned {r!r}")
            return [False] * len(keys)
        return r or [False] * len(keys)

    def get(self, keys, first_page=0) -> list:
        self.pool.clear_pages(first_page, len(keys), 0xEE)
        r = self._timed(self.be.batch_get_v1, keys, self.pool.indices(first_page, len(keys)))
        if r is None or not isinstance(r, list) or len(r) != len(keys):
            if r is not None:
                self.raised += 1
                self.errors.append(f"batch_get_v1 returned {r!r}")
            return [False] * len(keys)
        for p, (k, ok) in enumerate(zip(keys, r)):
            if ok and not self.pool.holds(first_page + p, k):
                self.wrong += 1
                self.errors.append(f"wrong bytes for page {k[:12]}")
        if not self.pool.guards_intact():
            self.wrong += 1
            self.errors.append("write outside the registered pool memory")
        return r

    def exists(self, keys) -> int:
        r = self._timed(self.be.batch_exists, keys)
        return r if isinstance(r, int) else 0
