"""What an engine knows of a file travels with the file (issue 28): a DataFile's ``FileFacts``,
or ``Files`` (a batch's fds and their facts). No table is keyed by fd, so a reused fd number never
lends one file's O_DIRECT alignment to another, and a closed DataFile is refused, not served."""

from __future__ import annotations

import ast
import dataclasses
import os
import pathlib
import re

import numpy as np
import pytest

from umbp_nvme.buffers import AlignedBuffer
from umbp_nvme.engine import open_engine
from umbp_nvme.engine.base import IoBatch
from umbp_nvme.engine.files import (
    DEFAULT_DIO_ALIGN_BYTES,
    NO_FILES,
    PAGE_CACHE,
    FileFacts,
    Files,
    dio_alignment,
    open_data_file,
    split_files,
)

import umbp_nvme._uring  # noqa: E402,F401 - required: a missing extension fails here

from umbp_nvme.engine.uring import open_uring_engine  # noqa: E402

MiB = 1 << 20
PAGE = 4096


def _direct(path, **kw):
    f = open_data_file(path, create=True, size=MiB, **kw)
    if not f.direct:
        f.close()
        pytest.skip(f"O_DIRECT unsupported on {path} (tmpfs?)")
    return f


def test_a_data_file_carries_its_own_facts(tmp_path):
    f = _direct(tmp_path / "a")
    b = open_data_file(tmp_path / "b", create=True, direct=False)
    try:
        mem, off = dio_alignment(f.fd)
        assert f.facts == FileFacts(mem or DEFAULT_DIO_ALIGN_BYTES, off or DEFAULT_DIO_ALIGN_BYTES, False)
        assert b.facts == PAGE_CACHE and b.facts.buffered and not b.direct
        assert split_files(f) == (f.fd, f.facts) and split_files(b) == (b.fd, PAGE_CACHE)
        fds = np.array([f.fd, b.fd], np.int32)
        assert split_files(fds) == (fds, PAGE_CACHE)  # bare fds: nothing known of them
        # a batch over both kinds: the strictest alignment, and it has a page-cache file
        batch = IoBatch.of(Files(fds, f.facts.merge(b.facts)), [0, 0], [0, 0], [1, 1])
        assert batch.facts == dataclasses.replace(f.facts, buffered=True)
        part = batch.files(slice(1, 2))
        assert part.fds.tolist() == [b.fd] and part.facts == batch.facts  # a part keeps the facts
    finally:
        b.close()
        f.close()
    with pytest.raises(ValueError, match="closed"):
        split_files(f)


def test_merge_takes_the_strictest_alignment_and_buffered_if_any():
    a, b = FileFacts(512, 4096, False), FileFacts(4096, 512, False)
    assert a.merge(b) == FileFacts(4096, 4096, False)
    assert a.merge(PAGE_CACHE) == FileFacts(512, 4096, True)
    assert NO_FILES.merge(a) == a and a.merge(a) is a


