"""KV events that converge (issue 34, item 4): after a dropped event, a gap older than the replay
buffer, or a restart that lost pages, a subscriber's DISK tally (every stored and removed event
applied in order) equals the pages the store holds: removals are repaired too, never only
"stored". Each test drives UMBPNvmeStore and reads what a real ZMQ subscriber receives."""

from __future__ import annotations

import json
import os
import threading

import pytest

from support.kv_sub import Sub, apply, decode
from support.standin_pools import PAGE
from test_kv_events import held, keys_of, open_backend, put, replay, sglang_hash


def holding(be, keys) -> set[int]:
    """The event hashes of the pages of ``keys`` the store holds whole (``batch_exists``)."""
    return {sglang_hash(k) for k, h in zip(keys, held(be, keys)) if h}


def delete_pages(be, keys) -> None:
    for k in keys:  # one call per page: one removal item each
        assert be.store.delete_many([k + s for s in be.v1_suffixes]) == [True] * len(be.v1_suffixes)


class Stuck:
    """Holds the publisher's thread inside its encoder until released: nothing leaves the queue."""

    def __init__(self, pub):
        self.pub, self.events = pub, pub.encoder.events
        self.inside, self.gate = threading.Event(), threading.Event()
        pub.encoder.events = self._held
        while not pub.offer("removed", ["f" * 64]):  # something for the thread to take: a page no store holds
            pub.flush(60)
        assert self.inside.wait(60)

    def _held(self, items):
        self.inside.set()
        self.gate.wait(60)
        return self.events(items)

    def release(self) -> None:
        self.pub.encoder.events = self.events
        self.gate.set()


def test_a_removal_dropped_by_a_full_queue_is_announced_removed_by_the_re_announcement(tmp_path):
    be = open_backend(tmp_path, kv_events_queue_max=1)
    pub = be.publisher
    sub = Sub(f"ipc://{tmp_path}/ev", pub)
    try:
        sub.sync()
        keys = keys_of(6, "drop")
        assert put(be, keys) == [True] * 6
        tally = apply(sub.upto_now(), set())
        assert tally == {sglang_hash(k) for k in keys}
        assert pub.flush(60)
        stuck = Stuck(pub)
        dropped = pub.stats["dropped_pages"]  # a put's two items may meet a full queue too
        delete_pages(be, keys[:3])  # the first removal fills the queue, the next two are dropped
        assert pub.stats["dropped_pages"] == dropped + 2
        stuck.release()
        assert pub.flush(60)
        apply(sub.upto_now(), tally)
        assert holding(be, keys) == {sglang_hash(k) for k in keys[3:]}
        assert tally == holding(be, keys)  # no phantom: the dropped removals were repaired
    finally:
        sub.close()
        be.close()


def test_a_subscriber_that_missed_removals_older_than_the_replay_buffer_converges(tmp_path):
    """It stops listening, pages are deleted, the 2-batch buffer turns over; back, it sees the gap,
    asks for a replay from before the buffer and gets a re-announcement that also removes."""
    be = open_backend(tmp_path, kv_events_buffer_steps=2)
    pub = be.publisher
    sub = Sub(f"ipc://{tmp_path}/ev", pub)
    keys = keys_of(6, "gap")
    try:
        sub.sync()
        assert put(be, keys) == [True] * 6
        tally = apply(sub.upto_now(), set())
        last = int.from_bytes(sub.frames[-1][1], "big")
    finally:
        sub.close()
    try:
        delete_pages(be, keys[:3])  # removals it never receives
        more = keys_of(3, "gap-more")
        for k in more:
            assert put(be, [k]) == [True]
            assert pub.flush(60)
        assert pub.oldest_seq > last + 1
        sub = Sub(f"ipc://{tmp_path}/ev", pub)
        sub.sync()
        apply(decode(replay(f"ipc://{tmp_path}/replay", last + 1)), tally)
        assert pub.flush(60)
        apply(sub.upto_now(), tally)
        want = holding(be, keys + more)
        assert want == {sglang_hash(k) for k in keys[3:] + more}
        assert tally == want
    finally:
        sub.close()
        be.close()


