"""Tokens after a restart (issue 27): the token log beside the store (kv_tokens.py), and a
restarted relay-mode backend re-announcing its DISK pages with the tokens and parents the engine
gave before the restart, parents first."""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import msgspec
import pytest

from support.kv_sub import Sub, stored
from support.standin_pools import PAGE
from umbp_nvme.sglang.kv_events import hash_str_to_int64 as H
from umbp_nvme.sglang.kv_relay import parents_first
from umbp_nvme.sglang.kv_tokens import FILE_NAME, TokenLog


def pages(n, salt):
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def opened(path, **kw):
    t = TokenLog(str(path), **kw)
    t.open()
    return t


def chain(keys, first_token=0):
    """(hash, parent hash, tokens) of a chain of pages, every page's tokens its own."""
    out, parent = [], None
    for i, k in enumerate(keys):
        out.append((H(k), parent, [first_token + PAGE * i + t for t in range(PAGE)]))
        parent = H(k)
    return out


def test_kept_pages_come_back_after_a_reopen_and_dropped_ones_do_not(tmp_path):
    path = tmp_path / FILE_NAME
    recs = chain(pages(5, "a"), 1000)
    t = opened(path)
    t.keep(recs)
    t.forget([recs[1][0], recs[3][0]])
    t.close()
    t = opened(path)
    assert len(t) == 3
    for h, parent, toks in recs:
        want = None if h in (recs[1][0], recs[3][0]) else (toks, parent)
        assert t.get(h) == want
    t.close()


def test_a_torn_tail_is_cut_and_the_records_before_it_stand(tmp_path):
    path = tmp_path / FILE_NAME
    recs = chain(pages(4, "t"))
    t = opened(path)
    t.keep(recs[:3])
    t.close()
    whole = os.path.getsize(path)
    t = opened(path)
    t.keep(recs[3:])
    t.close()
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)  # the last record torn
    t = opened(path)
    assert [t.get(h) is not None for h, _, _ in recs] == [True, True, True, False]
    assert os.path.getsize(path) == whole  # cut at the last sound record: appends go on from there
    t.keep(recs[3:])
    t.close()
    assert opened(path).get(recs[3][0]) == (recs[3][2], recs[3][1])


def test_a_damaged_record_ends_the_log_there(tmp_path):
    path = tmp_path / FILE_NAME
    recs = chain(pages(3, "d"))
    t = opened(path)
    for r in recs:
        t.keep([r])
    first_end = t.record_at(recs[1][0])[0]
    t.close()
    with open(path, "r+b") as f:
        f.seek(first_end + 12)
        f.write(b"\xff\xff")
    t = opened(path)
    assert [t.get(h) is not None for h, _, _ in recs] == [True, False, False]


def test_a_record_damaged_after_the_open_costs_only_its_page(tmp_path):
    path = tmp_path / FILE_NAME
    recs = chain(pages(2, "late"))
    t = opened(path)
    t.keep(recs)
    off = t.record_at(recs[0][0])[0]
    with open(path, "r+b") as f:
        f.seek(off + 10)
        f.write(b"\x00\x00\x00")
    assert t.get(recs[0][0]) is None and t.stats["record_errors"] == 1
    assert t.get(recs[1][0]) == (recs[1][2], recs[1][1])


def test_the_log_keeps_the_latest_pages_up_to_its_bound(tmp_path):
    recs = chain(pages(12, "b"))
    t = opened(tmp_path / FILE_NAME, max_pages=10)
    t.keep(recs)
    assert sorted(t.hashes()) == sorted(h for h, _, _ in recs[2:])
    t.reconcile({h for h, _, _ in recs[2:]})  # a rewrite drops the oldest two, counted
    assert t.stats["not_recorded_pages"] == 2
    t.close()
    t = opened(tmp_path / FILE_NAME, max_pages=10)
    assert sorted(t.hashes()) == sorted(h for h, _, _ in recs[2:])
    assert [t.get(h) for h, _, _ in recs[2:]] == [(toks, parent) for _, parent, toks in recs[2:]]


