"""Bad input (issue item 4): hypothesis drives the checkers of ``support.bad_input``; each returns
the findings for one input (an empty list = handled as documented: a ValueError naming key and
value, or per-page False). Guard zones of canary bytes around the host pool catch any write
outside registered memory. The same checkers with seeded inputs, the layout/namespace and legacy
raw-pointer checks and the hygiene checks (item 5) run in the chaos report, where
test_chaos_report.py asserts they find nothing.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.backends import make_backend
from support.bad_input import CONFIG_KEYS, WEIRD_KEYS, HostilePool, check_config_value, check_indices, check_keys, check_meta
from support.host_pool import HostPool, page_key

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 80), max_value=1 << 80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=8),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1),
    st.sampled_from(["true", "off", " 1 ", "posix", "IO_URING ", "strict", "async", "lru", "0x10", "1e9"]),
)


@FAST
@given(key=st.sampled_from(CONFIG_KEYS), value=values)
def test_extra_config_values_give_a_config_or_an_error_naming_them(key, value):
    assert check_config_value(key, value) == []


@contextmanager
def backend_on(tmp_path_factory, name: str, pool):
    """A backend on `pool` in a fresh store under a temp dir `name`; closes both after."""
    root = str(tmp_path_factory.mktemp(name))
    be = make_backend(os.path.join(root, "s"), pool)
    try:
        yield be, root
    finally:
        be.close()
        pool.close()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    pool = HostPool(page_num=32)
    with backend_on(tmp_path_factory, "keys", pool) as (be, root):
        yield be, pool, root


key_text = st.one_of(st.sampled_from(WEIRD_KEYS), st.text(max_size=80), st.text(alphabet="./\\\x00", max_size=12))


@FAST
@given(keys=st.lists(key_text, min_size=1, max_size=6))
def test_odd_keys_are_bools_exact_bytes_and_no_stray_files(keyed, keys):
    be, pool, root = keyed
    assert check_keys(be, pool, keys, root) == []


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    pool = HostPool(page_num=16)
    with backend_on(tmp_path_factory, "idx", pool) as (be, _root):
        yield be, pool


@st.composite
def index_tensors(draw):
    P, S = 16, 16 * 16
    n = draw(st.integers(0, 8)) * P + draw(st.sampled_from([0, 0, 1, P - 1]))
    start = draw(st.integers(-2 * S, 2 * S))
    kind = draw(st.sampled_from(["np64", "np32", "f32", "torch", "torch_f", "strided", "2d", "list", "huge"]))
    base = np.arange(start, start + n, dtype=np.int64)
    if kind == "np32":
        return base.astype(np.int32)
    if kind == "f32":
        return base.astype(np.float32)
    if kind == "torch":
        return torch.from_numpy(base)
    if kind == "torch_f":
        return torch.from_numpy(base).double()
    if kind == "strided":
        return torch.arange(start, start + 2 * n)[::2]
    if kind == "2d" and n % P == 0 and n:
        return base.reshape(-1, P)
    if kind == "list":
        return base.tolist()
    if kind == "huge":
        return np.full(n, draw(st.sampled_from([1 << 40, -(1 << 40), (1 << 63) - 1])), dtype=np.int64)
    return base


@FAST
@given(idx=index_tensors(), nkeys=st.integers(1, 4))
def test_bad_index_tensors_are_false_and_never_write_outside(indexed, idx, nkeys):
    be, pool = indexed
    assert check_indices(be, pool, [page_key(i, "ix") for i in range(nkeys)], idx) == []


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    pool = HostilePool(page_num=16)
    with backend_on(tmp_path_factory, "meta", pool) as (be, _root):
        yield be, pool


_counter = iter(range(10**9))


@FAST
@given(data=st.data())
def test_pointer_size_pairs_outside_registered_memory_are_refused(hostile, data):
    be, pool = hostile
    ob = pool.object_bytes
    offs = st.one_of(st.sampled_from([-pool.guard, -ob, -1, 0, 1, pool.nbytes - ob, pool.nbytes - ob + 1, pool.nbytes]),
                     st.integers(-pool.guard, pool.nbytes + pool.guard))
    n = data.draw(st.sampled_from([4, 4, 4, 3, 5]))
    ptrs = [pool.base + data.draw(offs) for _ in range(n)]
    sizes = [data.draw(st.sampled_from([ob, ob, 0, -ob, ob + 1, 1 << 40, pool.guard, 4096])) for _ in range(n)]
    c = next(_counter)
    fresh = [page_key(2 * c, "hf"), page_key(2 * c + 1, "hf")]
    assert check_meta(be, pool, [page_key(1, "h"), page_key(2, "h")], fresh, ptrs, sizes) == []
