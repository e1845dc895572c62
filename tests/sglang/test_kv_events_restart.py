"""A subscriber that lost frames catches up (issue 27): the idle heartbeat shows it the gap, and a
replay from before the buffer re-announces the store only when the buffer no longer holds a
complete re-announcement followed by every later batch."""

from __future__ import annotations

import msgspec
import zmq

from support.kv_sub import Sub
from test_kv_events import keys_of, open_backend, put, replay, sglang_hash


def test_an_idle_publisher_sends_empty_batches_that_continue_the_sequence(tmp_path):
    be = open_backend(tmp_path)
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()
        put(be, keys_of(2, "hb"))
        sub.upto_now()
        last = int.from_bytes(sub.frames[-1][1], "big")
        # nothing happens now; what arrives is the heartbeat (RCVTIMEO turns a hang into a failure)
        topic, seq, payload = sub.sock.recv_multipart()
        ts, events, dp = msgspec.msgpack.Decoder().decode(payload)
        assert events == [] and int.from_bytes(seq, "big") == last + 1
    finally:
        sub.close()
        be.close()


def test_a_subscriber_that_joins_after_every_event_still_learns_of_them(tmp_path):
    """PUB/SUB drops frames sent before a subscriber is connected (a router reconnecting to a
    restarted node): the heartbeat is the frame that shows it the gap, and the replay fills it."""
    keys = keys_of(3, "late")
    be = open_backend(tmp_path)
    try:
        put(be, keys)
        assert be.publisher.flush(60)
        ctx = zmq.Context()
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"")
        s.setsockopt(zmq.RCVTIMEO, 60_000)
        s.connect(f"ipc://{tmp_path}/ev")
        _, seq, _ = s.recv_multipart()  # the first frame it gets: nothing happened since the puts
        s.close(linger=0)
        ctx.term()
        frames = replay(f"ipc://{tmp_path}/replay", 0)
        assert int.from_bytes(seq, "big") > int.from_bytes(frames[0][1], "big")  # it sees it missed some
        dec = msgspec.msgpack.Decoder()
        got = [h for *_, p in frames for e in dec.decode(p)[1] if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert got == [sglang_hash(k) for k in keys]
    finally:
        be.close()


def reopened(tmp_path, keys, **extra):
    be = open_backend(tmp_path, **extra)
    put(be, keys)
    be.close()
    be = open_backend(tmp_path, **extra)
    assert be.publisher.flush(60)
    return be


def test_a_replay_from_before_the_buffer_is_served_by_the_buffered_re_announcement(tmp_path):
    keys = keys_of(5, "buf")
    be = reopened(tmp_path, keys)
    try:
        pub = be.publisher
        assert pub.stats["reannounced_pages"] == 5
        frames = replay(f"ipc://{tmp_path}/replay", 1)  # a subscriber of the previous run
        dec = msgspec.msgpack.Decoder()
        got = [h for *_, p in frames for e in dec.decode(p)[1] if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert sorted(got) == sorted(sglang_hash(k) for k in keys)
        assert pub.flush(60) and pub.stats["reannounced_pages"] == 5  # not announced a second time
    finally:
        be.close()


def test_a_replay_from_before_the_buffer_re_announces_once_the_re_announcement_left_it(tmp_path):
    keys = keys_of(5, "gone")
    be = reopened(tmp_path, keys, kv_events_buffer_steps=2)
    try:
        pub = be.publisher
        for i in range(3):  # three more batches push the re-announcement out of a 2-batch buffer
            put(be, keys_of(1, f"more{i}"))
            assert pub.flush(60)
        assert pub.oldest_seq > pub.full_from
        replay(f"ipc://{tmp_path}/replay", 1)
        assert pub.flush(60) and pub.stats["reannounced_pages"] == 5 + 8
    finally:
        be.close()
