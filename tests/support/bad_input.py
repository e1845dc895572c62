"""Bad input: each checker returns a list of findings (empty = the input was handled as documented);
``fuzz_run`` drives them with seeded random inputs (the hypothesis tests drive the same checkers)."""

from __future__ import annotations

import os
import random as _random

import numpy as np

from .backends import make_backend, unexpected_files
from .host_pool import CANARY, HostPool, page_key, torch

WEIRD_KEYS = [
    "", "../x", "../../etc/passwd", "/abs/path", "a/b", "\x00", "nul\x00key", "é本🙂", "\udcff" * 3,
    " ", "\n", "k" * 600, "x" * 20000, "." , "..", "LOCK", "index.lmdb", "seg-00000.dat",
]

CONFIG_KEYS = [
    "ssd_capacity_bytes", "ssd_segment_size_bytes", "ssd_queue_depth", "ssd_io_backend",
    "ssd_durability_mode", "ssd_backend", "ssd_high_watermark", "ssd_low_watermark", "ssd_enabled",
    "eviction_policy", "io_timeout_s", "verify_crc", "o_direct", "auto_promote_on_read",
    "ssd_storage_dir", "dram_capacity_bytes", "interface_v1", "extra_backend_tag",
]


def check_config_value(key: str, value) -> list[str]:
    """load_config({key: value}): a StoreConfig or a ValueError naming the key and the value."""
    from umbp_nvme.config import load_config

    try:
        cfg = load_config({key: value}, env={})
    except ValueError as e:
        msg = str(e)
        found = []
        if key not in msg:
            found.append(f"error for {key}={value!r} does not name the key: {msg[:160]}")
        shown = [repr(value), str(value), str(value).strip()]  # parsers strip surrounding whitespace
        try:
            shown.append(repr(float(value)))  # numbers may be shown as parsed
            if float(value).is_integer():
                shown.append(str(int(float(value))))  # whole floats are accepted as ints
        except (TypeError, ValueError, OverflowError):
            pass
        if len(shown[0]) <= 60 and not any(x in msg for x in shown):
            found.append(f"error for {key}={value!r} does not show the value: {msg[:160]}")
        return found
    except Exception as e:  # noqa: BLE001
        return [f"load_config({{{key!r}: {value!r}}}) raised {type(e).__name__}: {e}"]
    try:
        cfg.validate()
    except ValueError:
        pass
    except Exception as e:  # noqa: BLE001
        return [f"validate after {key}={value!r} raised {type(e).__name__}: {e}"]
    return []


def _bools(r, n) -> bool:
    return isinstance(r, list) and len(r) == n and all(isinstance(x, bool) for x in r)


def check_keys(be, pool: HostPool, keys: list, root: str) -> list[str]:
    """Odd keys through set/exists/get: bools, exact bytes for what was stored, no stray files."""
    found = []
    n = len(keys)
    if n == 0 or n > pool.page_num // 2:
        return found
    uniq = len(set(keys)) == n
    for p, k in enumerate(keys):
        pool.fill(p, k if isinstance(k, str) else repr(k))
    try:
        r = be.batch_set_v1(keys, pool.indices(0, n))
        if not _bools(r, n):
            found.append(f"batch_set_v1 returned {r!r} for keys {keys!r:.80}")
            r = [False] * n
        e = be.batch_exists(keys)
        if not isinstance(e, int) or not 0 <= e <= n:
            found.append(f"batch_exists returned {e!r}")
        half = pool.page_num // 2
        pool.clear_pages(half, n, 0xEE)
        g = be.batch_get_v1(keys, pool.indices(half, n))
        if not _bools(g, n):
            found.append(f"batch_get_v1 returned {g!r}")
        else:
            for p, (k, ok, stored) in enumerate(zip(keys, g, r)):
                if ok and not pool.holds(half + p, k if isinstance(k, str) else repr(k)) and uniq:
                    found.append(f"wrong bytes for key {k!r:.40}")
                if stored and uniq and not ok:
                    found.append(f"key {k!r:.40} stored but not served")
    except Exception as e:  # noqa: BLE001
        found.append(f"v1 call raised {type(e).__name__}: {e} for keys {keys!r:.80}")
    stray = unexpected_files(root)
    if stray:
        found.append(f"files created outside the store layout: {stray[:3]}")
    if not pool.guards_intact():
        found.append("write outside the registered pool memory")
    return found