def test_the_log_is_rewritten_once_it_doubled_since_it_was_last_folded(tmp_path, monkeypatch):
    """Pages stored and removed over and over: the log stays within twice its live records."""
    import umbp_nvme.sglang.kv_tokens as kt

    monkeypatch.setattr(kt, "COMPACT_SLACK_BYTES", 0)
    path = tmp_path / FILE_NAME
    live, churn = chain(pages(10, "live")), chain(pages(10, "churn"))
    t = opened(path)
    t.keep(live)
    t.forget([h for h, _, _ in churn])  # never told stored: nothing to remember
    assert sorted(t.hashes()) == sorted(h for h, _, _ in live) and t.removed_hashes() == []
    folded = os.path.getsize(path)
    sizes = []
    for _ in range(20):
        t.keep(churn)
        t.forget([h for h, _, _ in churn])
        sizes.append(os.path.getsize(path))
    assert sum(b < a for a, b in zip(sizes, sizes[1:])) >= 2  # rewritten on the way...
    assert max(sizes) < 4 * folded  # ...so it never runs away
    t.close()
    t = opened(path)
    assert sorted(t.hashes()) == sorted(h for h, _, _ in live)
    assert sorted(t.removed_hashes()) == sorted(h for h, _, _ in churn)
    assert [t.get(h) for h, _, _ in live] == [(toks, parent) for _, parent, toks in live]
    assert [t.get(h) for h, _, _ in churn] == [None] * 10


def test_tokens_recorded_by_the_append_that_triggers_a_rewrite_stay_readable(tmp_path, monkeypatch):
    """A rewrite moves every record: the index must hold the new offsets of the pages the
    triggering append recorded, not the offsets they had before it."""
    import umbp_nvme.sglang.kv_tokens as kt

    monkeypatch.setattr(kt, "COMPACT_SLACK_BYTES", 0)
    t = opened(tmp_path / FILE_NAME)
    recs = chain(pages(40, "moved"))
    for i in range(0, len(recs), 2):  # keep two, forget one: dead records, and rewrites that move the rest
        t.keep([recs[i]])
        t.keep([recs[i + 1]])
        t.forget([recs[i][0]])
        live = recs[1 : i + 2 : 2]
        assert [t.get(h) for h, _, _ in live] == [(toks, parent) for _, parent, toks in live], i
    assert t.stats["record_errors"] == 0


def test_a_record_of_the_wrong_shape_ends_the_log_there(tmp_path):
    recs = chain(pages(2, "shape"))
    t = opened(tmp_path / FILE_NAME)
    t.keep(recs[:1])
    t.close()
    body = msgspec.msgpack.encode([0, "not a hash", None, [1]])  # a sound CRC, a wrong type
    with open(tmp_path / FILE_NAME, "ab") as f:
        f.write(struct.pack("<II", len(body), zlib.crc32(body)) + body)
    t = opened(tmp_path / FILE_NAME)
    assert t.hashes() == [recs[0][0]]
    t.keep(recs[1:])
    t.close()
    assert sorted(opened(tmp_path / FILE_NAME).hashes()) == sorted(h for h, _, _ in recs)


def test_pages_told_removed_are_remembered_up_to_a_bound_oldest_forgotten_first(tmp_path):
    recs = chain(pages(6, "gone"))
    t = opened(tmp_path / FILE_NAME, gone_max=4)
    t.keep(recs)
    t.forget([h for h, _, _ in recs])
    assert t.removed_hashes() == [h for h, _, _ in recs[2:]] and len(t) == 0
    t.keep(recs[3:4])  # told stored again: no longer told removed
    assert t.removed_hashes() == [recs[2][0], recs[4][0], recs[5][0]] and t.hashes() == [recs[3][0]]
    t.close()
    t = opened(tmp_path / FILE_NAME, gone_max=4)
    assert t.removed_hashes() == [recs[2][0], recs[4][0], recs[5][0]] and t.hashes() == [recs[3][0]]


