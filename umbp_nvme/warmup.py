"""Offline cache warm-up: import pages into a store, or warm a live server by replaying prompts.

Sources (``umbp-nvme warmup --store DIR SOURCE...``), recognised by what they are on disk:

* a directory of SGLang's ``file`` backend (HiCacheFile): ``<page hash><suffix>.bin`` files, one
  per page and rank, holding the page as SGLang's legacy flat data page. Their names and bytes
  map onto our component keys as described in docs/cli.md ("HiCacheFile mapping");
* another umbp_nvme store directory (has MANIFEST.json): merged, its namespace must match;
* an archive written by ``umbp-nvme export`` (docs/archive.md).

Every source becomes a stream of *units*: one blob read from the source that holds one or more
objects (a HiCacheFile MHA page is K then V). Units whose keys are all in the store already are
skipped without reading them (so a second run resumes where an interrupted one stopped: the
store publishes an object only after its bytes are written, so there is no half-imported key).
The rest are read into page-aligned staging memory by a worker thread, checked against their
CRC32C when the source has one, and written with one ``put_many`` per batch while the next
batch is read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import http.client
import json
import logging
import os
import signal
import stat
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .archive import ArchiveError, ArchiveReader
from .buffers import AlignedBuffer
from .keybytes import encode_key, key_error, printable_key
from .keys import KeyScheme
from .maintenance import StoreReader
from .store import MANIFEST_FILE

log = logging.getLogger(__name__)

BATCH_BYTES = 32 << 20
BATCH_OBJECTS = 256
_ALIGN = 4096


def _align_up(n: int, a: int = _ALIGN) -> int:
    return -(-n // a) * a


# --- throttle and progress -------------------------------------------------------------------


class TokenBucket:
    """Bytes per second with a burst of ``burst_s`` seconds; ``rate_bps`` None or <= 0 = unlimited."""

    def __init__(self, rate_bps: float | None, burst_s: float = 0.25, clock=time.monotonic):
        self.rate = float(rate_bps) if rate_bps and rate_bps > 0 else None
        self.capacity = (self.rate or 0) * burst_s
        self.tokens = self.capacity
        self._clock = clock
        self._last = clock()

    def delay_for(self, nbytes: int) -> float:
        """Take nbytes (the balance may go negative) and return how long to wait before using them."""
        if self.rate is None:
            return 0.0
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
        self._last = now
        self.tokens -= nbytes
        return max(0.0, -self.tokens / self.rate)

    async def take(self, nbytes: int) -> None:
        d = self.delay_for(nbytes)
        if d > 0:
            await asyncio.sleep(d)


class Progress:
    """A tqdm bar on stderr when stderr is a terminal (bytes, GB/s, ETA); otherwise silent."""

    def __init__(self, total: int | None, *, unit: str = "B", desc: str = "", enabled: bool | None = None):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is a dependency; a broken install only loses the bar
                tqdm = None
            if tqdm is not None:
                kw = dict(unit="B", unit_scale=True, unit_divisor=1000) if unit == "B" else dict(unit=unit)
                self._bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, smoothing=0.1, **kw)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def add_total(self, n: int) -> None:
        if self._bar is not None and self._bar.total is not None:
            self._bar.total += n
            self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# --- summary ---------------------------------------------------------------------------------


@dataclass
class Summary:
    imported: int = 0  # objects newly stored
    skipped: int = 0  # objects already present (dedup / resume)
    failed: int = 0  # objects that could not be read, verified or stored
    refused_files: int = 0  # source files refused whole (size or name does not fit the namespace)
    ignored_files: int = 0  # files of other ranks / models, temporaries: not ours to import
    bytes_imported: int = 0
    bytes_skipped: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    sources: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # the first few messages
    more_errors: int = 0  # messages past the first 20 (counted, not kept or logged)
    _t0: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        """Counters move from the reader thread and the loop thread alike."""
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, msg: str) -> None:
        """Keep and log the first 20 messages; count the rest (a damaged source may have millions)."""
        with self._lock:
            if len(self.errors) >= 20:
                self.more_errors += 1
                return
            self.errors.append(msg)
        log.warning("%s", msg)

    def finish(self) -> "Summary":
        self.seconds = time.perf_counter() - self._t0
        return self

    @property
    def ok(self) -> bool:
        return not (self.failed or self.refused_files or self.interrupted)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        d["seconds"] = round(self.seconds, 3)
        d["gbps"] = round(self.bytes_imported / self.seconds / 1e9, 3) if self.seconds > 0 else 0.0
        return d

    def table(self) -> str:
        d = self.as_dict()
        rows = [
            ("imported", f"{d['imported']} objects, {d['bytes_imported'] / 1e9:.3f} GB"),
            ("skipped (present)", f"{d['skipped']} objects, {d['bytes_skipped'] / 1e9:.3f} GB"),
            ("failed", str(d["failed"])),
        ]
        if d["refused_files"]:
            rows.append(("refused files", str(d["refused_files"])))
        if d["ignored_files"]:
            rows.append(("ignored files", f"{d['ignored_files']} (other ranks/models or temporaries)"))
        rows.append(("time", f"{d['seconds']:.2f} s, {d['gbps']:.3f} GB/s"))
        if d["interrupted"]:
            rows.append(("interrupted", "yes: run the same command again to continue"))
        w = max(len(r[0]) for r in rows)
        lines = [f"{a:<{w}}  {b}" for a, b in rows]
        for e in d["errors"][:10]:
            lines.append(f"  ! {e}")
        hidden = len(d["errors"]) - 10 + d["more_errors"]
        if hidden > 0:
            lines.append(f"  ! ... and {hidden} more (--json lists the first 20)")
        return "\n".join(lines)


# --- units -----------------------------------------------------------------------------------


@dataclass
class Unit:
    keys: list[str]
    offsets: list[int]  # of each object inside the blob
    lengths: list[int]
    blob_bytes: int
    label: str  # where it came from, for messages
    crcs: list | None = None  # CRC32C per object when the source keeps one
    read: Callable | None = None  # read(memoryview of blob_bytes) -> None | error message
    skip: Callable | None = None  # skip() when not read (streams)


# --- HiCacheFile mapping ---------------------------------------------------------------------


@dataclass(frozen=True)
class FileBackendLayout:
    """How one rank of SGLang's HiCacheFile names its files, and our keys for the same rank.

    HiCacheFile (sglang 0.5.23) writes ``<dir>/<key><suffix>.bin`` with
    ``suffix = _{model}_{tp_rank}_{tp_size}{shard}`` (MHA) or ``_{model}{shard}`` (MLA, shared by
    all TP ranks), ``shard = _{pp_size}_{pp_rank}`` with PP, plus ``_cp{r}_{n}`` with attention
    context parallelism and ``_tp{tp}_dcp{r}_{n}_page{P}`` with decode context parallelism;
    ``model`` has ``/`` replaced by ``-``. Side pools write ``<key>.<pool><suffix>.bin``.
    """

    model: str | None = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    is_mla: bool = False
    split_factor: int = 0
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    logical_page_size: int | None = None

    def validate(self) -> "FileBackendLayout":
        if not (0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"--tp-rank {self.tp_rank} must be in [0, --tp-size {self.tp_size})")
        if not (0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"--pp-rank {self.pp_rank} must be in [0, --pp-size {self.pp_size})")
        if self.split_factor and self.is_mla:
            raise ValueError("--split-heads applies to MHA models only; drop it or --mla")
        if self.attn_cp_size > 1 and not self.is_mla:
            raise ValueError(
                "HiCacheFile shards MHA pages by attention-CP rank, but our KV keys carry no CP rank "
                "(UMBP's scheme); importing --attn-cp-size > 1 for MHA would mix shards. Not supported."
            )
        return self

    @property
    def file_suffix(self) -> str:
        model = "-".join(self.model.split("/")) if self.model else ""
        shard = f"_{self.pp_size}_{self.pp_rank}" if self.pp_size > 1 else ""
        if self.attn_cp_size > 1:
            shard += f"_cp{self.attn_cp_rank}_{self.attn_cp_size}"
        suffix = f"_{model}{shard}" if self.is_mla else f"_{model}_{self.tp_rank}_{self.tp_size}{shard}"
        if self.dcp_size > 1:
            suffix += f"_tp{self.tp_size}_dcp{self.dcp_rank}_{self.dcp_size}_page{self.logical_page_size}"
        return suffix

    def key_scheme(self) -> KeyScheme:
        return KeyScheme(
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            is_mla=self.is_mla,
            split_factor=self.split_factor,
            dcp_rank=self.dcp_rank,
            dcp_size=self.dcp_size,
            attn_cp_rank=self.attn_cp_rank,
        )

    def parse(self, filename: str) -> tuple[str | None, str]:
        """(page hash, '') for this rank's KV page file; (None, reason) for anything else."""
        if not filename.endswith(".bin"):
            return None, "ignored"
        stem = filename[:-4]
        suffix = self.file_suffix
        if not stem.endswith(suffix) or len(stem) == len(suffix):
            return None, "ignored"
        key = stem[: -len(suffix)]
        if "." in key:
            return None, f"side pool {key.rsplit('.', 1)[1]!r}"
        return key, ""

    def objects(self, page_hash: str, page_bytes: int) -> tuple[list[str], list[int], list[int]]:
        """Our component keys for one flat page and where each lies in it.

        The flat page is ``kv_buffer[:, page]`` (MHA: the K half then the V half; for the layouts
        UMBP supports each half is exactly the bytes get_page_buffer_meta points at) or the MLA
        page itself. With split heads (page_head layout, heads outermost in each half) head group
        g is the g-th of ``split_factor`` equal slices of each half, ordered K(g0), V(g0), K(g1)...
        """
        scheme = self.key_scheme()
        keys = scheme.v1_keys([page_hash])
        if self.is_mla:
            return keys, [0], [page_bytes]
        half = page_bytes // 2
        groups = max(1, self.split_factor)
        part = half // groups
        offsets, lengths = [], []
        for g in range(groups):
            for c in range(2):
                offsets.append(c * half + g * part)
                lengths.append(part)
        return keys, offsets, lengths

    def divisor(self) -> int:
        return 1 if self.is_mla else 2 * max(1, self.split_factor)


