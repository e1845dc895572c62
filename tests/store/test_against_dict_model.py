"""Property test: put/get/delete/re-put/evict/clear/reopen/rebuild against a dict model.

Each put writes a new version of its key (support/versions.py: the bytes name key and version),
so a store serving an older version, or one a delete or clear removed, fails the byte check. A put
of a stored key is a dedup (the model keeps the first version); a re-put deletes first."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import KiB, MiB, small_config
from support.version_crash import ROUTES, rebuild_by
from support.versions import version_in, versioned
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
        self.version = 0
        self.evictions = 0

    def _new(self, keys, size):
        out = []
        for k in keys:
            self.version += 1
            out.append(versioned(k, self.version, size))
        return out

    def _sync_evictions(self):
        ev = self.store.stats()["evictions"]
        if ev != self.evictions:  # evicted keys leave the model; nothing else may
            self.evictions = ev
            present = self.store.exists_many(list(self.model))
            self.model = {k: v for (k, v), p in zip(self.model.items(), present) if p}

    @rule(keys=st.lists(KEYS, min_size=1, max_size=6), size=SIZES)
    def put(self, keys, size):
        data = self._new(keys, size)
        res = self.store.put_many(keys, data)
        assert all(res)
        for k, d in zip(keys, data):
            self.model.setdefault(k, bytes(d))  # a put of a stored key keeps the first bytes
        self._sync_evictions()

    @rule(keys=st.lists(KEYS, min_size=1, max_size=6, unique=True), size=SIZES)
    def reput(self, keys, size):
        """New bytes under keys that may be stored: delete, then put a new version."""
        self.store.delete_many(keys)
        for k in keys:
            self.model.pop(k, None)
        self.put(keys, size)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=8))
    def get(self, keys):
        outs = [np.zeros(200 * KiB, np.uint8) for _ in keys]
        res = self.store.get_many(keys, outs)
        for k, o, ok in zip(keys, outs, res):
            assert ok == (k in self.model), k
            if ok:
                want = self.model[k]
                got = o[: len(want)]
                assert bytes(got) == want, (k, "served version", version_in(k, got), "want", version_in(k, want))

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

    @rule(route=st.sampled_from(ROUTES))
    def rebuild(self, route):
        """Every rebuild route brings back exactly what was stored: no older version, nothing removed."""
        self.store.close()
        rebuild_by(route, self.dir, self.cfg.ssd_capacity_bytes)
        self.store = SyncPageStore(self.dir, self.cfg)
        self.evictions = 0

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