def test_pages_told_stored_without_tokens_are_recorded_and_take_tokens_later(tmp_path):
    """Without the relay a page is recorded by its hash alone; told stored again with tokens
    (relay mode turned on), it gets its tokens record."""
    recs = chain(pages(3, "plain"))
    t = opened(tmp_path / FILE_NAME)
    t.keep([(h, p, None) for h, p, _ in recs])
    assert sorted(t.hashes()) == sorted(h for h, _, _ in recs) and t.get(recs[0][0]) is None
    t.keep(recs[:1])
    assert t.get(recs[0][0]) == (recs[0][2], recs[0][1]) and t.get(recs[1][0]) is None
    t.close()
    t = opened(tmp_path / FILE_NAME)
    assert len(t) == 3 and t.get(recs[0][0]) == (recs[0][2], recs[0][1])


def test_every_drive_keeps_a_copy_and_a_reopen_merges_what_any_copy_knows(tmp_path):
    """The same bytes go to each copy; one copy lost (or never there) loses nothing, and copies
    that disagree (one missed a run) are merged: any page either knows, tokens from either."""
    a, b = str(tmp_path / "a.log"), str(tmp_path / "b.log")
    recs = chain(pages(6, "copies"))
    t = TokenLog([a, b])
    t.open()
    t.keep(recs[:4])
    t.forget([recs[3][0]])
    t.close()
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()
    os.unlink(a)  # the first drive is gone: its copy with it
    t = TokenLog([b])
    t.open()
    assert sorted(t.hashes()) == sorted(h for h, _, _ in recs[:3]) and t.removed_hashes() == [recs[3][0]]
    t.keep(recs[4:5])  # a run on drive b alone
    t.close()
    t = TokenLog([a, b])  # drive a is back, empty
    t.open()
    t.keep([(recs[5][0], None, None)])
    t.close()
    t = TokenLog([b, a])
    t.open()
    assert sorted(t.hashes()) == sorted(h for h, _, _ in recs[:3] + recs[4:])
    assert [t.get(h) for h, _, _ in recs[:3]] == [(toks, parent) for _, parent, toks in recs[:3]]
    assert t.get(recs[5][0]) is None and t.removed_hashes() == [recs[3][0]]
    t.close()
    with open(a, "rb") as fa, open(b, "rb") as fb:
        assert fa.read() == fb.read()


def test_forgetting_more_pages_than_one_record_holds_loses_nothing_at_the_next_load(tmp_path):
    """120,000 hashes forgotten at once (~1.1 MB of msgpack) are split into records under the
    1 MiB record limit: the next load applies them all, and reads the records after them."""
    path = tmp_path / FILE_NAME
    n, gone = 130_000, 120_000
    recs = [(-(1 << 62) - i, None, [i % 1000]) for i in range(n)]  # int64 hashes: 9 bytes each in msgpack
    t = opened(path)
    t.keep(recs)
    t.forget([h for h, _, _ in recs[:gone]])
    later = (1 << 62, recs[-1][0], [7, 8, 9])
    t.keep([later])
    t.close()
    t = opened(path)
    assert len(t) == n - gone + 1
    assert t.get(recs[0][0]) is None and t.get(recs[gone - 1][0]) is None
    assert t.get(recs[gone][0]) == ([gone % 1000], None)
    assert t.get(later[0]) == ([7, 8, 9], recs[-1][0])
    t.close()


def test_reconcile_turns_pages_not_held_into_told_removed_and_lists_the_pages_to_remove(tmp_path):
    recs = chain(pages(5, "r"))
    t = opened(tmp_path / FILE_NAME)
    t.keep(recs)
    t.forget([recs[4][0]])  # told removed before
    other = chain(pages(1, "r-other"))[0][0]  # held, never told stored (its event was dropped)
    held = {recs[0][0], recs[2][0], recs[4][0], other}  # recs[4] came back meanwhile
    assert sorted(t.reconcile(held, told_removed=False)) == sorted([recs[1][0], recs[3][0]])
    assert [t.get(h) is not None for h, _, _ in recs] == [True, False, True, False, False]
    assert sorted(t.removed_hashes()) == sorted([recs[1][0], recs[3][0]])
    assert sorted(t.hashes()) == sorted(held)  # the re-announcement tells them all
    t.forget([recs[0][0]])
    assert sorted(t.reconcile(held - {recs[0][0]})) == sorted([recs[1][0], recs[3][0], recs[0][0]])


