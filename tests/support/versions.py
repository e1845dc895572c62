"""The version oracle: bytes that say which version of which key they are, and a model of what was
acknowledged, so that a read after a crash or a rebuild can be classified.

* ``versioned(key, version, nbytes, comp)``: a 16-byte header (a hash of key and component, then
  the version) followed by bytes drawn from (key, component, version). Every version of a key has
  its own bytes; ``version_in(key, buf, comp)`` says which version a buffer holds (``None``: no
  version of this key, torn or foreign bytes).
* ``VersionModel``: per key, the acknowledged state (a version, or removed by an acknowledged
  delete / clear, or never put) and what a kill left in doubt (puts, deletes or a clear in flight
  at the kill, which may or may not have landed). Any later acknowledged operation on the key ends
  its doubt. ``classify`` sorts a served version into ``ok`` / ``stale_served`` / ``resurrected``.

What may be served for a key: its acknowledged version, or a version in doubt. Anything else is:

* ``resurrected`` when the acknowledged state is "absent" (deleted, cleared, or never
  acknowledged) and the version is not in doubt: a dead record came back;
* ``stale_served`` when a version is acknowledged but another one is served (an older
  acknowledged one, one superseded while it was in doubt, one whose put answered False), or a
  page whose components hold different versions;
* ``wrong_bytes`` when the bytes are no version of this key at all.

A miss is never a mix-up. Whether it is a loss is the caller's call (``must_exist``): where the
durability promise holds (no eviction; a process kill, or a rebuild in strict mode) a key that is
acknowledged present with no delete in doubt must exist, and ``exists`` answering False for it
counts in ``lost_acknowledged``; under eviction only the last batch is sure to be kept. Losing
cache is acceptable where nothing promised it; serving a wrong, stale or resurrected version never.

Dedup: a put of a key the store already holds writes nothing (the old bytes stay, True is
answered). So a workload that wants new bytes under a key deletes it first (or finds it evicted);
a put acknowledged for a key that was present (``put_acked(..., wrote=False)``) keeps the model's
version. The ack log (``AckLog`` / ``read_log``) carries this across processes: a line is written
before an operation (intent) and after it (outcome), one ``os.write`` each, so a SIGKILL leaves
whole lines; the intents without an outcome are the operations in flight at the kill.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

HEADER = struct.Struct("<QQ")  # key tag, version
OK, STALE, RESURRECTED, WRONG, LOST = "ok", "stale_served", "resurrected", "wrong_bytes", "lost_acknowledged"


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def _tag(key: str, comp: int) -> int:
    return _hash64(f"{key}#{comp}")


@lru_cache(maxsize=2048)
def _body(key: str, comp: int, version: int, nbytes: int) -> bytes:
    seed = _hash64(f"{key}#{comp}@{version}")
    return np.random.Generator(np.random.PCG64(seed)).bytes(nbytes)


def versioned(key: str, version: int, nbytes: int, comp: int = 0) -> np.ndarray:
    """The bytes of ``version`` of ``key`` (component ``comp``), ``nbytes`` long (uint8, read-only)."""
    head = HEADER.pack(_tag(key, comp), int(version))
    if nbytes <= HEADER.size:
        return np.frombuffer(head[:nbytes], np.uint8)
    return np.frombuffer(head + _body(key, comp, int(version), nbytes - HEADER.size), np.uint8)


def version_in(key: str, buf, comp: int = 0) -> int | None:
    """The version of ``key`` whose bytes ``buf`` holds exactly, or None (no version of this key)."""
    b = np.asarray(buf, np.uint8).reshape(-1)
    if len(b) < HEADER.size:
        return None
    tag, v = HEADER.unpack(b[: HEADER.size].tobytes())
    if tag != _tag(key, comp):
        return None
    return v if np.array_equal(b, versioned(key, v, len(b), comp)) else None


# --- host pools (support.host_pool.HostPool): one version per page, one header per component ---


async def put_versions(st, keys, version: int, nbytes: int) -> list[bool]:
    """``put_many`` of each key's ``version`` bytes on a PageStore."""
    return await st.put_many(keys, [versioned(k, version, nbytes) for k in keys])


async def read_versions(st, keys, nbytes: int) -> list[int | None]:
    """The version each key reads back as from a PageStore (None: a miss; -1: bytes of no version of that key)."""
    outs = [np.zeros(nbytes, np.uint8) for _ in keys]
    res = await st.get_many(keys, outs)
    return [(-1 if version_in(k, o) is None else version_in(k, o)) if ok else None for ok, k, o in zip(res, keys, outs)]