def check_indices(be, pool: HostPool, keys: list[str], indices) -> list[str]:
    """Bad index tensors: per-page bools (or all False), no write outside the pool, nothing stored
    from memory outside the pool."""
    found = []
    n = len(keys)
    before = bytes(pool.mem[: pool.guard]) + bytes(pool.mem[pool.guard + pool.nbytes :])
    for name, fn in (("batch_set_v1", be.batch_set_v1), ("batch_get_v1", be.batch_get_v1)):
        try:
            r = fn(keys, indices)
        except Exception as e:  # noqa: BLE001
            found.append(f"{name} raised {type(e).__name__}: {e} for indices {indices!r:.80}")
            continue
        if not _bools(r, n):
            found.append(f"{name} returned {r!r:.80} for {n} keys")
    after = bytes(pool.mem[: pool.guard]) + bytes(pool.mem[pool.guard + pool.nbytes :])
    if before != after:
        found.append(f"write outside the registered pool memory for indices {indices!r:.80}")
    return found


class HostilePool(HostPool):
    """A pool whose get_page_buffer_meta returns whatever ``meta`` says (pointer/size fuzzing)."""

    meta = None

    def get_page_buffer_meta(self, indices):
        if self.meta is not None:
            return self.meta
        return super().get_page_buffer_meta(indices)


def check_meta(be, pool: HostilePool, stored: list[str], fresh: list[str], ptrs: list, sizes: list) -> list[str]:
    """Pointer/size pairs outside the registered memory: False, never a write or read outside.

    ``stored`` pages exist (a get would land), ``fresh`` ones do not (a set would read memory);
    a re-put of an existing page is True without reading anything, so it proves nothing here.
    """
    found = []
    pool.meta = None
    n = len(stored)
    for p, k in enumerate(stored):
        pool.fill(p, k)
    if not all(be.batch_set_v1(stored, pool.indices(0, n))):
        return [f"could not store {n} pages to fuzz against"]
    pool.meta = (ptrs, sizes)
    lo, hi = pool.base, pool.base + pool.nbytes
    try:
        for name, fn, keys in (("batch_get_v1", be.batch_get_v1, stored), ("batch_set_v1", be.batch_set_v1, fresh)):
            try:
                r = fn(keys, pool.indices(0, len(keys)))
            except Exception as e:  # noqa: BLE001
                found.append(f"{name} raised {type(e).__name__}: {e}")
                continue
            if not _bools(r, len(keys)):
                found.append(f"{name} returned {r!r:.80}")
                continue
            m = len(ptrs) // max(1, len(keys)) if len(ptrs) == len(sizes) else 0
            for p, ok in enumerate(r):
                comps = list(zip(ptrs[p * m : (p + 1) * m], sizes[p * m : (p + 1) * m])) if m else []
                inside = bool(comps) and all(
                    isinstance(a, int) and isinstance(s, int) and s > 0 and lo <= a and a + s <= hi for a, s in comps
                )
                if ok and not inside:
                    found.append(f"{name} said True for page {p} with pointers outside the pool: {comps!r:.120}")
        if not pool.guards_intact():
            found.append(f"write outside the registered pool memory (ptrs {ptrs!r:.80}, sizes {sizes!r:.80})")
            pool.mem[: pool.guard] = CANARY
            pool.mem[pool.guard + pool.nbytes :] = CANARY
    finally:
        pool.meta = None
    return found


def check_layout_mismatch(root: str) -> list[str]:
    """An unsupported layout and a directory made for another dtype / page size are refused clearly."""
    found = []
    pool = HostPool(16, layout="layer_first")
    try:
        make_backend(os.path.join(root, "lm"), pool).close()
        found.append("layer_first layout accepted")
    except ValueError as e:
        if "layer_first" not in str(e):
            found.append(f"layout error does not name the layout: {e}")
    pool.close()
    d = os.path.join(root, "ns")
    a = HostPool(16, page_size=16, itemsize=2)
    make_backend(d, a).close()
    for kw, field in ((dict(page_size=32, itemsize=2), "page_size"), (dict(page_size=16, itemsize=1), "dtype")):
        b = HostPool(16, **kw)
        try:
            make_backend(d, b).close()
            found.append(f"a store made for another {field} was opened")
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ != "NamespaceMismatchError" or "was created for" not in str(e):
                found.append(f"mismatched {field}: {type(e).__name__}: {str(e)[:160]}")
        b.close()
    a.close()
    return found


