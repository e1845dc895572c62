"""UMBPNvmeStore without SGLang: the package must not need it (design.md; docs/sglang.md §1).

The backend module is loaded a second time with UMBP_NVME_NO_SGLANG=1, so it builds on the local
HiCacheStorage stand-in whether or not the sglang wheel is installed here, and is driven with a
small numpy host pool that has the interface SGLang's pools have (docs/sglang.md §3).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

import umbp_nvme

from support.standin_pools import PAGE, Config, FakeMHAPool, FakeSidePool


@pytest.fixture(scope="module")
def mod():
    path = os.path.join(os.path.dirname(umbp_nvme.__file__), "sglang", "backend.py")
    name = "umbp_nvme.sglang._backend_without_sglang"  # in the package: its relative imports resolve
    old = os.environ.get("UMBP_NVME_NO_SGLANG")
    os.environ["UMBP_NVME_NO_SGLANG"] = "1"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["UMBP_NVME_NO_SGLANG"]
        else:
            os.environ["UMBP_NVME_NO_SGLANG"] = old
    yield module
    sys.modules.pop(name, None)


def hashes(n, salt="h"):
    import hashlib

    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


def test_it_subclasses_the_local_stand_in(mod):
    from umbp_nvme.sglang._hicache_standin import HiCacheStorage

    assert mod.HAVE_SGLANG is False
    assert issubclass(mod.UMBPNvmeStore, HiCacheStorage)


def test_constructor_takes_the_dynamic_loaders_kwargs_dict(mod, tmp_path):
    backend = mod.UMBPNvmeStore(Config(str(tmp_path / "s")), {})
    assert backend.mem_pool_host is None
    assert not (tmp_path / "s").exists()  # construction is cheap: the store opens at registration
    backend.close()


def test_round_trip_through_the_stand_in(mod, tmp_path):
    pool = FakeMHAPool()
    backend = mod.UMBPNvmeStore(Config(str(tmp_path / "s")), pool)  # UMBP's own (config, pool) form
    keys = hashes(3)
    idx = np.arange(PAGE, 4 * PAGE)
    rng = np.random.default_rng(1)
    pool.kv_buffer[:] = rng.integers(0, 256, pool.kv_buffer.shape, dtype=np.uint8)
    want = pool.kv_buffer.copy()
    assert backend.batch_set_v1(keys, idx, mod.HiCacheStorageExtraInfo(prefix_keys=[])) == [True] * 3
    pool.kv_buffer[:] = 0
    assert backend.batch_exists(keys + hashes(1, "x")) == 3
    assert backend.batch_get_v1(keys, idx) == [True] * 3
    assert np.array_equal(pool.kv_buffer[:, PAGE : 4 * PAGE], want[:, PAGE : 4 * PAGE])
    assert backend.exists(keys[0]) and not backend.exists(hashes(1, "x")[0])
    backend.close()


def test_side_pools_and_the_unregistered_pool_error_without_sglang(mod, tmp_path):
    pool, side = FakeMHAPool(), FakeSidePool()
    backend = mod.UMBPNvmeStore(Config(str(tmp_path / "s")), {})
    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, mod.PoolName.KV)  # ignored
    backend.register_mem_host_pool_v2(side, "mamba_like")
    keys = hashes(2)
    side.buf[:] = 7
    from umbp_nvme.sglang._hicache_standin import PoolTransfer

    res = backend.batch_set_v2([PoolTransfer(name="mamba_like", host_indices=np.arange(2), keys=keys)])
    assert res == {"mamba_like": [True, True]}
    assert backend.batch_set_v1(keys, np.arange(2 * PAGE)) == [True, True]
    r = backend.batch_exists_v2(keys, [PoolTransfer(name="mamba_like", keys=keys)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (2, {"kv": 2, "mamba_like": 2})
    with pytest.raises(ValueError, match=r"^Unregistered UMBP hybrid pool: swa\b"):
        backend.batch_get_v2([PoolTransfer(name="swa", host_indices=np.arange(2), keys=keys)])
    backend.close()


def test_v1_failures_are_false_lists_never_exceptions(mod, tmp_path):
    backend = mod.UMBPNvmeStore(Config(str(tmp_path / "s")), {})
    keys = hashes(2)
    # Before any pool is registered, and with a wrong index count: misses, not exceptions.
    assert backend.batch_get_v1(keys, np.arange(2 * PAGE)) == [False, False]
    backend.register_mem_pool_host(FakeMHAPool())
    assert backend.batch_set_v1(keys, np.arange(PAGE)) == [False, False]
    assert backend.get_stats().backup_pgs == [0]  # a failed backup batch stored no page
    backend.close()
    assert backend.batch_set_v1(keys, np.arange(2 * PAGE)) == [False, False]


def test_layout_check_without_sglang(mod, tmp_path):
    backend = mod.UMBPNvmeStore(Config(str(tmp_path / "s")), {})
    with pytest.raises(ValueError, match="only supports page_first, page_first_direct, or page_head"):
        backend.register_mem_pool_host(FakeMHAPool(layout="layer_first"))
    backend.close()


def test_pool_ranges_skip_device_tensors():
    """A pool exposing a CUDA tensor next to host ones: only host memory is registered (device
    memory goes through GDS; registered as host memory a put would checksum it on the CPU)."""
    import numpy as np

    from umbp_nvme.sglang.stores import pool_ranges

    class DeviceTensor:
        is_cuda = True

        def data_ptr(self):
            return 1 << 44

        def numel(self):
            return 1024

        def element_size(self):
            return 2

    host = np.zeros(4096, np.uint8)

    class Pool:
        kv_buffer = [DeviceTensor(), host]

    assert pool_ranges(Pool()) == [(host.ctypes.data, 4096)]
