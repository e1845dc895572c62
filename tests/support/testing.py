"""Test support for the reliability suite: stand-in host pools, a byte oracle, backend factories.

Importable by tests (as ``support.testing``: tests/ is on sys.path) and tools (``tools/chaos_report.py``
puts tests/ on sys.path) without SGLang:

* ``HostPool``: a numpy/mmap-backed stand-in for SGLang's MHA / MLA host pools (docs/sglang.md §3,
  ``page_first``): ``kv_buffer`` (a torch tensor when torch imports), ``get_page_buffer_meta``
  computed exactly as SGLang does -- no validation, so bad indices make bad pointers, which the
  backend must refuse -- and canary guard zones around the pool memory that only an
  out-of-bounds write can change (``guards_intact``).
* ``oracle``: the bytes a key's component must hold, derived from the key alone, so a verifier
  in another process knows what every key must hold without any IPC.
* ``storage_config`` / ``make_backend``: a ``UMBPNvmeStore`` configured like SGLang configures it.
* ``page_key``: 64-hex page hashes like SGLang's.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import types
from dataclasses import dataclass
from typing import Any

import numpy as np

from umbp_nvme.store.layout import segment_disk_bytes

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/ -> the checkout

try:  # torch is what SGLang's pools are made of; the stand-in works without it (numpy indices)
    import torch
except ImportError:  # pragma: no cover
    torch = None

PAGE = 4096
CANARY = 0x5C
KiB, MiB = 1 << 10, 1 << 20

# files a store directory may hold (anything else appearing there or outside is a finding)
STORE_FILE_PREFIXES = ("LOCK", "MANIFEST.json", "index.lmdb", "seg-")


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
    from umbp_nvme.sglang_backend import UMBPNvmeStore

    be = UMBPNvmeStore(
        storage_config(backend_extra(store_dir, **extra_kw), mla=mla, tp_rank=tp_rank, tp_size=tp_size), {},
        engine_factory=engine_factory,
    )  # fmt: skip
    if pool is not None:
        be.register_mem_pool_host(pool)
    return be


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


@dataclass
class Tally:
    """Figures one part of the suite contributes to the report."""

    kills: int = 0
    kills_survived: int = 0
    faults_injected: int = 0
    bad_inputs_tried: int = 0
    wrong_bytes: int = 0
    lost_acknowledged: int = 0
    hangs: int = 0
    raised_from_v1: int = 0
    soak_seconds: float = 0.0

    def add(self, other: "Tally") -> "Tally":
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        return self

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["soak_seconds"] = round(d["soak_seconds"], 1)
        return d


# =============================================================================================
# Crash survival: a child process runs the backend and is SIGKILLed; the parent verifies.

import multiprocessing as _mp  # noqa: E402
import random as _random  # noqa: E402
import signal as _signal  # noqa: E402
import time as _time  # noqa: E402

CRASH_PHASES = ("parent", "write-before", "write-after", "sync", "commit", "evict")
_CTX = None


def _mp_context():
    """forkserver with the heavy imports preloaded: a child starts in ~20 ms instead of seconds."""
    global _CTX
    if _CTX is None:
        ctx = _mp.get_context("forkserver")
        ctx.set_forkserver_preload(["support.testing", "umbp_nvme.sglang_backend", "umbp_nvme.store"])
        _CTX = ctx
    return _CTX


@dataclass
class CrashSpec:
    root: str
    ack_path: str
    mode: str = "strict"
    capacity: int = 32 * MiB
    segment: int = 1 * MiB
    universe: int = 600
    batch: int = 16
    page_size: int = 16
    seed: int = 0
    phase: str = "parent"
    kill_p: float = 0.01
    salt: str = "crash"


def _install_kill_hooks(spec: CrashSpec, rng: _random.Random):
    """The engine_factory that kills the child in its phase (None for index phases: Index.commit is
    wrapped instead, in this child only)."""
    from umbp_nvme.store import index as index_mod

    from .faults import FaultPlan, FaultRule

    def die():
        os.kill(os.getpid(), _signal.SIGKILL)

    if spec.phase in ("write-before", "write-after", "sync"):
        ops = ("sync",) if spec.phase == "sync" else ("write",)
        when = rng.choice(("before", "after")) if spec.phase == "sync" else spec.phase.split("-")[1]
        plan = FaultPlan([FaultRule("kill", ops=ops, probability=spec.kill_p, when=when)], seed=spec.seed)
        return plan.engine_factory()
    elif spec.phase in ("commit", "evict"):
        orig_commit = index_mod.Index.commit
        lock_rng = _random.Random(spec.seed)

        def commit(self, puts=(), deletes=(), **kw):
            hit = (spec.phase == "commit" and puts) or (spec.phase == "evict" and deletes and not puts)
            if hit and lock_rng.random() < spec.kill_p * 5:
                if lock_rng.random() < 0.5:
                    die()  # before the transaction
                orig_commit(self, puts, deletes, **kw)
                die()  # committed, not yet acknowledged
            return orig_commit(self, puts, deletes, **kw)

        index_mod.Index.commit = commit
    return None


def crash_child(spec: CrashSpec, ready) -> None:
    """The child: random batch_set_v1 / batch_get_v1 / batch_exists until it is killed."""
    import logging

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)  # the parent reports; keep stderr quiet
    rng = _random.Random(spec.seed)
    factory = _install_kill_hooks(spec, rng)
    pool = HostPool(page_num=2 * spec.batch, page_size=spec.page_size)
    be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment,
                      engine_factory=factory)  # fmt: skip
    fd = os.open(spec.ack_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    universe = [page_key(i, spec.salt) for i in range(spec.universe)]
    acked: list[str] = []
    ready.set()
    B = spec.batch
    while True:
        r = rng.random()
        if r < 0.6:
            keys = rng.sample(universe, B)
            for p, k in enumerate(keys):
                pool.fill(p, k)
            old = [be.exists(k) for k in keys]  # a re-put keeps the old entry (and its LRU age)
            res = be.batch_set_v1(keys, pool.indices(0, B))
            ok = [k for k, good in zip(keys, res) if good]
            lines = "".join(f"{'~' if o else '+'}{k}\n" for k, o, good in zip(keys, old, res) if good)
            os.write(fd, (lines + "=\n").encode())  # one write per batch; "=": batch boundary
            acked.extend(ok)
        elif r < 0.9 and acked:
            keys = rng.sample(acked, min(B, len(acked)))
            pool.clear_pages(B, len(keys))
            res = be.batch_get_v1(keys, pool.indices(B, len(keys)))
            bad = [k for p, (k, good) in enumerate(zip(keys, res)) if good and not pool.holds(B + p, k)]
            os.write(fd, ("".join(f"!{k}\n" for k in bad) + "r\n").encode())  # "r": a read refreshed LRU
        else:
            be.batch_exists(rng.sample(universe, B))


@dataclass
class Acks:
    acked: set  # every page a batch_set_v1 acknowledged
    last_batch: set  # pages the last acknowledged batch newly wrote (LRU cannot have evicted them)
    child_wrong: int
    reads_after_last: int


def read_acks(path: str) -> Acks:
    acked: set = set()
    last: set = set()
    cur: set = set()
    wrong = reads = 0
    try:
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    continue  # torn last line (a batch's lines are one write, so this is rare)
                c = line[0]
                if c in "+~":
                    acked.add(line[1:-1])
                    if c == "+":
                        cur.add(line[1:-1])
                elif c == "=":
                    last, cur, reads = cur, set(), 0
                elif c == "!":
                    wrong += 1
                elif c == "r":
                    reads += 1
    except FileNotFoundError:
        pass
    return Acks(acked, last, wrong, reads)


@dataclass
class VerifyResult:
    reopened: bool = False
    existing: int = 0
    wrong_bytes: int = 0
    unreadable: int = 0
    lost_acknowledged: int = 0
    over_capacity: int = 0
    raised: int = 0
    error: str = ""


def verify_store(spec: CrashSpec, acks: Acks, *, all_acks_must_exist: bool) -> VerifyResult:
    """Reopen through the backend; every page batch_exists reports must read back exactly."""
    v = VerifyResult()
    pool = HostPool(page_num=64, page_size=spec.page_size)
    be = None
    try:
        be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment)
        v.reopened = True
        universe = [page_key(i, spec.salt) for i in range(spec.universe)]
        existing = [k for k in universe if be.batch_exists([k]) == 1]
        v.existing = len(existing)
        ex = set(existing)
        if all_acks_must_exist:
            must = acks.acked
        else:  # under eviction only the newest pages are sure to be kept; reads refresh others
            must = acks.last_batch if acks.reads_after_last <= 2 else set()
        v.lost_acknowledged = len(must - ex)
        for i in range(0, len(existing), 64):
            chunk = existing[i : i + 64]
            pool.clear_pages(0, len(chunk), 0xEE)
            try:
                res = be.batch_get_v1(chunk, pool.indices(0, len(chunk)))
            except Exception as e:  # noqa: BLE001 - counted: must never happen
                v.raised += 1
                v.error = repr(e)
                continue
            for p, (k, ok) in enumerate(zip(chunk, res)):
                if not ok:
                    v.unreadable += 1
                elif not pool.holds(p, k):
                    v.wrong_bytes += 1
        if not pool.guards_intact():
            v.wrong_bytes += 1
        for d in find_store_dirs(spec.root):
            if segment_disk_bytes(d) > spec.capacity:
                v.over_capacity += 1
    except Exception as e:  # noqa: BLE001
        v.error = repr(e)
    finally:
        if be is not None:
            be.close()
        pool.close()
    return v


def fill_test(spec: CrashSpec, factor: float = 2.0) -> tuple[int, int]:
    """Write factor x capacity of fresh pages: (failed batches, bytes on disk over capacity)."""
    pool = HostPool(page_num=spec.batch, page_size=spec.page_size)
    be = make_backend(spec.root, pool, mode=spec.mode, capacity=spec.capacity, segment=spec.segment)
    failed = 0
    try:
        n = int(factor * spec.capacity / (pool.object_bytes * pool.components))
        for i in range(0, n, spec.batch):
            keys = [page_key(j, spec.salt + "-fill") for j in range(i, i + spec.batch)]
            for p, k in enumerate(keys):
                pool.fill(p, k)
            if not all(be.batch_set_v1(keys, pool.indices(0, spec.batch))):
                failed += 1
        over = sum(max(0, segment_disk_bytes(d) - spec.capacity) for d in find_store_dirs(spec.root))
    finally:
        be.close()
        pool.close()
    return failed, over


def crash_run(
    root: str,
    *,
    mode: str,
    kills: int,
    evicting: bool,
    seed: int = 0,
    max_child_s: float = 2.0,
    log=None,
) -> dict:
    """``kills`` SIGKILLs of a child writer on one store directory, verified after each."""
    ctx = _mp_context()
    rng = _random.Random(seed)
    spec = CrashSpec(
        root=os.path.join(root, "store"),
        ack_path=os.path.join(root, "acks"),
        mode=mode,
        capacity=3 * MiB if evicting else 64 * MiB,
        segment=256 * KiB if evicting else 1 * MiB,
        universe=600 if evicting else 2400,  # keep: 2400 x 16 KiB stays under the high watermark
        kill_p=0.01 if evicting else 0.02,
        seed=seed,
        salt=f"crash-{mode}-{seed}",
    )
    out = dict(kills=0, kills_survived=0, wrong_bytes=0, lost_acknowledged=0, unreadable=0, over_capacity=0,
               raised_from_v1=0, hangs=0, phases={}, errors=[], existing_max=0, fill_failed_batches=0)
    phases = [p for p in CRASH_PHASES if not (p == "sync" and mode != "strict")]
    if not evicting:
        phases = [p for p in phases if p != "evict"]
    for i in range(kills):
        spec.seed = rng.randrange(1 << 30)
        spec.phase = phases[i % len(phases)]
        ready = ctx.Event()
        p = ctx.Process(target=crash_child, args=(spec, ready), daemon=True)
        p.start()
        if not ready.wait(30):
            out["hangs"] += 1
            out["errors"].append(f"kill {i}: child never became ready")
        if spec.phase == "parent":
            _time.sleep(rng.uniform(0.02, 0.6))
        else:
            p.join(max_child_s)  # the child kills itself in its phase
        if p.is_alive():
            os.kill(p.pid, _signal.SIGKILL)
            died = "parent"
        else:
            died = spec.phase
        p.join(10)
        if p.exitcode != -_signal.SIGKILL:
            out["errors"].append(f"kill {i}: child exit code {p.exitcode} (phase {spec.phase})")
        out["kills"] += 1
        out["phases"][died] = out["phases"].get(died, 0) + 1
        acks = read_acks(spec.ack_path)
        v = verify_store(spec, acks, all_acks_must_exist=not evicting)
        out["wrong_bytes"] += v.wrong_bytes + acks.child_wrong
        out["lost_acknowledged"] += v.lost_acknowledged
        out["unreadable"] += v.unreadable
        out["over_capacity"] += v.over_capacity
        out["raised_from_v1"] += v.raised
        out["existing_max"] = max(out["existing_max"], v.existing)
        if v.reopened and not (v.wrong_bytes or v.lost_acknowledged or v.unreadable or v.over_capacity or v.raised):
            out["kills_survived"] += 1
        elif v.error or not v.reopened:
            out["errors"].append(f"kill {i} ({died}): {v.error or 'reopen failed'}")
        if log:
            log(f"  {mode} {'evict' if evicting else 'keep'} kill {i + 1}/{kills} ({died}): {v.existing} pages, "
                f"wrong={v.wrong_bytes + acks.child_wrong} lost={v.lost_acknowledged} unreadable={v.unreadable}")
    if evicting:
        failed, over = fill_test(spec)
        out["fill_failed_batches"] = failed
        out["over_capacity"] += int(over > 0)
    return out


# =============================================================================================
# Fault injection through the whole stack (UMBPNvmeStore -> SyncPageStore -> PageStore -> engine)

import subprocess as _subprocess  # noqa: E402


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


def _fault_backend(root, plan, pool, **kw):

    kw.setdefault("io_timeout_s", 1.0)
    kw.setdefault("capacity", 8 * MiB)
    kw.setdefault("segment", 512 * KiB)
    kw.setdefault("mode", "relaxed")
    return make_backend(root, pool, engine_factory=plan.engine_factory(), **kw)


def fault_run(root: str, *, rounds: int = 40, seed: int = 0, log=None) -> dict:
    """Injected and real faults; every v1 call must return bools in bounded time, never wrong bytes."""
    from .faults import FaultPlan, FaultRule

    out = dict(faults_injected=0, wrong_bytes=0, hangs=0, raised_from_v1=0, scenarios={}, errors=[])
    rng = _random.Random(seed)
    B = 16

    def account(name, c: Caller, plan=None, extra_faults=0, served_ok=True):
        n = (plan.total_injected if plan is not None else 0) + extra_faults
        out["faults_injected"] += n
        out["wrong_bytes"] += c.wrong
        out["hangs"] += c.hangs
        out["raised_from_v1"] += c.raised
        out["errors"] += c.errors[:3]
        out["scenarios"][name] = dict(faults=n, calls=c.calls, max_call_s=round(c.max_s, 2), serves_intact=served_ok)
        if log:
            log(f"  fault {name}: {n} faults, {c.calls} calls, max {c.max_s:.2f} s, wrong={c.wrong} "
                f"hangs={c.hangs} raised={c.raised} intact={served_ok}")

    # 1. a storm of every injected kind at once, strict and relaxed
    for mode in ("relaxed", "strict"):
        plan = FaultPlan(seed=seed)
        pool = HostPool(page_num=2 * B)
        be = _fault_backend(os.path.join(root, f"storm-{mode}"), plan, pool, mode=mode)
        c = Caller(be, pool, bound_s=8.0)
        universe = [page_key(i, f"storm{mode}") for i in range(300)]
        plan.set_rules([
            FaultRule("eio", probability=0.03),
            FaultRule("short", probability=0.03),
            FaultRule("enospc", ops=("write",), probability=0.03),
            FaultRule("bitflip", ops=("read",), probability=0.03),
            FaultRule("delay", probability=0.01, delay_s=0.3),
            FaultRule("eio", ops=("sync",), probability=0.05),
        ])
        for _ in range(rounds):
            keys = rng.sample(universe, B)
            if rng.random() < 0.5:
                c.set(keys)
            else:
                c.get(keys, B)
            c.exists(keys)
        plan.clear()
        good = rng.sample(universe, B)
        ok = all(c.set(good)) and all(c.get(good, B))
        be.close()
        pool.close()
        account(f"storm-{mode}", c, plan, served_ok=ok)

    # 2. a stuck device, then a latency spike of seconds
    plan = FaultPlan(seed=seed)
    pool = HostPool(page_num=2 * B)
    be = _fault_backend(os.path.join(root, "stuck"), plan, pool, io_timeout_s=0.5)
    c = Caller(be, pool, bound_s=8.0)
    keys = [page_key(i, "stuck") for i in range(B)]
    c.set(keys)
    plan.set_rules([FaultRule("stuck", ops=("read", "write", "sync"))])
    r1 = c.set([page_key(i, "stuck2") for i in range(B)])
    r2 = c.get(keys, B)
    stuck_failed = not any(r1) and not any(r2)
    plan.clear()
    plan.release_stuck()
    plan.set_rules([FaultRule("delay", ops=("read", "write"), delay_s=0.3, limit=4)])
    ok = all(c.get(keys, B))
    be.close()
    pool.close()
    if not stuck_failed:
        c.errors.append("a stuck device did not turn into failures")
        c.hangs += 1
    account("stuck-then-slow", c, plan, served_ok=ok)

    # 3. real faults behind the store's back: truncated and corrupted segment files
    pool = HostPool(page_num=4 * B)
    plan = FaultPlan(seed=seed)
    d = os.path.join(root, "real")
    be = _fault_backend(d, plan, pool, segment=256 * KiB, capacity=4 * MiB)
    c = Caller(be, pool, bound_s=8.0)
    keys = [page_key(i, "real") for i in range(3 * B)]
    for i in range(0, len(keys), B):
        c.set(keys[i : i + B])
    sdir = find_store_dirs(d)[0]
    segs = sorted(f for f in os.listdir(sdir) if f.startswith("seg-"))
    os.truncate(os.path.join(sdir, segs[0]), 8192)  # behind the store's back
    with open(os.path.join(sdir, segs[1]), "r+b") as f:
        for off in range(0, 256 * KiB, 8192):
            f.seek(off + 100)
            f.write(b"\xde\xad\xbe\xef")
    hits = 0
    for i in range(0, len(keys), B):
        hits += sum(c.get(keys[i : i + B], B))
    be.close()
    # and again after a reopen (the writer rebuilds its state from the damaged directory)
    be = _fault_backend(d, plan, pool, segment=256 * KiB, capacity=4 * MiB)
    c.be = be
    hits2 = 0
    for i in range(0, len(keys), B):
        hits2 += sum(c.get(keys[i : i + B], B))
    fresh = [page_key(i, "real-after") for i in range(B)]
    ok = all(c.set(fresh)) and all(c.get(fresh, B)) and 0 < hits2
    be.close()
    pool.close()
    account("truncated+corrupted-segments", c, extra_faults=2, served_ok=ok)

    # 4. a corrupted index file: a clear error or a working store, never wrong bytes
    pool = HostPool(page_num=2 * B)
    d = os.path.join(root, "badindex")
    be = make_backend(d, pool, mode="strict", capacity=4 * MiB, segment=256 * KiB)
    c = Caller(be, pool, bound_s=8.0)
    keys = [page_key(i, "idx") for i in range(B)]
    c.set(keys)
    be.close()
    idx = os.path.join(find_store_dirs(d)[0], "index.lmdb")
    size = os.path.getsize(idx)
    with open(idx, "r+b") as f:
        for off in (0, 4096, 8192, size // 2):
            f.seek(off)
            f.write(os.urandom(512))
    outcome = "opened"
    try:
        be = make_backend(d, pool, mode="strict", capacity=4 * MiB, segment=256 * KiB)
        c.be = be
        c.get(keys, B)
        c.exists(keys)
        be.close()
    except Exception as e:  # noqa: BLE001
        outcome = f"refused: {type(e).__name__}: {str(e)[:200]}"
    pool.close()
    out["corrupt_index_outcome"] = outcome
    account("corrupted-index", c, extra_faults=1, served_ok=True)

    # 5. ENOSPC for real: a 3 MiB tmpfs under a store that believes it has 16 MiB
    out["scenarios"]["enospc-tmpfs"] = _tmpfs_enospc(root, out, log)
    return out


def _tmpfs_enospc(root: str, out: dict, log) -> dict:
    mnt = os.path.join(root, "tmpfs")
    os.makedirs(mnt, exist_ok=True)
    r = _subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", mnt], capture_output=True)
    if r.returncode != 0:
        return dict(skipped=f"cannot mount tmpfs: {r.stderr.decode().strip()[:100]}")
    pool = HostPool(page_num=32)
    try:
        be = make_backend(os.path.join(mnt, "s"), pool, mode="strict", capacity=16 * MiB, segment=1 * MiB, io_timeout_s=2.0)
        c = Caller(be, pool, bound_s=10.0)
        written: list[str] = []
        failed_batches = 0
        for i in range(0, 400, 16):
            keys = [page_key(j, "enospc") for j in range(i, i + 16)]
            res = c.set(keys)
            written += [k for k, ok in zip(keys, res) if ok]
            failed_batches += not all(res)
        hits = 0
        for i in range(0, len(written), 16):
            hits += sum(c.get(written[i : i + 16], 16))
        # The store adopts the segments the file system gave it and evicts within them (issue 10
        # defect 11): older pages are evicted, the latest batch must be served, and no byte wrong.
        last = written[-16:]
        last_hits = sum(c.get(last, 16)) if last else 0
        be.close()
        res = dict(faults=failed_batches, calls=c.calls, max_call_s=round(c.max_s, 2), written=len(written),
                   served_back=hits, serves_intact=len(written) >= 16 and last_hits == len(last) and c.wrong == 0)
        out["faults_injected"] += failed_batches
        out["wrong_bytes"] += c.wrong
        out["hangs"] += c.hangs
        out["raised_from_v1"] += c.raised
        out["errors"] += c.errors[:3]
        if log:
            log(f"  fault enospc-tmpfs: {failed_batches} failed batches, {len(written)} pages written, {hits} read back")
        return res
    finally:
        pool.close()
        _subprocess.run(["umount", "-l", mnt], capture_output=True)


# =============================================================================================
# Races: SGLang's three controller threads + eviction under a tight cap + a follower process

import threading as _threading  # noqa: E402


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


SOAK_UNIVERSE = 800


def _soak_extra(root: str) -> dict:
    return dict(mode="relaxed", capacity=2 * MiB, segment=128 * KiB, io_timeout_s=5.0)


def soak_follower(root: str, seconds: float, result_q) -> None:
    """A TP-rank-1 MLA process: read-only on the leader's directory, verifying every hit."""
    import logging

    logging.getLogger("umbp_nvme").setLevel(logging.CRITICAL)  # misses under eviction are expected
    pool = HostPool(page_num=16, mla=True)
    stats = dict(calls=0, hits=0, wrong=0, raised=0, hangs=0, max_s=0.0)
    be = None
    try:
        be = make_backend(root, pool, mla=True, tp_rank=1, tp_size=2, **_soak_extra(root))
        rng = _random.Random(7)
        c = Caller(be, pool, bound_s=30.0)
        universe = [page_key(i, "soak") for i in range(SOAK_UNIVERSE)]
        end = _time.monotonic() + seconds
        while _time.monotonic() < end:
            keys = rng.sample(universe, 16)
            r = c.get(keys)
            stats["hits"] += sum(r)
            c.exists(keys)
        stats.update(calls=c.calls, wrong=c.wrong, raised=c.raised, hangs=c.hangs, max_s=round(c.max_s, 2))
        # a set on a follower must answer True per page without writing (docs/sglang.md §6)
        r = be.batch_set_v1(universe[:4], pool.indices(0, 4))
        if r != [True] * 4:
            stats["raised"] += 1
    except Exception as e:  # noqa: BLE001
        stats["raised"] += 1
        stats["error"] = repr(e)
    finally:
        if be is not None:
            be.close()
    result_q.put(stats)