def fuzz_run(root: str, *, cases: int = 300, seed: int = 0, log=None) -> dict:
    """Seeded random bad inputs through every checker (the hypothesis tests drive the same checkers)."""
    rng = _random.Random(seed)
    findings: list[str] = []
    tried = 0
    values = [None, True, False, 0, -1, 1, 2, 3.5, -0.0, float("nan"), float("inf"), 1 << 70, "", " ", "abc",
              "1e9", "0x10", "-5", "true", "yes", "posix ", "IO_URING", "strict\n", [], {}, (1,), b"bytes", "é"]
    for _ in range(cases // 3):
        key = rng.choice(CONFIG_KEYS)
        v = rng.choice(values)
        findings += check_config_value(key, v)
        tried += 1
    d = os.path.join(root, "keys")
    pool = HostPool(page_num=64)
    be = make_backend(d, pool)
    for _ in range(cases // 6):
        keys = rng.sample(WEIRD_KEYS, rng.randrange(1, 5)) + [page_key(rng.randrange(1000), "fz")]
        findings += check_keys(be, pool, keys, d)
        tried += 1
    keys = [page_key(i, "idx") for i in range(4)]
    S = pool.size
    idx_cases = [
        np.arange(3 * pool.page_size), np.arange(5 * pool.page_size), np.arange(-4 * pool.page_size, 0),
        np.arange(S, S + 4 * pool.page_size), np.arange(4 * pool.page_size).astype(np.float32),
        np.arange(4 * pool.page_size).astype(np.int32), np.arange(8 * pool.page_size)[::2], None, [],
        np.full(4 * pool.page_size, 1 << 40), np.arange(4 * pool.page_size).reshape(4, -1),
    ]
    if torch is not None:
        idx_cases += [torch.arange(4 * pool.page_size, dtype=torch.float64), torch.arange(8 * pool.page_size)[::2],
                      torch.arange(-64, 0), torch.ones(4 * pool.page_size, dtype=torch.bool)]
    for _ in range(cases // 6):
        ic = rng.choice(idx_cases)
        if isinstance(ic, np.ndarray) and ic.dtype.kind == "i" and rng.random() < 0.5:
            ic = ic + rng.randrange(-S, S)
        findings += check_indices(be, pool, keys, ic)
        tried += 1
    be.close()
    pool.close()
    hp = HostilePool(page_num=16)
    d2 = os.path.join(root, "meta")
    be = make_backend(d2, hp)
    ob = hp.object_bytes
    for _ in range(cases // 3):
        ptrs, sizes = [], []
        for _c in range(2 * 2):
            off = rng.choice([-hp.guard, -ob, -1, 0, 1, hp.nbytes - ob, hp.nbytes - ob + 1, hp.nbytes, rng.randrange(-hp.guard, hp.nbytes + hp.guard)])
            ptrs.append(hp.base + off if rng.random() > 0.05 else rng.choice([0, -1, None, 3.0]))
            sizes.append(rng.choice([ob, ob, 0, -ob, ob + 1, 1 << 40, hp.guard]))
        if rng.random() < 0.1:
            ptrs = ptrs[:-1]
        findings += check_meta(be, hp, [page_key(1, "m"), page_key(2, "m")], [page_key(2 * tried, "mf"), page_key(2 * tried + 1, "mf")], ptrs, sizes)
        tried += 1
    be.close()
    hp.close()
    findings += check_layout_mismatch(os.path.join(root, "layout"))
    tried += 3
    out = dict(bad_inputs_tried=tried, findings=sorted(set(findings))[:20], n_findings=len(findings))
    if log:
        log(f"  fuzz: {tried} bad inputs, {len(findings)} findings")
    return out


def check_legacy_pointer(root: str) -> list[str]:
    """Legacy get(key, ptr, size) with a pointer outside every registered range must not write there."""
    pool = HostPool(16)
    be = make_backend(os.path.join(root, "legacy"), pool)
    found = []
    try:
        val = np.arange(8192, dtype=np.uint8)
        if torch is not None:
            val = torch.from_numpy(val)
        be.set("legacy-key", value=val)
        victim = np.zeros(8192, np.uint8)  # real memory, never registered
        r = be.get("legacy-key", victim.ctypes.data, 8192)
        if victim.any():
            found.append(f"legacy get wrote {int((victim != 0).sum())} bytes into unregistered memory (returned {r!r})")
    except Exception as e:  # noqa: BLE001
        found.append(f"legacy get raised {type(e).__name__}: {e}")
    finally:
        be.close()
        pool.close()
    return found