def two_drive_run(tmp_path, roots, keys, **extra):
    """A backend over ``roots`` stores ``keys``; closed. A subscriber's tally and last sequence."""
    be = open_backend(tmp_path, ssd_storage_dir=json.dumps(roots), **extra)
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()
        assert put(be, keys) == [True] * len(keys)
        tally = apply(sub.upto_now(), set())
        assert tally == {sglang_hash(k) for k in keys}
        return tally, int.from_bytes(sub.frames[-1][1], "big")
    finally:
        sub.close()
        be.close()


def catch_up(tmp_path, be, tally, last) -> set:
    """What a subscriber that saw ``last`` does on the restarted node's next frame: replay."""
    assert be.publisher.flush(60)
    return apply(decode(replay(f"ipc://{tmp_path}/replay", last + 1)), tally)


@pytest.mark.parametrize("lost", [0, 1])
def test_pages_on_a_root_removed_across_a_restart_are_announced_removed(tmp_path, lost):
    """Drive ``lost`` leaves ``ssd_storage_dir``; its pages are announced removed from the record
    of announced pages, which every drive keeps a copy of (so losing the first drive loses nothing)."""
    roots = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    keys = keys_of(16, "roots")
    tally, last = two_drive_run(tmp_path, roots, keys)
    be = open_backend(tmp_path, ssd_storage_dir=json.dumps([r for i, r in enumerate(roots) if i != lost]))
    try:
        want = holding(be, keys)
        assert 0 < len(want) < len(keys)  # both drives held some
        assert catch_up(tmp_path, be, tally, last) == want
    finally:
        be.close()


def test_pages_of_a_drive_that_no_longer_opens_are_announced_removed(tmp_path):
    """Drive 1's directory is gone and a file stands where its parent was: it fails to open
    (ENOTDIR) and is degraded at open, its pages gone."""
    roots = [str(tmp_path / "a" / "d0"), str(tmp_path / "b" / "d1")]
    keys = keys_of(16, "gone-drive")
    tally, last = two_drive_run(tmp_path, roots, keys)
    os.rename(tmp_path / "b", tmp_path / "b-unplugged")
    (tmp_path / "b").write_text("not a directory")
    be = open_backend(tmp_path, ssd_storage_dir=json.dumps(roots))
    try:
        assert be.store.store.stores[1] is None  # not open
        want = holding(be, keys)
        assert 0 < len(want) < len(keys)
        assert catch_up(tmp_path, be, tally, last) == want
    finally:
        be.close()


def test_pages_lost_with_a_relay_backends_drive_are_announced_removed(tmp_path):
    """Relay mode (tokens from the engine, kept in the record): the same repair."""
    W = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    engine_ep = f"ipc://{tmp_path}/engine"
    engine = W.ZmqEventPublisher(attn_dp_rank=0, endpoint=engine_ep)
    roots = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    keys = keys_of(12, "relay-roots")
    be = open_backend(tmp_path, ssd_storage_dir=json.dumps(roots), kv_events_engine_endpoint=engine_ep)
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()
        sub.sync_engine(lambda p: engine.publish(W.KVEventBatch(
            ts=0.0, events=[W.BlockRemoved(block_hashes=[sglang_hash(p)], medium="GPU")])))  # fmt: skip
        engine.publish(W.KVEventBatch(ts=0.0, events=[W.BlockStored(
            block_hashes=[sglang_hash(k) for k in keys], parent_block_hash=None,
            token_ids=list(range(len(keys) * PAGE)), block_size=PAGE, lora_id=None, medium="GPU")]))  # fmt: skip
        assert put(be, keys) == [True] * len(keys)
        assert be.publisher.flush(60)
        tally = apply(sub.upto_now(), set())
        assert tally == {sglang_hash(k) for k in keys}
        last = int.from_bytes(sub.frames[-1][1], "big")
    finally:
        sub.close()
        be.close()
        engine.shutdown()
    be = open_backend(tmp_path, ssd_storage_dir=json.dumps(roots[1:]), kv_events_engine_endpoint=engine_ep)
    try:
        want = holding(be, keys)
        assert 0 < len(want) < len(keys)
        assert catch_up(tmp_path, be, tally, last) == want
        assert be.publisher.stats["skipped_no_tokens"] == 0
    finally:
        be.close()