def expected_page_bytes(namespace: dict, layout: FileBackendLayout) -> int | None:
    """Bytes of one flat KV page of this rank according to a store namespace, when it says.

    Recognised: ``kv_page_bytes`` / ``page_bytes`` (whole flat page), or the per-object size of the
    KV anchor as ``kv_object_bytes``, ``object_bytes`` or ``pools.kv.object_bytes`` (an int, or a
    list of per-component sizes that are summed).
    """
    if not namespace:
        return None
    for k in ("kv_page_bytes", "page_bytes"):
        v = namespace.get(k)
        if isinstance(v, int) and v > 0:
            return v
    cands = [namespace.get("kv_object_bytes"), namespace.get("object_bytes")]
    pools = namespace.get("pools")
    if isinstance(pools, dict) and isinstance(pools.get("kv"), dict):
        p = pools["kv"]
        cands += [p.get("object_bytes"), p.get("bytes"), p.get("sizes")]
    for v in cands:
        if isinstance(v, bool):
            continue
        if isinstance(v, int) and v > 0:
            return v * layout.divisor()
        if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
            return sum(v) if len(v) == layout.divisor() else v[0] * layout.divisor()
    return None


def _file_kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return what
    return "special file"


def _file_read(path: str):
    """read(mv): exactly mv.nbytes bytes of the regular file at path, never more.

    O_NOFOLLOW: a symlink swapped in after the listing is refused, not followed; O_NONBLOCK: a
    FIFO swapped in never blocks the open; fstat then proves it is still a regular file of the
    size that was checked before the staging memory was sized."""

    def read(mv: memoryview) -> str | None:
        shown = printable_key(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return f"{shown} became a symbolic link while being imported; not followed"
            return f"{shown}: {e.strerror or e}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return f"{shown} became a {_file_kind(st.st_mode)} while being imported; not read"
            if st.st_size != mv.nbytes:
                return f"{shown} is now {st.st_size} bytes, not {mv.nbytes}; it changed while being imported"
            got = 0
            while got < mv.nbytes:
                n = os.readv(fd, [mv[got:]])
                if not n:
                    return f"{shown}: short read ({got} of {mv.nbytes} bytes); it changed while being imported"
                got += n
        except OSError as e:
            return f"{shown}: {e.strerror or e}"
        finally:
            os.close(fd)
        return None

    return read


def file_backend_units(directory: str, layout: FileBackendLayout, page_bytes: int | None, summary: Summary,
                       *, max_page_bytes: int | None = None) -> Iterator[Unit]:
    """Units for this rank's KV page files in a HiCacheFile directory (sorted by name).

    A name that matches this rank but cannot be one of HiCacheFile's (not UTF-8), and anything
    that is not a regular file (symlink, FIFO, directory, device) is refused alone with the reason;
    a file larger than the page the store can take is never read (``max_page_bytes``)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise SourceError(f"cannot list HiCacheFile directory {directory}: {e.strerror or e}") from None
    side_pools: dict[str, int] = {}
    expected = page_bytes
    matched = 0
    for name in names:
        page_hash, why = layout.parse(name)
        if page_hash is None:
            if why.startswith("side pool"):
                side_pools[why] = side_pools.get(why, 0) + 1
            summary.add(ignored_files=1)
            continue
        path = os.path.join(directory, name)
        shown = printable_key(path)

        def refuse(msg: str) -> None:
            summary.add(refused_files=1)
            summary.error(f"{shown} {msg}")

        try:
            name.encode("utf-8")  # os.listdir escapes undecodable bytes as lone surrogates
        except UnicodeEncodeError:
            # HiCacheFile names its files after str keys, always UTF-8: these bytes are not its page
            refuse("has a name that is not UTF-8, so HiCacheFile did not write it; not imported")
            continue
        try:
            st = os.lstat(path)
        except OSError as e:
            refuse(f"cannot be examined: {e.strerror or e}")
            continue
        if not stat.S_ISREG(st.st_mode):
            refuse(f"is a {_file_kind(st.st_mode)}, not a regular file; not imported"
                   + (" (not followed)" if stat.S_ISLNK(st.st_mode) else ""))
            continue
        size = st.st_size
        matched += 1
        if max_page_bytes is not None and size > max_page_bytes:
            refuse(f"is {size} bytes, larger than the largest page this store takes ({max_page_bytes} bytes); not read")
            continue
        if expected is None:
            if size == 0 or size % layout.divisor():
                refuse(
                    f"is {size} bytes, not a multiple of the {layout.divisor()} objects per page "
                    "of this layout; check --mla / --split-heads"
                )
                continue
            expected = size  # no namespace says: the first page sets it, the rest must agree
        if size != expected:
            refuse(
                f"is {size} bytes, but a KV page of this namespace is {expected} bytes; "
                "it was written for another model, dtype or page size. Remove it from the source, "
                "or import it into a store made for that model."
            )
            continue
        keys, offs, lens = layout.objects(page_hash, size)
        yield Unit(keys, offs, lens, size, shown, read=_file_read(path))
    for what, n in side_pools.items():
        summary.error(
            f"{directory}: {n} files of {what} not imported: a side pool's flat page does not say where "
            "its components split (import those pages by letting the server write them)"
        )
    if matched == 0:
        summary.error(
            f"{directory}: no page files of this rank (suffix {layout.file_suffix!r}.bin); "
            "check --model / --tp-rank / --tp-size / --pp-* / --mla against the server that wrote them"
        )


# --- store and archive sources ---------------------------------------------------------------


def store_units(reader: StoreReader, summary: Summary, keys: list[str] | None = None) -> Iterator[Unit]:
    recs = reader.records(keys)
    if keys is not None and len(recs) < len(keys):
        summary.error(f"{reader.path}: {len(keys) - len(recs)} of the requested keys are not in the store")
    for rec in recs:

        def read(mv, rec=rec):
            st = reader.read_into(rec, mv)
            return None if st == "ok" else f"{reader.path}: object {printable_key(rec.key)}: {st}"

        yield Unit([rec.key], [0], [rec.length], rec.length, printable_key(rec.key), crcs=[None], read=read)


def archive_units(ar: ArchiveReader, summary: Summary) -> Iterator[Unit]:
    """Units straight off the stream; each must be read or skipped before the next is produced.

    Every failure counts in the summary and never ends the import early on its own: a bad record
    (CRC, empty key, too large, damaged frame) fails alone; truncation ends this source after the
    intact records, with the reason."""
    skip_err: list[str] = []

    def skip():
        try:
            ar.skip()
        except ArchiveError as e:  # truncated inside a record nobody wanted: report it, end the source
            skip_err.append(str(e))

    while True:
        if skip_err:
            summary.add(failed=1)
            summary.error(skip_err[0])
            return
        if ar.fatal is not None:  # a read hit the end of the file; the importer counted that record
            return
        try:
            head = ar.next()
        except ArchiveError as e:
            summary.add(failed=1)
            summary.error(str(e))
            return
        finally:
            for note in ar.resync_notes:
                summary.add(failed=1)
                summary.error(note)
        if head is None:
            return
        if head.error is not None:
            summary.add(failed=1)
            summary.error(head.error)
            skip()
            continue

        def read(mv, head=head):
            try:
                return None if ar.read_into(mv) else f"{ar.name}: record {printable_key(head.key)} fails its CRC32C"
            except ArchiveError as e:
                return str(e)

        yield Unit([head.key], [0], [head.length], head.length, printable_key(head.key), read=read, skip=skip)


class SourceError(ValueError):
    pass


def detect_source(path: str) -> str:
    if path == "-":
        return "archive"
    if os.path.isdir(path):
        return "store" if os.path.exists(os.path.join(path, MANIFEST_FILE)) else "files"
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):  # a file, a pipe, <(...)
        return "archive"
    raise SourceError(f"warm-up source {path} does not exist; give a HiCacheFile directory, a store directory or an archive")


# --- the importer ----------------------------------------------------------------------------


def max_object_bytes(store) -> int:
    """The largest object ``store`` takes: one segment, and under 4 GiB (the index's u32 length)."""
    return min(int(store.segment_bytes), (1 << 32) - 1)


class _Staging:
    def __init__(self, nbytes: int):
        self.buf = AlignedBuffer(nbytes)
        self.keys: list[str] = []
        self.views: list = []
        self.lengths: list[int] = []
        self.used = 0

    def reset(self, need: int) -> None:
        if need > self.buf.nbytes:
            self.buf.close()
            self.buf = AlignedBuffer(_align_up(need))
        self.keys, self.views, self.lengths, self.used = [], [], [], 0

    def close(self) -> None:
        self.buf.close()


class Importer:
    """Runs units into an open PageStore (the writer). ``stop`` ends the run after the batch in flight."""

    def __init__(self, store, summary: Summary, *, max_gbps: float | None = None, progress: Progress | None = None,
                 batch_bytes: int = BATCH_BYTES, batch_objects: int = BATCH_OBJECTS, crc32c=None):
        self.store = store
        self.summary = summary
        self.bucket = TokenBucket(max_gbps * 1e9 if max_gbps else None)
        self.progress = progress or Progress(None, enabled=False)
        self.batch_bytes = batch_bytes
        self.batch_objects = batch_objects
        self.stop = threading.Event()
        if crc32c is None:
            from ._uring import crc32c
        self._crc32c = crc32c
        self._pending: set[str] = set()
        # what the store takes, checked before staging memory is sized for a unit
        self.max_object_bytes = max_object_bytes(store)
        self.max_key_bytes = getattr(getattr(store, "_index", None), "max_key_bytes", None) or 511

    def _refusal(self, u: Unit) -> str | None:
        """Why the store cannot take this unit (checked before anything is allocated or read)."""
        for n in u.lengths:
            if not 0 <= n <= self.max_object_bytes:
                return f"{u.label}: an object of {n} bytes is over the largest this store takes ({self.max_object_bytes})"
        if not 0 <= u.blob_bytes <= self.max_object_bytes * len(u.keys):
            return f"{u.label}: {u.blob_bytes} bytes is more than its {len(u.keys)} objects can hold"
        for k in u.keys:
            why = key_error(k)
            if why is None and len(encode_key(k)) > self.max_key_bytes:
                why = f"key of {len(encode_key(k))} bytes, over the store's limit of {self.max_key_bytes}"
            if why is not None:
                return f"{u.label}: key {printable_key(k) if isinstance(k, str) else repr(k)} refused: {why}"
        return None

    def _fill(self, units: Iterator[Unit], stg: _Staging, carry: list) -> bool:
        """Worker thread: read units into stg until it is full. False when the source is exhausted."""
        stg.reset(0)
        s = self.summary
        while not self.stop.is_set():
            if carry:
                u = carry.pop()
            else:
                u = next(units, None)
                if u is None:
                    return False
                bad = self._refusal(u)
                if bad is not None:
                    s.add(failed=len(u.keys))
                    s.error(bad)
                    self.progress.update(u.blob_bytes)
                    if u.skip is not None:
                        u.skip()
                    continue
                present = self.store.exists_many_nowait(u.keys)
                missing = [k for k, p in zip(u.keys, present) if not p and k not in self._pending]
                if not missing:
                    s.add(skipped=len(u.keys), bytes_skipped=u.blob_bytes)
                    self.progress.update(u.blob_bytes)
                    if u.skip is not None:
                        u.skip()
                    continue
            if stg.keys and (stg.used + _align_up(u.blob_bytes) > stg.buf.nbytes or len(stg.keys) + len(u.keys) > self.batch_objects):
                carry.append(u)  # the next batch starts with it
                return True
            if not stg.keys:
                stg.reset(u.blob_bytes)
            base = stg.used
            mv = memoryview(stg.buf.array)[base : base + u.blob_bytes]
            err = u.read(mv)
            if err is None and u.crcs:
                for i, (o, n, c) in enumerate(zip(u.offsets, u.lengths, u.crcs)):
                    if c is not None and self._crc32c(mv[o : o + n]) != c:
                        err = f"{u.label}: object {printable_key(u.keys[i])} fails its CRC32C on the way in"
                        break
            self.progress.update(u.blob_bytes)
            if err is not None:
                s.add(failed=len(u.keys))
                s.error(err)
                continue
            present = self.store.exists_many_nowait(u.keys)
            for k, o, n, p in zip(u.keys, u.offsets, u.lengths, present):
                if p or k in self._pending:
                    s.add(skipped=1, bytes_skipped=n)
                    continue
                stg.keys.append(k)
                stg.views.append(stg.buf.array[base + o : base + o + n])
                stg.lengths.append(n)
                self._pending.add(k)
            stg.used = base + _align_up(u.blob_bytes)
        return False

    async def _put(self, stg: _Staging) -> None:
        if not stg.keys:
            return
        await self.bucket.take(sum(stg.lengths))
        res = await self.store.put_many(stg.keys, stg.views)
        s = self.summary
        imported = nbytes = 0
        for k, n, ok in zip(stg.keys, stg.lengths, res):
            self._pending.discard(k)
            if ok:
                imported += 1
                nbytes += n
        s.add(imported=imported, bytes_imported=nbytes, failed=len(res) - imported)
        if not all(res):
            bad = [printable_key(k) for k, ok in zip(stg.keys, res) if not ok]
            s.error(f"{len(bad)} of {len(res)} objects were not stored (store full, refused or I/O error; see the log): "
                    + ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else ""))

    async def run(self, units: Iterator[Unit]) -> None:
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="umbp-warmup-read")
        stgs = [_Staging(self.batch_bytes), _Staging(self.batch_bytes)]
        carry: list = []
        put_task = None
        i = 0
        try:
            more = True
            while more and not self.stop.is_set():
                stg = stgs[i % 2]
                i += 1
                more = await loop.run_in_executor(pool, self._fill, units, stg, carry)
                if put_task is not None:
                    await put_task
                put_task = asyncio.ensure_future(self._put(stg))
            if put_task is not None:
                await put_task
                put_task = None
        finally:
            if put_task is not None:
                await asyncio.shield(put_task)
            pool.shutdown(wait=True)
            for s in stgs:
                s.close()


