"""The re-announcement runs to its end once (issue 34, item 6), and ``Publisher.flush()`` answers
True only once it has gone out (issue 34, extra finding). A Publisher of its own, its snapshot a
test callable, real ZMQ sockets."""

from __future__ import annotations

import hashlib
import threading

import zmq

from umbp_nvme.sglang.kv_events import BATCH_PAGES_MAX, END_SEQ, EventsConfig, Publisher


def pages(n: int, salt: str) -> list[str]:
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def publisher(tmp_path, snapshot, **kw) -> Publisher:
    cfg = EventsConfig(endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/replay", **kw)
    return Publisher(cfg, 16, snapshot=snapshot, prefer_sglang=False)


class Dealer:
    """A replay client (as Dynamo's indexer): one request, every frame until the end marker."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, 60_000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, start_seq: int) -> None:
        self.sock.send_multipart((b"", start_seq.to_bytes(8, "big")))

    def answer(self) -> int:
        n = 0
        while True:
            _, _, seq, _ = self.sock.recv_multipart()
            if seq == END_SEQ:
                return n
            n += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def test_replays_arriving_while_the_re_announcement_runs_never_restart_it(tmp_path):
    """Replays from before the buffer while the re-announcement runs (what steady subscribers of
    the previous run do): the snapshot is taken once and every page is announced once. Each chunk
    waits in the encoder until the test lets it go; one request is outstanding at a time."""
    held = pages(10 * BATCH_PAGES_MAX + 10, "held")
    chunks = -(-len(held) // BATCH_PAGES_MAX)
    snaps: list[int] = []
    go = threading.Event()

    def snapshot():
        go.wait(60)
        snaps.append(len(held))
        return [(p, None, None) for p in held]

    pub = publisher(tmp_path, snapshot)
    dealer = Dealer(f"ipc://{tmp_path}/replay")
    chunk, resume, stepping = threading.Semaphore(0), threading.Semaphore(0), [True]
    events = pub.encoder.events

    def stepped(items):
        if stepping[0] and any(kind == "stored" for kind, _ in items):
            chunk.release()
            resume.acquire(timeout=60)
        return events(items)

    pub.encoder.events = stepped
    served_between, outstanding, answered = 0, False, 0
    try:
        go.set()
        for k in range(chunks):
            assert chunk.acquire(timeout=60)  # chunk k waits; the ones before it are sent
            if outstanding and dealer.sock.poll(0):
                assert dealer.answer() >= 1  # served whole from the buffer
                outstanding, answered = False, answered + 1
                served_between += 1  # ...between two chunks: the re-announcement was running
            if not outstanding:
                dealer.ask(0)  # a subscriber of the previous run: its start is older than the buffer
                outstanding = True
            resume.release()
        stepping[0] = False
        resume.release()
        if outstanding:
            assert dealer.answer() >= 1
            answered += 1
        assert pub.flush(60)
        assert served_between >= 1  # the case this test is about did happen
        assert snaps == [len(held)]  # one snapshot
        assert pub.stats["reannounced_pages"] == len(held)  # each page once
        assert pub.stats["replays"] == answered
    finally:
        stepping[0] = False
        resume.release()
        dealer.close()
        pub.close()


def test_flush_waits_while_the_re_announcement_snapshot_is_being_taken(tmp_path):
    held = pages(3, "snap")
    inside, release = threading.Event(), threading.Event()

    def snapshot():
        inside.set()
        release.wait(60)
        return [(p, None, None) for p in held]

    pub = publisher(tmp_path, snapshot)
    try:
        assert inside.wait(60)
        assert pub.flush(0.5) is False  # the snapshot is still being taken: nothing sent yet
        release.set()
        assert pub.flush(60)
        assert pub.stats["reannounced_pages"] == 3
    finally:
        release.set()
        pub.close()


def test_flush_waits_for_the_last_chunk_of_the_re_announcement(tmp_path):
    """The last chunk leaves the pending pages before it is encoded and sent: flush waits for the send."""
    held = pages(5, "last")
    go, inside, gate = threading.Event(), threading.Event(), threading.Event()

    def snapshot():
        go.wait(60)
        return [(p, None, None) for p in held]

    pub = publisher(tmp_path, snapshot)
    events = pub.encoder.events

    def held_back(items):
        inside.set()
        gate.wait(60)
        return events(items)

    pub.encoder.events = held_back
    try:
        go.set()
        assert inside.wait(60)  # the only chunk is being encoded
        assert pub.flush(0.5) is False
        gate.set()
        assert pub.flush(60) and pub.stats["reannounced_pages"] == 5
    finally:
        go.set()
        gate.set()
        pub.close()
