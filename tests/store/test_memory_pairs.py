"""Batches of (address, nbytes) buffers resolve in one C pass (_uring.pairs_into) when they are
plain tuples of Python ints inside a registered range; anything else takes the checked path, which
gives the same answer or refuses it (never a wrong address or length)."""

from __future__ import annotations

import numpy as np
import pytest

from umbp_nvme._uring import pairs_into
from umbp_nvme.store import memory
from umbp_nvme.store.memory import Ranges

BASE, SPAN = 1 << 40, 1 << 24


def _ranges() -> Ranges:
    r = Ranges()
    r.add(BASE, SPAN)
    return r


def test_pairs_into_fills_both_arrays_from_tuples_of_ints():
    bufs = [(BASE + i * 4096, 4096 + i) for i in range(300)]
    a, n = np.full(300, -1, np.int64), np.full(300, -1, np.int64)
    assert pairs_into(bufs, a, n) is True
    assert a.tolist() == [b[0] for b in bufs] and n.tolist() == [b[1] for b in bufs]
    assert pairs_into(tuple(bufs), a, n) is True


@pytest.mark.parametrize("bad", [[(BASE, True)], [(BASE, 2, 3)], [(float(BASE), 2)], [(1 << 63, 2)], [[BASE, 2]],
                                 [(np.int64(BASE), 2)], iter([(BASE, 2)]), [(BASE, 2), "x"]])  # fmt: skip
def test_pairs_into_answers_false_for_anything_but_plain_int_pairs(bad):
    k = 2 if isinstance(bad, list) and len(bad) == 2 else 1
    assert pairs_into(bad, np.zeros(k, np.int64), np.zeros(k, np.int64)) is False


def test_pairs_into_refuses_output_arrays_of_the_wrong_shape_or_type():
    bufs = [(BASE, 1)] * 4
    with pytest.raises(ValueError, match="one entry per buffer"):
        pairs_into(bufs, np.zeros(3, np.int64), np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="format"):
        pairs_into(bufs, np.zeros(4, np.uint32), np.zeros(4, np.int64))
    with pytest.raises(TypeError, match="writable"):
        ro = np.zeros(4, np.int64)
        ro.flags.writeable = False
        pairs_into(bufs, ro, np.zeros(4, np.int64))


@pytest.mark.parametrize("native", [True, False])
def test_resolve_pairs_same_answer_with_and_without_the_c_pass(monkeypatch, native):
    if not native:
        monkeypatch.setattr(memory, "_pairs_into", None)
    r = _ranges()
    bufs = [(BASE + i * 8192, 8192) for i in range(256)]
    addr, nb = r.resolve_pairs(bufs)
    assert addr.dtype == np.uint64 and addr.tolist() == [b[0] for b in bufs] and nb.tolist() == [8192] * 256
    # numpy ints take the checked path and resolve the same
    addr2, nb2 = r.resolve_pairs([(np.int64(a), np.int64(n)) for a, n in bufs])
    assert addr2.tolist() == addr.tolist() and nb2.tolist() == nb.tolist()
    # outside the range, a bool length, a negative address, a float: no fast answer
    assert r.resolve_pairs(bufs + [(BASE + SPAN - 4096, 8192)]) is None
    assert r.resolve_pairs([(BASE, True)]) is None
    assert r.resolve_pairs([(-BASE, 4096)]) is None
    assert r.resolve_pairs([(float(BASE), 4096)]) is None
    assert r.resolve_pairs([(BASE, 4096, 1)]) is None