def _install_stop(importer_stop: threading.Event, summary: Summary):
    """First Ctrl-C (SIGINT/SIGTERM): finish the batch in flight, close the store, report. Second: abort."""
    loop = asyncio.get_running_loop()

    def on_signal():
        if importer_stop.is_set():
            loop.remove_signal_handler(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            return
        summary.interrupted = True
        importer_stop.set()
        print("\ninterrupted: finishing the batch in flight (Ctrl-C again to abort)", file=sys.stderr)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass


async def import_sources(
    store_path: str,
    sources: list[str],
    config,
    *,
    layout: FileBackendLayout | None = None,
    page_bytes: int | None = None,
    namespace: dict | None = None,
    keys: list[str] | None = None,
    max_gbps: float | None = None,
    progress: bool | None = None,
    handle_signals: bool = True,
    batch_bytes: int = BATCH_BYTES,
    capacity_from_manifest: bool = False,
) -> Summary:
    """Open store_path as writer and import every source into it (see module docstring).

    ``capacity_from_manifest``: an existing store keeps the capacity it records (a tool that was
    not told the server's capacity must not shrink the store)."""
    from .store import PageStore

    summary = Summary()
    layout = (layout or FileBackendLayout()).validate()
    opened: list = []
    plan: list[tuple[str, str, object]] = []
    ns = namespace
    try:
        for src in sources:
            kind = detect_source(src)
            if kind == "store":
                r = StoreReader(src)
                opened.append(r)
                plan.append((src, kind, r))
                ns = _merge_namespace(ns, r.namespace, src)
            elif kind == "archive":
                try:
                    a = ArchiveReader.open(src)
                except OSError as e:
                    raise SourceError(f"cannot open archive {src}: {e.strerror or e}") from None
                opened.append(a)
                plan.append((src, kind, a))
                ns = _merge_namespace(ns, a.namespace, src)
            else:
                plan.append((src, kind, None))
        store = await PageStore.open(store_path, config, namespace=ns or None,
                                     capacity_from_manifest=capacity_from_manifest)
        try:
            target_ns = store.manifest.get("namespace") or {}
            expected = page_bytes or expected_page_bytes(target_ns, layout)
            max_obj = max_object_bytes(store)
            for _src, kind, obj in plan:
                if kind == "archive":
                    obj.max_object_bytes = max_obj  # a larger record fails alone, before any allocation
            total = 0
            for src, kind, obj in plan:
                if kind == "store":
                    total += int(obj.scan()[1]["length"].sum()) if keys is None else 0
                elif kind == "archive":
                    total += obj.bytes_left or 0
                elif kind == "files":
                    total += _dir_bytes(src, layout)
            bar = Progress(total or None, desc="warmup", enabled=progress)
            imp = Importer(store, summary, max_gbps=max_gbps, progress=bar, batch_bytes=batch_bytes)
            if handle_signals:
                _install_stop(imp.stop, summary)
            try:
                for src, kind, obj in plan:
                    if imp.stop.is_set():
                        break
                    summary.sources.append({"source": src, "kind": kind})
                    if kind == "files":
                        units = file_backend_units(src, layout, expected, summary, max_page_bytes=max_obj * layout.divisor())
                    elif kind == "store":
                        units = store_units(obj, summary, keys)
                    else:
                        units = archive_units(obj, summary)
                    if keys is not None and kind != "store":
                        wanted = set(keys)
                        units = _only_keys(units, wanted, summary)
                    await imp.run(units)
            finally:
                bar.close()
                if handle_signals:
                    loop = asyncio.get_running_loop()
                    for sig in (signal.SIGINT, signal.SIGTERM):
                        try:
                            loop.remove_signal_handler(sig)
                        except (NotImplementedError, RuntimeError):
                            pass
        finally:
            await store.close()
    finally:
        for o in opened:
            o.close()
    return summary.finish()


def _only_keys(units: Iterator[Unit], wanted: set, summary: Summary) -> Iterator[Unit]:
    for u in units:
        if any(k in wanted for k in u.keys):
            yield u
        elif u.skip is not None:
            u.skip()


def _dir_bytes(directory: str, layout: FileBackendLayout) -> int:
    total = 0
    try:
        with os.scandir(directory) as it:
            for e in it:
                if layout.parse(e.name)[0] is not None:
                    try:  # regular files only, as the import itself (a symlink is not followed)
                        if e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        pass
    except OSError:
        pass
    return total


def _merge_namespace(ns: dict | None, other: dict, src: str) -> dict | None:
    if not other:
        return ns
    if ns and json.dumps(ns, sort_keys=True) != json.dumps(other, sort_keys=True):
        from .errors import NamespaceMismatchError

        fields = sorted(k for k in set(ns) | set(other) if ns.get(k) != other.get(k))
        raise NamespaceMismatchError(
            f"source {src} has namespace {other!r}, which differs from another source's {ns!r} "
            f"(fields {', '.join(fields)}); import them into separate stores"
        )
    return dict(other)


# --- replay against a live server ------------------------------------------------------------


@dataclass
class ReplaySummary:
    sent: int = 0
    ok: int = 0
    failed: int = 0  # every request without a valid reply, malformed ones included
    malformed: int = 0  # of which the server answered with something that is not a /generate reply
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    errors: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["seconds"] = round(self.seconds, 3)
        d["requests_per_s"] = round(self.sent / self.seconds, 2) if self.seconds > 0 else 0.0
        return d

    def table(self) -> str:
        d = self.as_dict()
        lines = [
            f"requests  {d['sent']} sent, {d['ok']} ok, {d['failed']} failed"
            + (f" ({d['malformed']} malformed replies)" if d["malformed"] else ""),
            f"tokens    {d['prompt_tokens']} prompt, {d['cached_tokens']} already cached",
            f"time      {d['seconds']:.2f} s, {d['requests_per_s']:.1f} requests/s",
        ]
        if d["interrupted"]:
            lines.append("interrupted: yes")
        lines += [f"  ! {e}" for e in d["errors"][:10]]
        return "\n".join(lines)


def load_prompts(path: str) -> list[dict]:
    """PROMPTS.jsonl: one JSON value per line: a string, or an object with "text" (or "prompt") or
    "input_ids"; an object's "sampling_params" are kept (max_new_tokens is forced to 1)."""
    out = []
    try:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    except OSError as e:
        raise SourceError(f"cannot read prompts file {path}: {e.strerror or e}") from None
    with f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                v = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise SourceError(f"{path}:{n}: not valid JSON ({e}); each line must be one JSON value") from None
            if isinstance(v, str):
                body = {"text": v}
            elif isinstance(v, dict) and ("text" in v or "prompt" in v or "input_ids" in v):
                body = {k: v[k] for k in ("text", "input_ids", "lora_path", "image_data") if k in v}
                if "prompt" in v and "text" not in body:
                    body["text"] = v["prompt"]
                body["sampling_params"] = dict(v.get("sampling_params") or {})
            else:
                raise SourceError(f'{path}:{n}: expected a string or an object with "text", "prompt" or "input_ids"')
            sp = body.setdefault("sampling_params", {})
            sp["max_new_tokens"] = 1
            sp.setdefault("temperature", 0)
            out.append(body)
    return out


MAX_REPLY_BYTES = 16 << 20  # a /generate reply with max_new_tokens=1 is a few KiB


class BadReply(ValueError):
    """The server answered 200 with something that is not a /generate reply."""


def _post(url: str, body: dict, timeout_s: float) -> bytes:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    deadline = time.monotonic() + timeout_s
    chunks, got = [], 0
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        while got <= MAX_REPLY_BYTES:  # never more: the rest is dropped with the connection
            # read1: what has arrived, so a server dripping bytes cannot stretch one request past
            # --timeout (the socket timeout alone restarts with every byte)
            c = resp.read1(min(1 << 20, MAX_REPLY_BYTES + 1 - got))
            if not c:
                break
            chunks.append(c)
            got += len(c)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the reply was not complete after {timeout_s:g} s")
    if got > MAX_REPLY_BYTES:
        raise BadReply(f"reply larger than {MAX_REPLY_BYTES >> 20} MiB")
    return b"".join(chunks)


def _token_count(meta: dict, name: str) -> int:
    v = meta.get(name, 0)
    if v is None:
        return 0
    if type(v) is not int or not 0 <= v < 1 << 53:  # bool, float (1e999 is inf), str, absurd: not a count
        raise BadReply(f"meta_info.{name} is {str(v)[:40]!r}, not a token count")
    return v


def parse_reply(raw: bytes) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) of a /generate reply; BadReply for anything else."""
    try:
        out = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        head = raw[:60].decode("utf-8", "backslashreplace")
        raise BadReply(f"reply is not JSON ({type(e).__name__}; starts {head!r})") from None
    if isinstance(out, list) and out:  # a batch reply: the first item
        out = out[0]
    if not isinstance(out, dict):
        raise BadReply(f"reply is a JSON {type(out).__name__}, not an object")
    meta = out.get("meta_info", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise BadReply(f"meta_info is a JSON {type(meta).__name__}, not an object")
    return _token_count(meta, "prompt_tokens"), _token_count(meta, "cached_tokens")


def replay(prompts_path: str, server: str, *, concurrency: int = 8, timeout_s: float = 600.0,
           progress: bool | None = None) -> ReplaySummary:
    """POST every prompt to {server}/generate with max_new_tokens=1, ``concurrency`` in flight."""
    if concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {concurrency}")
    bodies = load_prompts(prompts_path)
    base = server.rstrip("/")
    if not base.startswith(("http://", "https://")):
        base = "http://" + base
    url = base + "/generate"
    summary = ReplaySummary()
    bar = Progress(len(bodies), unit="req", desc="replay", enabled=progress)
    t0 = time.perf_counter()
    lock = threading.Lock()
    stop = threading.Event()

    def one(i: int, body: dict) -> None:
        if stop.is_set():
            return
        # everything the server sends is parsed in here: no reply can end the run
        err = None
        malformed = False
        try:
            prompt_tokens, cached_tokens = parse_reply(_post(url, body, timeout_s))
        except urllib.error.HTTPError as e:
            err = f"prompt {i + 1}: {url} answered HTTP {e.code} {str(e.reason)[:200]}"
            e.close()
        except BadReply as e:
            malformed = True
            err = f"prompt {i + 1}: {url} sent a malformed reply: {e}"
        except TimeoutError as e:
            err = f"prompt {i + 1}: {url} timed out ({e or 'no answer'}); raise --timeout if the server is just slow"
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            err = f"prompt {i + 1}: cannot reach {url} ({reason}); is the server running and is --server right?"
        except (http.client.HTTPException, ValueError) as e:  # broken HTTP framing, bad headers
            malformed = True
            err = f"prompt {i + 1}: {url} broke the HTTP protocol ({type(e).__name__}: {str(e)[:200]})"
        with lock:
            summary.sent += 1
            if err is None:
                summary.ok += 1
                summary.prompt_tokens += prompt_tokens
                summary.cached_tokens += cached_tokens
            else:
                summary.failed += 1
                summary.malformed += malformed
                if len(summary.errors) < 20:
                    summary.errors.append(err)
        bar.update(1)

    ex = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="umbp-replay")
    futs = []
    try:
        futs = [ex.submit(one, i, b) for i, b in enumerate(bodies)]
        for f in futs:
            f.result()
    except KeyboardInterrupt:
        summary.interrupted = True
        stop.set()
        for f in futs:
            f.cancel()
    finally:
        ex.shutdown(wait=True)
        bar.close()
    summary.seconds = time.perf_counter() - t0
    return summary
