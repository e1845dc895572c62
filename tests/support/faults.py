"""FaultyEngine: any IoEngine with injected faults, for the reliability suite.

A ``FaultPlan`` holds ordered ``FaultRule``s, one seeded RNG and the injection counters; wrap as
many engines as you like with it (a store has a read and a write engine) and they share them.
For every op of a batch the first rule that applies (op kind, predicate, probability, limit)
decides its fate:

* ``eio`` / ``enospc`` / ``errno``: the op is not performed; its result is ``-errno``.
* ``short``: a write moves only the first half of the op (rounded down to 4 KiB, so O_DIRECT
  accepts it) and reports that count; a read is performed, its tail is overwritten with a
  garbage pattern and the short count is reported -- so a caller that ignores the count serves
  garbage and the suite sees it.
* ``bitflip`` (reads): the op completes in full but one byte in the caller's buffer is flipped
  (silent media corruption); only a checksum can catch it.
* ``delay``: the batch (or sync) waits ``delay_s`` seconds before it reaches the device.
* ``stuck``: the batch never completes until the engine is closed (a hung device); a cancelled
  await returns at once because nothing was submitted, so no memory is written after it.
* ``kill``: the process SIGKILLs itself, ``when="before"`` or ``"after"`` the batch reached the
  device (crash tests aim kills at a phase of the data path with it).

``sync`` faults: ``eio``/``enospc``/``errno`` raise OSError; ``delay``, ``stuck`` and ``kill``
as above.

Deterministic for a given seed and call order. ``FaultPlan.injected`` counts per rule name.
Attach a plan by opening a store with ``engine_factory=plan.engine_factory()`` (PageStore.open,
SyncPageStore, UMBPNvmeStore): nothing is patched.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno as _errno
import os
import random
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from umbp_nvme.buffers import DIO_ALIGN_BYTES
from umbp_nvme.engine import open_engine
from umbp_nvme.engine.base import RESULT_DTYPE, EngineClosed, IoBatch

KINDS = ("eio", "enospc", "errno", "short", "bitflip", "delay", "stuck", "kill")
OPS = ("read", "write", "sync")
_GARBAGE = 0xA5


@dataclass
class FaultRule:
    kind: str
    ops: tuple[str, ...] = ("read", "write")
    probability: float = 1.0
    # (op, fd, offset, length) -> bool; sync passes offset=length=0
    predicate: Callable[[str, int, int, int], bool] | None = None
    limit: int | None = None  # injections at most (None: unlimited)
    errno: int = _errno.EIO
    delay_s: float = 0.0
    when: str = "before"  # kill: before or after the device saw the batch
    name: str = ""
    injected: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.ops, str):
            self.ops = (self.ops,)
        bad = [o for o in self.ops if o not in OPS]
        if bad:
            raise ValueError(f"fault ops must be among {OPS}, got {bad!r}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1], got {self.probability!r}")
        if self.kind == "enospc":
            self.errno = _errno.ENOSPC
        if self.when not in ("before", "after"):
            raise ValueError(f"when must be 'before' or 'after', got {self.when!r}")
        if not self.name:
            self.name = f"{'+'.join(self.ops)}:{self.kind}"

    def exhausted(self) -> bool:
        return self.limit is not None and self.injected >= self.limit


class FaultPlan:
    """Rules + RNG + counters shared by every engine wrapped with this plan. Thread-safe."""

    def __init__(self, rules: Iterable[FaultRule] = (), *, seed: int = 0, enabled: bool = True):
        self.rules: list[FaultRule] = list(rules)
        self.rng = random.Random(seed)
        self.enabled = enabled
        self.engines: list = []  # FaultyEngines made by engine_factory()
        self.injected: dict[str, int] = {}
        self.ops_seen = 0
        self._lock = threading.Lock()
        self._stuck: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def total_injected(self) -> int:
        return sum(self.injected.values())

    def set_rules(self, rules: Iterable[FaultRule]) -> None:
        with self._lock:
            self.rules = list(rules)

    def clear(self) -> None:
        """No more faults; batches stuck so far stay stuck until release_stuck() or close."""
        self.set_rules(())

    def wrap(self, engine) -> "FaultyEngine":
        return FaultyEngine(engine, self)

    def engine_factory(self, inner=None):
        """An ``engine_factory`` for PageStore.open / SyncPageStore / UMBPNvmeStore: every engine the
        store opens is wrapped with this plan (``self.engines`` lists the wrappers, reads first)."""
        inner = inner or open_engine
        engines = self.engines

        async def factory(backend, queue_depth):
            fe = self.wrap(await inner(backend, queue_depth))
            engines.append(fe)
            return fe

        return factory

    def _pick(self, op: str, fd: int, offset: int, length: int) -> FaultRule | None:
        # caller holds the lock
        if not self.enabled:
            return None
        for r in self.rules:
            if op not in r.ops or r.exhausted():
                continue
            if r.predicate is not None and not r.predicate(op, fd, offset, length):
                continue
            if r.probability < 1.0 and self.rng.random() >= r.probability:
                continue
            r.injected += 1
            self.injected[r.name] = self.injected.get(r.name, 0) + 1
            return r
        return None

    def decide(self, op: str, batch: IoBatch) -> list[FaultRule | None]:
        with self._lock:
            self.ops_seen += len(batch)
            fds, offs, lens = batch.fds.tolist(), batch.offsets.tolist(), batch.lengths.tolist()
            return [self._pick(op, fds[i], offs[i], lens[i]) for i in range(len(batch))]

    def decide_sync(self, fd: int) -> FaultRule | None:
        with self._lock:
            self.ops_seen += 1
            return self._pick("sync", fd, 0, 0)

    def stuck_future(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._stuck.append((loop, fut))
        return fut

    def release_stuck(self, exc: BaseException | None = None) -> int:
        """Fail every stuck batch (EngineClosed by default). Returns how many were waiting."""
        with self._lock:
            stuck, self._stuck = self._stuck, []
        n = 0
        for loop, fut in stuck:
            if fut.done():
                continue
            n += 1
            e = exc or EngineClosed("fault-injected stuck batch released")

            def fail(f=fut, e=e):
                if not f.done():
                    f.set_exception(e)

            try:
                loop.call_soon_threadsafe(fail)
            except RuntimeError:
                pass  # that loop is closed
        return n


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class FaultyEngine:
    """IoEngine wrapper applying a FaultPlan. Same protocol as the wrapped engine."""

    def __init__(self, inner, plan: FaultPlan):
        self.inner = inner
        self.plan = plan
        self.capabilities = inner.capabilities
        self._closed = False

    # --- protocol ---

    async def read_many(self, fds, offsets, addrs, lengths) -> np.ndarray:
        return await self._run("read", IoBatch.of(fds, offsets, addrs, lengths))

    async def write_many(self, fds, offsets, addrs, lengths) -> np.ndarray:
        return await self._run("write", IoBatch.of(fds, offsets, addrs, lengths))

    async def sync(self, fd: int, *, datasync: bool = True) -> None:
        if self._closed:
            raise EngineClosed("faulty engine is closed")
        rule = self.plan.decide_sync(int(fd))
        if rule is not None:
            if rule.kind == "kill" and rule.when == "before":
                _kill_self()
            if rule.kind == "delay":
                await asyncio.sleep(rule.delay_s)
            elif rule.kind == "stuck":
                await self.plan.stuck_future()
            elif rule.kind in ("eio", "enospc", "errno", "short", "bitflip"):
                raise OSError(rule.errno, f"injected {os.strerror(rule.errno)} on sync of fd {fd}")
        await self.inner.sync(fd, datasync=datasync)
        if rule is not None and rule.kind == "kill":
            _kill_self()

    def register_buffers(self, ranges) -> bool:
        return self.inner.register_buffers(ranges)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.plan.release_stuck()
        self.inner.close()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- internals ---

    async def _run(self, op: str, b: IoBatch) -> np.ndarray:
        if self._closed:
            raise EngineClosed("faulty engine is closed")
        n = len(b)
        rules = self.plan.decide(op, b)
        kinds = {r.kind for r in rules if r is not None}
        if not kinds:
            return await self._inner(op, b.files(), b.offsets, b.addrs, b.lengths)
        if any(r is not None and r.kind == "kill" and r.when == "before" for r in rules):
            _kill_self()
        delay = max((r.delay_s for r in rules if r is not None and r.kind == "delay"), default=0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        if "stuck" in kinds:
            await self.plan.stuck_future()  # raises EngineClosed at close / release
        res = np.zeros(n, dtype=RESULT_DTYPE)
        do = np.ones(n, dtype=bool)
        lens = b.lengths.copy()
        short_full: dict[int, int] = {}
        flips: list[int] = []
        for i, r in enumerate(rules):
            if r is None:
                continue
            if r.kind in ("eio", "enospc", "errno"):
                do[i] = False
                res[i] = -r.errno
            elif r.kind == "short" and b.lengths[i] > 0:
                if op == "write":
                    half = (int(b.lengths[i]) // 2) // DIO_ALIGN_BYTES * DIO_ALIGN_BYTES  # as an O_DIRECT device tears
                    if half == 0:
                        do[i] = False
                        res[i] = 0
                    else:
                        lens[i] = half
                else:
                    short_full[i] = int(b.lengths[i])
            elif r.kind == "bitflip" and op == "read":
                flips.append(i)
        idx = np.flatnonzero(do)
        if len(idx):
            sub = await self._inner(op, b.files(idx), b.offsets[idx], b.addrs[idx], lens[idx])
            res[idx] = sub
        for i, full in short_full.items():
            if res[i] > 0:
                keep = min(int(res[i]), full) // 2
                ctypes.memset(int(b.addrs[i]) + keep, _GARBAGE, full - keep)
                res[i] = keep
        for i in flips:
            if res[i] > 0:
                pos = int(b.addrs[i]) + self.plan.rng.randrange(int(res[i]))
                cell = (ctypes.c_ubyte * 1).from_address(pos)
                cell[0] ^= 0xFF
        if any(r is not None and r.kind == "kill" and r.when == "after" for r in rules):
            _kill_self()
        return res

    async def _inner(self, op, fds, offsets, addrs, lengths):
        f = self.inner.read_many if op == "read" else self.inner.write_many
        return await f(fds, offsets, addrs, lengths)


# --- plans from a spec string -----------------------------------------------------------------


def parse_spec(spec: str) -> list[FaultRule]:
    """``"read:eio:0.1,write:short:0.05,sync:delay:0.01:2.0,write:kill:0.02:after"`` -> rules.

    Fields: op (read|write|sync|any), kind, probability, then kind-specific: delay seconds for
    ``delay``, errno number for ``errno``, before|after for ``kill``.
    """
    rules = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        f = part.split(":")
        if len(f) < 2:
            raise ValueError(f"fault spec {part!r}: expected op:kind[:probability[:arg]]")
        ops = ("read", "write", "sync") if f[0] == "any" else (f[0],)
        kw = dict(kind=f[1], ops=ops, probability=float(f[2]) if len(f) > 2 else 1.0, name=part)
        if len(f) > 3:
            if f[1] == "delay":
                kw["delay_s"] = float(f[3])
            elif f[1] == "errno":
                kw["errno"] = int(f[3])
            elif f[1] == "kill":
                kw["when"] = f[3]
        rules.append(FaultRule(**kw))
    return rules


@dataclass
class FaultCounter:
    """Plain accumulator the suite uses to add up plans run one after another."""

    total: int = 0
    by_name: dict = field(default_factory=dict)

    def add(self, plan: FaultPlan) -> None:
        for k, v in plan.injected.items():
            self.by_name[k] = self.by_name.get(k, 0) + v
            self.total += v


# --- engines whose calls a test can hold or replace ------------------------------------------


class EngineHooks:
    """An ``engine_factory`` whose engines send reads / writes / syncs through replaceable hooks.

    ``hooks.read = async fn(real_read_many, fds, offsets, addrs, lengths)`` (likewise ``write``,
    and ``sync(real_sync, fd, datasync)``); None sends the call straight to the real engine. For
    tests that hold a read in flight or make the disk hang, without touching the store's insides.
    """

    def __init__(self, inner=None):
        self.read = self.write = self.sync = None
        self.engines: list = []
        self._inner = inner or open_engine

    def engine_factory(self):
        async def factory(backend, queue_depth):
            e = HookedEngine(await self._inner(backend, queue_depth), self)
            self.engines.append(e)
            return e

        return factory


class HookedEngine:
    def __init__(self, inner, hooks: EngineHooks):
        self.inner, self.hooks = inner, hooks

    def __getattr__(self, name):  # capabilities, register_buffers, close, ...
        return getattr(self.inner, name)

    async def read_many(self, *a):
        h = self.hooks.read
        return await (self.inner.read_many(*a) if h is None else h(self.inner.read_many, *a))

    async def read_many_crc(self, *a):
        """Hooked: the hook's read, and no CRC from the engine (-1: the store computes them)."""
        h = self.hooks.read
        if h is None and hasattr(self.inner, "read_many_crc"):
            return await self.inner.read_many_crc(*a)
        res = await (self.inner.read_many(*a[:4]) if h is None else h(self.inner.read_many, *a[:4]))
        return res, np.full(len(a[4]), -1, np.int64)

    def start_read_crc(self, *a):
        """Unhooked, the engine's own (submitted now); a hooked read goes through read_many_crc (None)."""
        if self.hooks.read is None and hasattr(self.inner, "start_read_crc"):
            return self.inner.start_read_crc(*a)
        return None

    async def write_many(self, *a):
        h = self.hooks.write
        return await (self.inner.write_many(*a) if h is None else h(self.inner.write_many, *a))

    async def sync(self, fd, datasync=True):
        h = self.hooks.sync
        return await (self.inner.sync(fd, datasync=datasync) if h is None else h(self.inner.sync, fd, datasync))


def on_files_under(root: str):
    """FaultRule predicate: ops on files under ``root`` (one drive of several)."""
    root = os.path.realpath(root)

    def pred(op, fd, offset, length) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(root + os.sep)
        except OSError:
            return False

    return pred
