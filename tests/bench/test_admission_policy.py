"""The admission policy (umbp_nvme/store/admission.py): exact decisions for fixed rules, and the
adaptive choice following the miniature that hits most."""

from __future__ import annotations

import hashlib

import numpy as np

from umbp_nvme.store.admission import Admission, page_ids, size_class


def ids(*ns: int) -> np.ndarray:
    return np.asarray(ns, np.uint64)


def test_second_rule_admits_a_page_the_second_time_it_is_offered():
    a = Admission(100)
    a.fix("second")
    assert a.offer(ids(1, 2, 3)).tolist() == [False, False, False]
    assert a.offer(ids(2, 4)).tolist() == [True, False]
    assert a.offer(ids(1, 3, 4, 5)).tolist() == [True, True, True, False]
    assert a.declined == 5


def test_all_rule_admits_everything_and_a_cold_adaptive_policy_starts_there():
    a = Admission(100)
    assert a.rule == "all"
    assert a.offer(ids(1, 2, 3)).all() and a.offer(ids(1, 2, 3)).all() and a.declined == 0


def _run(a: Admission, store: dict, cap: int, pages: list[int]) -> None:
    """One request against an LRU 'store' of ``cap`` pages: present pages are used, the rest offered."""
    present = [p for p in pages if p in store]
    for p in present:
        store.pop(p)
        store[p] = None
    if present:
        a.used(ids(*present))
    new = [p for p in pages if p not in store]
    if new:
        for p, ok in zip(new, a.offer(ids(*new)).tolist()):
            if ok:
                store[p] = None
                if len(store) > cap:
                    del store[next(iter(store))]


def test_adaptive_switches_to_second_write_when_one_shot_pages_flush_a_reused_set():
    # 48 hot pages asked for every round beside 64 pages never seen again, in a 64-page store:
    # admitting everything, the one-shots push the hot set out before it comes back (no hits);
    # admitting on the second write keeps it. The miniatures see it and the policy switches.
    cap = 64
    a = Admission(cap, sample_shift=0)
    store: dict[int, None] = {}
    hot = list(range(1, 49))
    fresh = 1000
    for _ in range(40):
        _run(a, store, cap, list(range(fresh, fresh + 64)))
        fresh += 64
        _run(a, store, cap, hot)
    assert a.rule == "second"
    assert a.offer(ids(10**9)).tolist() == [False]  # a page never offered before
    assert a.offer(ids(10**9)).tolist() == [True]  # its second offer
    assert sum(p in store for p in hot) == len(hot)


def test_adaptive_does_not_switch_on_a_few_hits():
    # the same shape with a hot set of 4 pages: admitting on the second write would hit 4 pages a
    # round where admitting everything hits none, but 4 hits a window (8 with the decay) is a
    # burst or two of one request, not evidence: a cold store stays a cold LRU
    cap = 64
    a = Admission(cap, sample_shift=0)
    store: dict[int, None] = {}
    fresh = 1000
    for _ in range(40):
        _run(a, store, cap, list(range(fresh, fresh + 64)))
        fresh += 64
        _run(a, store, cap, [1, 2, 3, 4])
    assert a.rule == "all" and a.switches == 0 and a.declined == 0


def test_adaptive_keeps_admitting_everything_when_first_offers_come_back_soon():
    # every round asks for 8 new pages and the 8 of the round before, in a 64-page store:
    # admitting everything, each page hits once; on the second write it would never hit
    cap = 64
    a = Admission(cap, sample_shift=0)
    store: dict[int, None] = {}
    for r in range(1, 400):
        _run(a, store, cap, list(range(8 * r, 8 * r + 8)) + list(range(8 * (r - 1), 8 * r)))
    assert a.rule == "all" and a.switches == 0 and a.declined == 0


def test_size_class_is_log2_of_the_batch_pages():
    assert [size_class(n) for n in (1, 2, 3, 4, 127, 128, 10**6)] == [0, 1, 1, 2, 6, 7, 8]


def test_page_ids_parse_the_hash_in_front_and_share_it_between_components():
    h = hashlib.sha256(b"p").hexdigest()
    got = page_ids([h + "_0_k", h + "_0_v", h, "not-hex-key", "é" * 20])
    assert got[0] == got[1] == got[2] == int(h[:16], 16)
    assert got[3] == int.from_bytes(hashlib.blake2b(b"not-hex-key", digest_size=8).digest(), "little")
    assert got[4] == int.from_bytes(hashlib.blake2b(("é" * 20).encode(), digest_size=8).digest(), "little")