def fill_page(pool, page: int, key: str, version: int) -> None:
    for c, view in enumerate(pool.component_views(page)):
        view[:] = versioned(key, version, len(view), c)


def page_versions(pool, page: int, key: str) -> list[int | None]:
    return [version_in(key, view, c) for c, view in enumerate(pool.component_views(page))]


# --- the model ------------------------------------------------------------------------------


@dataclass
class KeyState:
    present: bool = False  # the acknowledged state: stored (a put acknowledged since the last removal)
    version: int | None = None  # the version the acknowledged put wrote (None: unknown, one in doubt)
    doubt: set = field(default_factory=set)  # versions in flight at a kill since the last acknowledged write
    maybe_gone: bool = False  # a delete / clear in flight at a kill since the last acknowledged op
    removed: bool = False  # acknowledged deleted or cleared (else absent means: never acknowledged)


class VersionModel:
    def __init__(self):
        self.keys: dict[str, KeyState] = {}
        self._puts: dict[str, int] = {}  # in flight: key -> version
        self._deletes: set[str] = set()
        self._clearing = False

    def state(self, key: str) -> KeyState:
        s = self.keys.get(key)
        if s is None:
            s = self.keys[key] = KeyState()
        return s

    # operations, in the order the workload ran them
    def begin_put(self, key: str, version: int) -> None:
        self._puts[key] = int(version)

    def put_acked(self, key: str, version: int, *, wrote: bool) -> None:
        """``wrote``: the key was absent at the put, so its bytes are now ``version``'s; else the
        put was a dedup: the store kept what it held (True answered, nothing written)."""
        self._puts.pop(key, None)
        s = self.state(key)
        if wrote:
            s.version, s.doubt = int(version), set()
        elif not s.present:  # it held a version in doubt: which one is still unknown
            s.version = None
        s.present, s.maybe_gone, s.removed = True, False, False

    def put_refused(self, key: str, version: int) -> None:
        self._puts.pop(key, None)  # nothing acknowledged: serving it later is a mix-up

    def begin_delete(self, key: str) -> None:
        self._deletes.add(key)

    def delete_done(self, key: str) -> None:
        """A delete answered (True, or False: the key was not there): either way absent now."""
        self._deletes.discard(key)
        self.keys[key] = KeyState(removed=True)

    def begin_clear(self) -> None:
        self._clearing = True

    def clear_done(self) -> None:
        self._clearing = False
        for k in self.keys:
            self.keys[k] = KeyState(removed=True)

    def kill(self) -> None:
        """The process died: what was in flight may or may not have landed."""
        for k, v in self._puts.items():
            self.state(k).doubt.add(v)
        for k in list(self._deletes) + (list(self.keys) if self._clearing else []):
            self.state(k).maybe_gone = True
        self._puts, self._deletes, self._clearing = {}, set(), False

    # questions
    def allowed(self, key: str) -> set:
        s = self.keys.get(key)
        if s is None:
            return set()
        return s.doubt | ({s.version} if s.present and s.version is not None else set())

    def must_exist(self, key: str) -> bool:
        s = self.keys.get(key)
        return s is not None and s.present and not s.maybe_gone

    def classify(self, key: str, versions) -> str:
        """A served page: its component versions (None: not a version of this key)."""
        vs = list(versions) if isinstance(versions, (list, tuple)) else [versions]
        if any(v is None for v in vs):
            return WRONG
        ok = self.allowed(key)
        if len(set(vs)) == 1 and vs[0] in ok:
            return OK
        s = self.keys.get(key)
        return STALE if s is not None and s.present else RESURRECTED


