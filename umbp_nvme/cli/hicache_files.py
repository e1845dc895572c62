"""Reading SGLang's ``file`` storage backend (HiCacheFile) directories for ``umbp-nvme warmup``.

HiCacheFile writes ``<page hash><suffix>.bin`` files, one per page and rank, holding the page as
SGLang's legacy flat data page. Their names and bytes map onto our component keys as described
in docs/cli.md ("HiCacheFile mapping"); ``file_backend_units`` turns one rank's files into the
units that ``umbp_nvme.cli.warmup.Importer`` imports.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from ..keybytes import printable_key
from ..sglang.keys import KeyScheme
from .sources import SourceError, Summary, Unit


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


def file_read(path: str):
    """read(mv): exactly mv.nbytes bytes of the regular file at path, never more.

    O_NOFOLLOW: a symlink swapped in after the listing is refused, not followed; O_NONBLOCK: a
    FIFO swapped in never blocks the open; fstat then proves it is still a regular file of the
    size that was checked before the staging memory was sized, and again after the read that
    nobody wrote it meanwhile (HiCacheFile rewrites a page in place: torn bytes have no CRC to fail)."""

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
            after = os.fstat(fd)
            if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                return f"{shown} was written while being imported; not imported (run the import again)"
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
        yield Unit(keys, offs, lens, size, shown, read=file_read(path))
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


def no_page_files(directory: str, layout: FileBackendLayout) -> str | None:
    """Why ``directory`` gives this rank nothing to import (no file name of its KV pages), else None.

    Checked before the store is opened, so a wrong --model or --tp-rank costs neither an empty
    store nor an exit code 0 (issue 35)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise SourceError(f"cannot list HiCacheFile directory {directory}: {e.strerror or e}") from None
    if any(layout.parse(n)[0] is not None for n in names):
        return None
    held = (f"it holds {len(names)} other file{'s' if len(names) != 1 else ''} "
            f"({', '.join(printable_key(n) for n in names[:3])}{', ...' if len(names) > 3 else ''})"
            if names else "it is empty")
    return (f"SOURCE {directory} holds no page files of this rank (names ending '{layout.file_suffix}.bin'); "
            f"{held}. Check --model / --tp-rank / --tp-size / --pp-* / --mla against the server that wrote them. "
            "Nothing was imported and the store was not opened")


def dir_bytes(directory: str, layout: FileBackendLayout) -> int:
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
