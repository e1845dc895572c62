"""The trace simulator (umbp_nvme/bench/trace_sim.py) on tiny traces whose hit counts are worked
out by hand in each test's comment, and the trace reader's errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from umbp_nvme.bench import trace_file, trace_sim
from support.traces import trace_of



# [0,1] [0,1] [2] [0,1], capacity 2:
#   LRU: r0 writes 0,1; r1 hits both; r2 writes 2 and evicts 0 (least recent); r3 misses 0 (so
#   1, though present, is no hit), rewrites 0 (evicting 1) and 1 (evicting 2). Hits 2, written 5.
#   Clairvoyant: 2 is never used again, so it is declined; r1 and r3 hit both. Hits 4, written 2.
SMALL = [[0, 1], [0, 1], [2], [0, 1]]


def test_lru_counts_prefix_hits_and_writes_exactly():
    r = trace_sim.simulate(trace_of(SMALL), trace_sim.LRU(2))
    assert (r.hit_blocks, r.total_blocks, r.written, r.declined) == (2, 7, 5, 0)


def test_clairvoyant_declines_a_block_never_used_again():
    t = trace_of(SMALL)
    r = trace_sim.simulate(t, trace_sim.Belady(2, trace_sim.next_use(t)))
    assert (r.hit_blocks, r.written, r.declined) == (4, 2, 1)


def test_clairvoyant_evicts_the_block_used_farthest_ahead():
    # [0] [1] [2] [1] [0] [2], capacity 2. r2: 2 (next at r5) meets 0 (r4) and 1 (r3): it is the
    # farthest, so it is declined; r3 hits 1, r4 hits 0; r5 misses 2 (never used again: declined).
    t = trace_of([[0], [1], [2], [1], [0], [2]])
    r = trace_sim.simulate(t, trace_sim.Belady(2, trace_sim.next_use(t)))
    assert (r.hit_blocks, r.written, r.declined) == (2, 2, 2)
    # LRU: r2 evicts 0, r3 hits 1, r4 evicts 2, r5 evicts 1: one hit
    assert trace_sim.simulate(t, trace_sim.LRU(2)).hit_blocks == 1


def test_next_use_points_at_the_next_request_holding_the_block():
    t = trace_of([[0, 1], [1], [0]])
    assert trace_sim.next_use(t).tolist() == [2, 1, trace_sim.NEVER, trace_sim.NEVER]


def test_a_present_block_after_a_miss_is_not_a_hit_and_is_refreshed_not_written():
    # [0,1] [9,1]: r1 misses 9, so 1 (present) is not a hit; only 9 is written
    r = trace_sim.simulate(trace_of([[0, 1], [9, 1]]), trace_sim.LRU(10))
    assert (r.hit_blocks, r.written) == (0, 3)


def test_host_tier_serves_its_prefix_before_the_store_is_asked():
    # l2 of 2 blocks: r1's [0,1] comes from the host tier; the store sees nothing of r1
    r = trace_sim.simulate(trace_of([[0, 1], [0, 1, 2]]), trace_sim.LRU(10), l2_blocks=2)
    assert (r.l2_hit_blocks, r.hit_blocks, r.written) == (2, 0, 3)


def test_token_weighted_hit_is_capped_by_the_input_length():
    # r1 hits both blocks but has only 700 input tokens: 700 hit tokens of 1,700 in all
    r = trace_sim.simulate(trace_of([[0, 1], [0, 1]], tokens=[1000, 700]), trace_sim.LRU(10))
    assert (r.hit_tokens, r.total_tokens) == (700, 1700)
    assert r.token_hit_rate == pytest.approx(700 / 1700)


def test_infinite_capacity_hits_every_repeat():
    assert trace_sim.infinite(trace_of(SMALL)).hit_blocks == 4


def test_admission_in_front_of_lru_sees_offers_hits_and_decides():
    class Second:  # admit a block the second time it is offered
        def __init__(self):
            self.seen, self.used_pages = set(), []

        def offer(self, pages):
            out = np.asarray([p in self.seen for p in pages.tolist()], bool)
            self.seen.update(pages.tolist())
            return out

        def used(self, pages):
            self.used_pages += pages.tolist()

        def evicted(self, pages):
            pass

    # [0] [0] [0]: r0 declines 0, r1 writes it (second offer), r2 hits it
    adm = Second()
    r = trace_sim.simulate(trace_of([[0], [0], [0]]), trace_sim.LRU(4, adm))
    assert (r.hit_blocks, r.written, r.declined) == (1, 1, 1)
    assert adm.used_pages == trace_sim.block_page_ids(np.asarray([0])).tolist()


def test_loader_maps_ids_densely_and_names_a_bad_line(tmp_path):
    good = tmp_path / "t.jsonl"
    trace_file.write([{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [40, 7]},
                      {"timestamp": 5, "input_length": 300, "output_length": 1, "hash_ids": [40]}], str(good))
    t = trace_file.load(str(good))
    assert [r.tolist() for r in t.reqs] == [[1, 0], [1]] and t.block_ids.tolist() == [7, 40]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_length": 1, "hash_ids": [1]}) + "\n" + json.dumps({"input_length": 1, "hash_ids": ["x"]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'hash_ids' must be a list of ints"):
        trace_file.load(str(bad))


def test_synthetic_trace_is_deterministic_and_multi_turn():
    a, b = trace_file.synthetic(300, seed=5), trace_file.synthetic(300, seed=5)
    assert a == b and a != trace_file.synthetic(300, seed=6)
    # a later turn of a session starts with an earlier request's blocks
    firsts = {tuple(r["hash_ids"][:2]) for r in a[:100]}
    assert any(tuple(r["hash_ids"][:2]) in firsts for r in a[100:])
