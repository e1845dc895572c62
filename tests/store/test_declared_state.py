"""A PageStore's state is declared in one place (store/state.py): the instance holds ``state``
and ``writer`` and nothing else, whatever calls ran; the holders take no undeclared field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import KiB, payload, small_config
from umbp_nvme.store import PageStore
from umbp_nvme.store.state import OpenFacts, StoreState, WriterState

DECLARED = {"state", "writer"}


def assert_declared(st) -> None:
    assert set(vars(st)) == DECLARED, f"attributes outside store/state.py: {sorted(set(vars(st)) - DECLARED)}"
    assert type(st.state) is StoreState
    for holder in (st.state, st.writer):
        assert not hasattr(holder, "__dict__")  # slots: a field not declared cannot be set


async def test_a_writer_and_a_reader_hold_only_the_declared_state_through_every_call(store_dir):
    cfg = small_config(admission_policy="second")  # admit_gate makes its policy on the writer
    w = await PageStore.open(store_dir, cfg)
    assert_declared(w)
    assert w.writer is not None and not w.readonly
    n = 64 * KiB
    keys = [f"k{i:04d}" for i in range(400)]  # 25 MiB through a 16 MiB store: evictions
    for lo in range(0, len(keys), 40):
        ks = keys[lo : lo + 40]
        assert all(await w.put_many(ks, [payload(k, n) for k in ks]))
        assert all(await w.put_many(ks, [payload(k, n) for k in ks]))  # the second write is admitted
    assert w.stats()["evictions"] > 0
    live = [k for k in keys if w.exists_many_nowait([k])[0]]
    assert live
    out = [np.zeros(n, np.uint8) for _ in live[:8]]
    assert await w.get_many(live[:8], out) == [True] * len(out)
    assert all(bytes(o) == bytes(payload(k, n)) for k, o in zip(live[:8], out))
    mem = np.zeros(4 * n, np.uint8)
    w.register_memory(mem.ctypes.data, mem.nbytes)
    pairs = [(mem.ctypes.data + i * n, n) for i in range(4)]
    assert await w.get_many(live[:4], pairs) == [True] * 4
    assert await w.delete_many(live[:2]) == [True, True]
    await w.flush()
    w.stats()
    assert_declared(w)

    r = await PageStore.open(store_dir, cfg, readonly=True)
    assert_declared(r)
    assert r.writer is None and r.readonly
    assert await r.exists_many(live[2:4]) == [True, True]
    out = [np.zeros(n, np.uint8) for _ in range(2)]
    assert await r.get_many(live[2:4], out) == [True, True]
    assert bytes(out[0]) == bytes(payload(live[2], n))
    r.stats()
    await r.close()
    assert_declared(r)

    await w.clear()
    await w.close()
    assert_declared(w)
    assert await w.get_many(live[2:3], [np.zeros(n, np.uint8)]) == [False]  # after close
    assert_declared(w)


async def test_an_attribute_set_outside_the_declared_state_is_caught(store_dir):
    st = await PageStore.open(store_dir, small_config())
    try:
        with pytest.raises(AttributeError):
            st.writer.not_declared = 1  # slots
        with pytest.raises(AttributeError):
            st.state.not_declared = 1
        st._ad_hoc = 1  # what a mixin would do: the check sees it
        with pytest.raises(AssertionError, match="_ad_hoc"):
            assert_declared(st)
        del st._ad_hoc
    finally:
        await st.close()


def test_every_field_is_declared_with_a_default():
    # the open steps fill the holders in one step at a time; a field without a default would
    # force a half-opened store to invent one elsewhere
    for cls in (StoreState, WriterState, OpenFacts):
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, (cls, f.name)


def test_no_method_of_the_store_sets_an_attribute_of_its_own_but_the_declared_two():
    # the runtime check above sees the paths it runs; this one reads every method of every class
    # PageStore is made of (a GPU or fault path sets nothing undeclared either)
    import ast
    import inspect

    found = []
    for cls in PageStore.__mro__:
        if cls is object:
            continue
        tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
        for node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__):
            for n in ast.walk(node):
                if (isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del))
                        and isinstance(n.value, ast.Name) and n.value.id == "self" and n.attr not in DECLARED):  # fmt: skip
                    found.append(f"{cls.__name__}.{n.attr} (line {n.lineno})")
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("setattr", "delattr") \
                        and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "self":  # fmt: skip
                    found.append(f"{cls.__name__}: {n.func.id} (line {n.lineno})")
            for n in node.body:  # class-level state shared by every instance (a property is not state)
                is_property = isinstance(n.value, ast.Call) and getattr(n.value.func, "id", None) == "property" \
                    if isinstance(n, ast.Assign) else False  # fmt: skip
                if isinstance(n, (ast.Assign, ast.AnnAssign)) and not is_property:
                    found.append(f"{cls.__name__}: class attribute at line {n.lineno}")
    assert found == [], found
