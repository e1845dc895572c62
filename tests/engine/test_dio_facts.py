"""The O_DIRECT alignment the io_uring engine checks comes from Python (issue 11): every
O_DIRECT DataFile is recorded by fd while open; the ring no longer runs fcntl/statx per submit."""

from __future__ import annotations

import os

import numpy as np
import pytest

from umbp_nvme.engine.files import DEFAULT_DIO_ALIGN_BYTES, dio_alignment, dio_facts, open_data_file


def test_dio_facts_follow_open_and_close_of_data_files(tmp_path):
    f = open_data_file(tmp_path / "a", create=True, size=1 << 20)
    if not f.direct:
        f.close()
        pytest.skip("O_DIRECT unsupported here")
    mem, off = dio_alignment(f.fd)
    want = (mem or DEFAULT_DIO_ALIGN_BYTES, off or DEFAULT_DIO_ALIGN_BYTES)
    assert dio_facts(f.fd) == (*want, False)
    assert dio_facts(np.array([f.fd, f.fd], np.int32)) == (*want, False)
    buffered = open_data_file(tmp_path / "b", create=True, direct=False)
    raw = os.open(tmp_path / "c", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert dio_facts(buffered.fd) == (1, 1, True)
        assert dio_facts(raw) == (1, 1, True)  # not opened through open_data_file: a page-cache file
        # a batch over both kinds: the strictest alignment, and it has page-cache files
        assert dio_facts(np.array([f.fd, buffered.fd, f.fd], np.int32)) == (*want, True)
        assert dio_facts(np.zeros(0, np.int32)) == (1, 1, False)
        fd = f.fd
        f.close()
        assert dio_facts(fd) == (1, 1, True)  # forgotten before the number can be reused
    finally:
        buffered.close()
        os.close(raw)