def soak_run(root: str, *, seconds: float = 60.0, follower: bool = True, log=None) -> dict:
    B = 16
    n_threads0 = _threading.active_count()
    pool = HostPool(page_num=3 * B, mla=True)
    be = make_backend(root, pool, mla=True, tp_rank=0, tp_size=2, **_soak_extra(root))
    universe = [page_key(i, "soak") for i in range(SOAK_UNIVERSE)]
    stop = _threading.Event()
    last = {}
    callers = {name: Caller(be, pool, bound_s=30.0) for name in ("exists", "io", "backup")}
    counts = dict(exists=0, io=0, backup=0, hits=0, acked=0)

    def prefetch_exists():
        rng = _random.Random(1)
        c = callers["exists"]
        while not stop.is_set():
            s = rng.randrange(SOAK_UNIVERSE - 64)
            c.exists(universe[s : s + rng.randrange(1, 64)])
            counts["exists"] += 1
            _time.sleep(0.0005)  # SGLang's prefetch thread waits on its queue between queries
            last["exists"] = _time.monotonic()

    def prefetch_io():
        rng = _random.Random(2)
        c = callers["io"]
        while not stop.is_set():
            r = c.get(rng.sample(universe, B), B)
            counts["io"] += 1
            counts["hits"] += sum(r)
            last["io"] = _time.monotonic()

    def backup():
        rng = _random.Random(3)
        c = callers["backup"]
        while not stop.is_set():
            r = c.set(rng.sample(universe, B), 0)
            counts["backup"] += 1
            counts["acked"] += sum(r)
            last["backup"] = _time.monotonic()

    fproc = fq = None
    if follower:
        ctx = _mp_context()
        fq = ctx.Queue()
        fproc = ctx.Process(target=soak_follower, args=(root, seconds, fq), daemon=True)
    threads = [_threading.Thread(target=f, name=f"soak-{f.__name__}", daemon=True) for f in (prefetch_exists, prefetch_io, backup)]
    t0 = _time.monotonic()
    for k in ("exists", "io", "backup"):
        last[k] = t0
    for t in threads:
        t.start()
    if fproc is not None:
        fproc.start()
    rss_warm = None
    hangs = 0
    while _time.monotonic() - t0 < seconds:
        _time.sleep(0.5)
        now = _time.monotonic()
        if rss_warm is None and now - t0 >= seconds * 0.25:
            rss_warm = _rss_bytes()
        stalled = [k for k, v in last.items() if now - v > 30.0]
        if stalled:
            hangs += len(stalled)
            if log:
                log(f"  soak: threads {stalled} made no progress for 30 s")
            break
    stop.set()
    for t in threads:
        t.join(60)
        if t.is_alive():
            hangs += 1
    elapsed = _time.monotonic() - t0
    rss_end = _rss_bytes()
    fstats = {}
    if fproc is not None:
        try:
            fstats = fq.get(timeout=seconds + 60)
        except Exception:  # noqa: BLE001
            fstats = dict(error="follower reported nothing", hangs=1)
        fproc.join(30)
        if fproc.is_alive():
            os.kill(fproc.pid, _signal.SIGKILL)
    st = be.store_stats().get("store", {})
    be.close()
    pool.close()
    _time.sleep(0.2)
    threads_leaked = max(0, _threading.active_count() - n_threads0)
    wrong = sum(c.wrong for c in callers.values()) + int(fstats.get("wrong", 0))
    raised = sum(c.raised for c in callers.values()) + int(fstats.get("raised", 0))
    hangs += sum(c.hangs for c in callers.values()) + int(fstats.get("hangs", 0))
    growth = (rss_end - (rss_warm or rss_end)) / MiB
    out = dict(
        soak_seconds=round(elapsed, 1),
        wrong_bytes=wrong,
        raised_from_v1=raised,
        hangs=hangs,
        calls=counts,
        evictions=st.get("evictions"),
        bytes_used=st.get("bytes_used"),
        capacity=2 * MiB,
        rss_growth_mib=round(growth, 1),
        threads_leaked=threads_leaked,
        max_call_s=max(c.max_s for c in callers.values()),
        follower=fstats,
        errors=[e for c in callers.values() for e in c.errors[:3]],
    )
    if log:
        log(f"  soak {elapsed:.0f} s: {counts}, evictions={out['evictions']}, follower={fstats}, "
            f"rss +{growth:.1f} MiB, wrong={wrong} hangs={hangs} raised={raised}")
    return out