def test_an_unwritable_log_keeps_nothing_and_raises_nothing(tmp_path):
    os.mkdir(tmp_path / FILE_NAME)  # a directory where the file should be
    t = opened(tmp_path / FILE_NAME)
    t.keep(chain(pages(2, "x")))
    t.forget([1, 2])
    assert len(t) == 0 and t.stats["record_errors"] == 1


def test_parents_come_first_and_each_chain_stays_contiguous():
    a, b = pages(3, "ca"), pages(2, "cb")
    items = [(a[2], a[1], [3]), (b[1], b[0], [5]), (a[0], None, [1]), (a[1], a[0], [2]), (b[0], "f" * 64, [4])]
    assert [p for p, _, _ in parents_first(items)] == [a[0], a[1], a[2], b[0], b[1]]


# ------------------------------------------------------------------------- through the backend


def test_a_restarted_relay_backend_re_announces_its_pages_with_the_tokens_and_parents_of_before(tmp_path):
    """The engine announced the pages' tokens in the first run only; after the restart the relay's
    cache is empty, and the log gives the re-announcement its tokens (what Dynamo needs), parents
    first. A page deleted before the restart is neither held nor announced."""
    W = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    from test_kv_events import keys_of, open_backend, put, replay

    engine_ep = f"ipc://{tmp_path}/engine"
    engine = W.ZmqEventPublisher(attn_dp_rank=0, endpoint=engine_ep)
    keys = keys_of(4, "restart")
    toks = [[7000 + 10 * i + t for t in range(PAGE)] for i in range(4)]
    be = open_backend(tmp_path, kv_events_engine_endpoint=engine_ep)
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()
        sub.sync_engine(lambda p: engine.publish(W.KVEventBatch(
            ts=0.0, events=[W.BlockRemoved(block_hashes=[H(p)], medium="GPU")])))  # fmt: skip
        engine.publish(W.KVEventBatch(ts=0.0, events=[W.BlockStored(
            block_hashes=[H(k) for k in keys], parent_block_hash=None, token_ids=sum(toks, []),
            block_size=PAGE, lora_id=None, medium="GPU")]))  # fmt: skip
        while not [e for e in stored(sub.upto_now()) if e["medium"] == "GPU"]:
            pass
        assert put(be, keys) == [True] * 4
        assert be.publisher.flush(60)
        disk = [e for e in stored(sub.upto_now()) if e["medium"] == "DISK"]
        assert [t for e in disk for t in e["token_ids"]] == sum(toks, [])
        assert be.store.delete_many([keys[3] + be.v1_suffixes[0]]) == [True]
        sub.upto_now()
        last = int.from_bytes(sub.frames[-1][1], "big")
    finally:
        sub.close()
        be.close()
        engine.shutdown()
    assert os.path.exists(os.path.join(str(tmp_path / "s"), FILE_NAME))

    be = open_backend(tmp_path, kv_events_engine_endpoint=engine_ep)  # no engine now
    try:
        assert be.publisher.flush(60)
        dec = msgspec.msgpack.Decoder()
        events = [e for *_, p in replay(f"ipc://{tmp_path}/replay", last + 1) for e in dec.decode(p)[1]]
        disk = [e for e in events if e["type"] == "BlockStored" and e["medium"] == "DISK"]
        assert [h for e in disk for h in e["block_hashes"]] == [H(k) for k in keys[:3]]
        assert [t for e in disk for t in e["token_ids"]] == sum(toks[:3], [])
        assert disk[0]["parent_block_hash"] is None
        assert be.publisher.stats["skipped_no_tokens"] == 0
        assert be.publisher.record.stats["recorded_pages"] == 3
    finally:
        be.close()