async def test_two_data_files_on_one_fd_number_are_checked_against_their_own_facts(tmp_path):
    """The same fd number, handed as two DataFiles whose alignments differ: an op aligned for the
    one and not for the other is refused (the documented ValueError naming the op) only for the
    stricter one. A lookup by fd number would answer both the same way."""
    e = await open_uring_engine(16)
    f = _direct(tmp_path / "f")
    mem, off = f.facts.mem_align, f.facts.off_align
    big = 8 * max(mem, off)
    strict = dataclasses.replace(f, facts=FileFacts(big, big, False))
    assert strict.fd == f.fd
    with AlignedBuffer(4 * big) as buf:
        buf.array[:] = np.arange(len(buf.array)) % 251
        base = -(-buf.address // big) * big  # aligned for both
        # file offset `off` and address base + mem: aligned for f, not for its stricter twin
        assert (await e.write_many(f, [off], [base + mem], [off])).tolist() == [off]
        with pytest.raises(ValueError, match=r"op 0: fd \d+ is O_DIRECT"):
            await e.write_many(strict, [off], [base + mem], [off])
        # a batch's Files: checked per op, the first op that breaks the facts is named
        fds = np.full(2, f.fd, np.int32)
        offs, addrs, lens = [0, off], _u64([base, base + big]), [big, off]
        assert (await e.read_many(Files(fds, f.facts), offs, addrs, lens)).tolist() == [big, off]
        with pytest.raises(ValueError, match=r"op 1: "):
            await e.read_many(Files(fds, strict.facts), offs, addrs, lens)
        assert e.inflight == 0
    e.close()
    f.close()


def _u64(x):
    return np.asarray(x, dtype=np.uint64)


@pytest.mark.parametrize("backend", ["io_uring", "posix"])
async def test_a_recycled_fd_number_is_never_served_through_the_closed_file(tmp_path, backend):
    """An O_DIRECT DataFile closed, its number reused by a buffered one: the new file takes any
    offset and address (its own facts), and the stale DataFile is refused, never written through."""
    e = await open_engine(backend, queue_depth=16)
    a = _direct(tmp_path / "a")
    n = a.fd
    a.close()
    b = open_data_file(tmp_path / "b", create=True, size=MiB, direct=False)
    assert b.fd == n  # the lowest free number: the closed file's
    data = np.frombuffer(os.urandom(5000 + 3), np.uint8).copy()
    odd = data.ctypes.data + 3  # an address and an offset O_DIRECT would refuse
    assert (await e.write_many(b, [3], [odd], [5000])).tolist() == [5000]
    with AlignedBuffer(PAGE) as buf:
        buf.array[:] = 0xEE
        with pytest.raises(ValueError, match="closed"):
            await e.write_many(a, [0], [buf.address], [PAGE])
    assert os.pread(b.fd, 5003, 0) == b"\0" * 3 + data[3:].tobytes()  # b's bytes, nothing of a's write
    e.close()
    b.close()


# -- no table keyed by fd anywhere in the package ---------------------------------------------

_MUTABLE = {"dict", "set", "defaultdict", "OrderedDict", "WeakValueDictionary", "WeakKeyDictionary"}
_FD_KEY = re.compile(r"(^|[^a-z])(fds?|fileno)([^a-z]|$)", re.I)


def _fd_keyed_tables(source: str) -> list[str]:
    """``name[key]`` writes and ``name.setdefault/add/pop/get(key)`` calls on module-level mutable
    containers whose key expression names an fd: a process-wide table from fd numbers to facts."""
    tree = ast.parse(source)
    tables = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            v = node.value
            call = isinstance(v, ast.Call) and getattr(v.func, "id", getattr(v.func, "attr", None)) in _MUTABLE
            if isinstance(v, (ast.Dict, ast.Set, ast.DictComp, ast.SetComp)) or call:
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(t, ast.Name):
                        tables.add(t.id)
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in tables:
            key = node.slice
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
            and isinstance(node.func.value, ast.Name) and node.func.value.id in tables
            and node.func.attr in ("setdefault", "add", "pop", "get", "discard", "remove")
        ):  # fmt: skip
            key = node.args[0]
        if key is not None and _FD_KEY.search(ast.unparse(key)):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_the_checker_finds_a_process_global_fd_table():
    old = "_dio: dict[int, tuple] = {}\ndef close(self):\n    _dio.pop(self.fd, None)\ndef f(fd):\n    _dio[fd] = 1\n"
    assert len(_fd_keyed_tables(old)) == 2
    assert _fd_keyed_tables("_devs = set()\ndef f(st):\n    _devs.add(st.st_dev)\n") == []


def test_no_module_keeps_a_table_keyed_by_fd():
    root = pathlib.Path(__file__).resolve().parents[2] / "umbp_nvme"
    found = {
        str(p.relative_to(root)): hits
        for p in sorted(root.rglob("*.py"))
        if (hits := _fd_keyed_tables(p.read_text()))
    }
    assert found == {}
