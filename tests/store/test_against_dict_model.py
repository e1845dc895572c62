"""Property test: put/get/delete/evict/reopen against a dict model."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import KiB, MiB, payload, small_config
from umbp_nvme.store.sync import SyncPageStore

KEYS = st.sampled_from([f"k{i}" for i in range(24)])
SIZES = st.sampled_from([4096, 5000, 64 * KiB, 200 * KiB])


class StoreModel(RuleBasedStateMachine):
    """The store holds a subset of what the model says (eviction may drop entries, and only then),
    and every entry it holds has exactly the model's bytes."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="umbp-model-")
        self.cfg = small_config(ssd_capacity_bytes=2 * MiB, ssd_segment_size_bytes=512 * KiB)
        self.store = SyncPageStore(self.dir, self.cfg)
        self.model: dict[str, bytes] = {}
        self.evictions = 0

    def _sync_evictions(self):
        ev = self.store.stats()["evictions"]
        if ev != self.evictions:  # evicted keys leave the model; nothing else may
            self.evictions = ev
            present = self.store.exists_many(list(self.model))
            self.model = {k: v for (k, v), p in zip(self.model.items(), present) if p}

    @rule(keys=st.lists(KEYS, min_size=1, max_size=6), size=SIZES)
    def put(self, keys, size):
        data = [payload(k + str(size), size) for k in keys]
        res = self.store.put_many(keys, data)
        assert all(res)
        for k, d in zip(keys, data):
            self.model.setdefault(k, bytes(d))  # a re-put keeps the first bytes
        self._sync_evictions()

    @rule(keys=st.lists(KEYS, min_size=1, max_size=8))
    def get(self, keys):
        outs = [np.zeros(200 * KiB, np.uint8) for _ in keys]
        res = self.store.get_many(keys, outs)
        for k, o, ok in zip(keys, outs, res):
            assert ok == (k in self.model), k
            if ok:
                assert bytes(o[: len(self.model[k])]) == self.model[k]

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def delete(self, keys):
        res = self.store.delete_many(keys)
        expect = {k for k in keys if k in self.model}
        assert {k for k, ok in zip(keys, res) if ok} == expect
        for k in expect:
            del self.model[k]

    @rule()
    def reopen(self):
        self.store.close()
        self.store = SyncPageStore(self.dir, self.cfg)
        self.evictions = 0  # stats count per open

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def clear(self):
        self.store.clear()
        self.model.clear()

    @invariant()
    def same_keys(self):
        keys = [f"k{i}" for i in range(24)]
        assert self.store.exists_many(keys) == [k in self.model for k in keys]
        assert self.store.stats()["bytes_used"] <= self.cfg.ssd_capacity_bytes

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreModel.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None, database=None,
    suppress_health_check=list(HealthCheck),
)
test_store_model = StoreModel.TestCase