@dataclass
class Tally:
    """Counts of classified reads (``versions_checked`` = all of them)."""

    versions_checked: int = 0
    wrong_bytes: int = 0
    stale_served: int = 0
    resurrected: int = 0
    lost_acknowledged: int = 0
    examples: list = field(default_factory=list)
    bad_keys: list = field(default_factory=list)  # the first keys with a verdict other than ok

    def add(self, verdict: str, what: str = "") -> None:
        self.versions_checked += 1
        if verdict != OK:
            setattr(self, verdict, getattr(self, verdict) + 1)
            if len(self.examples) < 8:
                self.examples.append(f"{verdict}: {what}")

    def check(self, model: VersionModel, key: str, versions, *, durable: bool) -> str:
        """One key as the store answered: its served component versions, or None for a miss (a
        loss only where ``durable`` promises the key and the model says it must exist)."""
        if versions is None:
            verdict = LOST if durable and model.must_exist(key) else OK
        else:
            verdict = model.classify(key, versions)
        self.add(verdict, f"{key} served {versions}, allowed {sorted(model.allowed(key))}")
        if verdict != OK and len(self.bad_keys) < 8:
            self.bad_keys.append(key)
        return verdict

    def bad(self) -> int:
        return self.wrong_bytes + self.stale_served + self.resurrected + self.lost_acknowledged

    def merge(self, other: "Tally") -> None:
        for f in ("versions_checked", "wrong_bytes", "stale_served", "resurrected", "lost_acknowledged"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.examples = (self.examples + other.examples)[:8]
        self.bad_keys = (self.bad_keys + other.bad_keys)[:8]

    def figures(self) -> dict:
        return dict(versions_checked=self.versions_checked, wrong_bytes=self.wrong_bytes,
                    stale_served=self.stale_served, resurrected=self.resurrected,
                    lost_acknowledged=self.lost_acknowledged)  # fmt: skip


# --- the ack log: the model across a SIGKILL -----------------------------------------------------
# ?K V  put of version V in flight      +K V  acknowledged, written     ~K V  acknowledged, dedup
# xK V  put answered False              DK    delete in flight          -K    delete answered
# C     clear in flight                 c     clear done                =     a put batch ended
# rN    a read batch of N pages         !K / SK / RK  a child served wrong / stale / resurrected
# k     the writer was killed (``seal_after_kill``, by the parent before the next session)


class AckLog:
    """Appends a batch of lines with one write (a kill leaves whole lines, or a torn last one)."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def write(self, lines: list[str]) -> None:
        if lines:
            os.write(self.fd, "".join(x + "\n" for x in lines).encode())

    def close(self) -> None:
        os.close(self.fd)


def history(path: str, key: str, last: int = 12) -> list[str]:
    """The log lines about ``key`` (and the kills and clears between them): what a mix-up report needs."""
    out = []
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            k, _, v = line[1:].partition(" ")
            if line in ("k", "C", "c") or k == key:
                out.append(f"{line[:1]}{k[:12]} {v}".rstrip())
    while out and out[0] in ("k", "C", "c"):
        out.pop(0)
    return out[-last:]


def seal_after_kill(path: str) -> None:
    """Drop a torn last line (the kill cut its write) and mark the kill."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass
    log = AckLog(path)
    log.write(["k"])
    log.close()


@dataclass
class LogState:
    model: VersionModel
    last_batch: set  # keys the last acknowledged put batch wrote (eviction cannot have taken them yet)
    reads_after_last: int
    child: Tally  # what the children saw on their own reads
    next_version: int  # above every version the log names


def read_log(path: str, *, killed: bool = False) -> LogState:
    """The model the log describes; ``killed``: its writer died unmarked (what was in flight is in doubt)."""
    m = VersionModel()
    last, cur = set(), set()
    reads = top = 0
    child = Tally()
    try:
        with open(path) as f:
            lines = f.read().split("\n")[:-1]  # the piece after the last newline is torn
    except FileNotFoundError:
        lines = []
    for line in lines:
        op, rest = line[:1], line[1:]
        if op in ("?", "+", "~", "x"):
            k, v = rest.rsplit(" ", 1)
            top = max(top, int(v))
            if op == "?":
                m.begin_put(k, int(v))
            elif op == "x":
                m.put_refused(k, int(v))
            else:
                m.put_acked(k, int(v), wrote=op == "+")
                if op == "+":
                    cur.add(k)
        elif op == "D":
            m.begin_delete(rest)
        elif op == "-":
            m.delete_done(rest)
            last.discard(rest)
            cur.discard(rest)
        elif op == "C":
            m.begin_clear()
        elif op == "c":
            m.clear_done()
            last, cur = set(), set()
        elif op == "=":
            last, cur, reads = cur, set(), 0
        elif op == "r":
            reads += 1
            child.versions_checked += int(rest or 0)
        elif op in ("!", "S", "R"):
            child.add({"!": WRONG, "S": STALE, "R": RESURRECTED}[op], f"child read {rest}")
            child.versions_checked -= 1  # counted in its batch's "r" line
        elif op == "k":
            m.kill()
    if killed:
        m.kill()
    return LogState(m, last, reads, child, top + 1)
