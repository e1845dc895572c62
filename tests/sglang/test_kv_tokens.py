"""Tokens after a restart (issue 27): the token log beside the store (kv_tokens.py), and a
restarted relay-mode backend re-announcing its DISK pages with the tokens and parents the engine
gave before the restart, parents first."""

from __future__ import annotations

import hashlib
import os

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
    t.drop([recs[1][0], recs[3][0]])
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
    assert t.get(recs[0][0]) is None and t.stats["token_log_errors"] == 1
    assert t.get(recs[1][0]) == (recs[1][2], recs[1][1])


def test_the_log_is_bounded_in_pages_and_rewritten_once_mostly_dead(tmp_path, monkeypatch):
    import umbp_nvme.sglang.kv_tokens as kt

    monkeypatch.setattr(kt, "COMPACT_SLACK_BYTES", 0)
    path = tmp_path / FILE_NAME
    t = opened(path, max_pages=10)
    recs = chain(pages(12, "b"))
    t.keep(recs)
    assert len(t) == 10 and t.stats["token_pages_not_kept"] == 2
    t.drop([h for h, _, _ in recs[:8]])  # 2 live of 10 written: rewritten
    assert os.path.getsize(path) == t.live_bytes
    assert [t.get(h) is not None for h, _, _ in recs[8:10]] == [True, True]
    t.keep(recs[10:])  # appends land after the rewritten records
    t.close()
    t = opened(path)
    assert sorted(t.hashes()) == sorted(h for h, _, _ in recs[8:])


def test_retain_forgets_pages_the_store_no_longer_holds(tmp_path):
    recs = chain(pages(4, "r"))
    t = opened(tmp_path / FILE_NAME)
    t.keep(recs)
    t.retain({recs[0][0], recs[2][0]})
    assert [t.get(h) is not None for h, _, _ in recs] == [True, False, True, False]


def test_an_unwritable_log_keeps_nothing_and_raises_nothing(tmp_path):
    os.mkdir(tmp_path / FILE_NAME)  # a directory where the file should be
    t = opened(tmp_path / FILE_NAME)
    t.keep(chain(pages(2, "x")))
    t.drop([1, 2])
    assert len(t) == 0 and t.stats["token_log_errors"] == 1


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
        assert be.publisher.tokens.log.stats["token_pages_kept"] == 3
    finally:
        be.close()