# =============================================================================================
# Bad input: each checker returns a list of findings (empty = the input was handled as documented)

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


# =============================================================================================
# Security hygiene


def _mode(path: str) -> int:
    return os.lstat(path).st_mode & 0o777


def hygiene_run(root: str, log=None) -> dict:
    """Permissions, symlinks, the writer lock and foreign ownership. Returns findings and checks."""
    import pwd

    from umbp_nvme.errors import UnsafeStorePathError

    findings: list[str] = []
    checks = 0
    # 1. modes under a permissive umask, for the configured root and a per-rank subdirectory
    old = os.umask(0o022)
    try:
        for tp_size in (1, 2):
            d = os.path.join(root, f"modes-tp{tp_size}", "hicache")
            pool = HostPool(16)
            be = make_backend(d, pool, tp_size=tp_size)
            pool.fill(0, page_key(0))
            be.batch_set_v1([page_key(0)], pool.indices(0, 1))
            for sd in [d] + find_store_dirs(d):
                checks += 1
                if _mode(sd) & 0o077:
                    findings.append(f"store directory {sd} has mode {oct(_mode(sd))} (want 0700; tp_size={tp_size})")
                for f in os.listdir(sd):
                    p = os.path.join(sd, f)
                    if os.path.isfile(p):
                        checks += 1
                        if _mode(p) & 0o077:
                            findings.append(f"store file {p} has mode {oct(_mode(p))} (want 0600)")
            be.close()
            pool.close()
    finally:
        os.umask(old)
    # 2. symlinks inside the store directory are not followed
    outside = os.path.join(root, "outside")
    os.makedirs(outside, exist_ok=True)
    for name in ("seg-00000.dat", "MANIFEST.json", "index.lmdb", "LOCK"):
        d = os.path.join(root, "sym-" + name.split(".")[0].lower())
        os.makedirs(d, mode=0o700)
        target = os.path.join(outside, name + ".target")
        with open(target, "wb") as f:
            f.write(b"precious")
        os.symlink(target, os.path.join(d, name))
        pool = HostPool(16)
        checks += 1
        try:
            be = make_backend(d, pool)
            pool.fill(0, page_key(1))
            be.batch_set_v1([page_key(1)], pool.indices(0, 1))
            be.close()
        except (UnsafeStorePathError, OSError):
            pass
        except Exception as e:  # noqa: BLE001
            findings.append(f"symlinked {name}: unexpected {type(e).__name__}: {e}")
        pool.close()
        with open(target, "rb") as f:
            if f.read() != b"precious":
                findings.append(f"a write followed the symlink {name} out of the store directory")
        if os.path.getsize(target) != 8:
            findings.append(f"{target} changed size through a symlinked {name}")
    # the store directory itself (a per-rank subdirectory) as a symlink
    real = os.path.join(outside, "realdir")
    os.makedirs(real, mode=0o700)
    d = os.path.join(root, "symroot")
    os.makedirs(d, mode=0o700)
    os.symlink(real, os.path.join(d, "tp1"))
    pool = HostPool(16)
    checks += 1
    try:
        make_backend(d, pool, tp_rank=1, tp_size=2).close()
        findings.append("a symlinked per-rank store directory was used")
    except UnsafeStorePathError:
        pass
    except Exception as e:  # noqa: BLE001
        findings.append(f"symlinked store directory: {type(e).__name__}: {e}")
    pool.close()
    if os.listdir(real):
        findings.append(f"files were created through a symlinked store directory: {os.listdir(real)}")
    # 3. the lock file keeps a second writer (another process) out, with a clear message
    d = os.path.join(root, "locked")
    pool = HostPool(16)
    be = make_backend(d, pool)
    checks += 1
    r = _subprocess.run(
        [__import__("sys").executable, "-c",
         "import sys; from support.testing import HostPool, make_backend\n"
         "try:\n make_backend(sys.argv[1], HostPool(16)); print('OPENED')\n"
         "except Exception as e: print(type(e).__name__, e)", d],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, UMBP_NVME_NO_SGLANG="1", PYTHONPATH=os.pathsep.join((_REPO, os.path.join(_REPO, "tests")))),
    )
    msg = r.stdout.strip()
    if not msg.startswith("StoreLockedError") or str(os.getpid()) not in msg:
        findings.append(f"second writer: {msg[:200] or r.stderr[-200:]}")
    be.close()
    pool.close()
    # 4. a store directory owned by another user is refused with a clear message
    d = os.path.join(root, "foreign")
    os.makedirs(d, mode=0o700)
    checks += 1
    try:
        nobody = pwd.getpwnam("nobody").pw_uid
        os.chown(d, nobody, nobody)
    except (KeyError, PermissionError) as e:
        findings.append(f"(skipped foreign-owner check: {e})")
    else:
        pool = HostPool(16)
        try:
            make_backend(d, pool).close()
            findings.append("a store directory owned by another user was opened")
        except UnsafeStorePathError as e:
            if "owned by" not in str(e):
                findings.append(f"foreign owner message unclear: {e}")
        except Exception as e:  # noqa: BLE001
            findings.append(f"foreign owner: {type(e).__name__}: {e}")
        pool.close()
    out = dict(checks=checks, findings=findings)
    if log:
        log(f"  hygiene: {checks} checks, {len(findings)} findings")
    return out
