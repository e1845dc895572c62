"""The replay socket faces the network (issue 34, item 5): a request is ~10 bytes, so a bigger
message disconnects its peer before it is read; malformed requests are counted and logged at
most once a minute; a whole replay still arrives, even one longer than ZMQ's default queue."""

from __future__ import annotations

import logging

import zmq
from zmq.utils.monitor import recv_monitor_message

from test_kv_events_reannounce import Dealer, pages, publisher


def test_an_oversized_replay_request_disconnects_its_peer_unread(tmp_path):
    pub = publisher(tmp_path, None)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    mon.setsockopt(zmq.RCVTIMEO, 60_000)
    good = Dealer(f"ipc://{tmp_path}/replay")
    try:
        s.connect(f"ipc://{tmp_path}/replay")
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_CONNECTED
        s.send_multipart((b"", b"\0" * (4 << 20)))  # a 4 MiB "sequence number"
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED  # the publisher hung up
        pub.offer("removed", pages(1, "after"))
        assert pub.flush(60)
        good.ask(0)
        assert good.answer() == 1  # others are served as before
        assert pub.stats["replays"] == 1
    finally:
        mon.close(linger=0)
        s.close(linger=0)
        ctx.term()
        good.close()
        pub.close()


def test_malformed_replay_requests_are_counted_and_logged_once(tmp_path, caplog):
    pub = publisher(tmp_path, None)
    dealer = Dealer(f"ipc://{tmp_path}/replay")
    try:
        pub.offer("removed", pages(1, "m"))
        assert pub.flush(60)
        with caplog.at_level(logging.WARNING, logger="umbp_nvme.sglang.kv_events"):
            for i in range(20):
                dealer.sock.send_multipart((b"", b"x" * (i % 7)))  # not an 8-byte sequence number
                dealer.sock.send_multipart((b"", (0).to_bytes(8, "big"), b"extra"))  # one frame too many
            dealer.ask(0)
            assert dealer.answer() == 1  # in order: every bad one was handled before this answer
        warned = [r for r in caplog.records if "replay request" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        assert pub.stats["bad_replay_requests"] == 40 and pub.stats["replays"] == 1
    finally:
        dealer.close()
        pub.close()
