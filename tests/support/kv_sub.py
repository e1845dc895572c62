"""A real ZMQ SUB socket on a KV-event publisher, for tests: frames decoded, markers to know "all so far".

A PUB socket drops what it sends before a subscriber's subscription arrives, so a test first
``sync``s: it offers a marker event (a BlockRemoved of a page no store holds) until one comes back.
``upto_now()`` then offers a fresh marker and returns every frame received before it: each frame
as ``(seq, ts, events, dp_rank)``, the markers' hashes taken out.
"""

from __future__ import annotations

import hashlib
import itertools

import msgspec
import zmq

from umbp_nvme.sglang.kv_events import hash_str_to_int64

RECV_TIMEOUT_MS = 60_000  # only to turn a hang into a failure


class Sub:
    def __init__(self, endpoint: str, publisher, topic: bytes = b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.sock.connect(endpoint)
        self.pub = publisher
        self.topic = topic
        self._marks = itertools.count()
        self.marker_hashes: set[int] = set()
        self.frames: list = []  # every frame received, raw: (topic, seq, payload)
        self._dec = msgspec.msgpack.Decoder()

    def _marker(self) -> int:
        page = hashlib.sha256(f"marker-{next(self._marks)}".encode()).hexdigest()
        while not self.pub.offer("removed", [page]):  # a full queue dropped it: offer it again once drained
            self.pub.flush(60)
        h = hash_str_to_int64(page)
        self.marker_hashes.add(h)
        return h

    def sync(self) -> None:
        while True:
            h = self._marker()
            if self.sock.poll(100):
                self._until(h)
                return

    def upto_now(self) -> list:
        return self._until(self._marker())

    def sync_engine(self, offer) -> None:
        """Wait until frames that ``offer(page)`` makes elsewhere (an engine upstream) reach us."""
        while True:
            page = hashlib.sha256(f"marker-{next(self._marks)}".encode()).hexdigest()
            h = hash_str_to_int64(page)
            self.marker_hashes.add(h)
            offer(page)
            if self.sock.poll(100):
                self._until(h)
                return

    def _until(self, h: int) -> list:
        out = []
        while True:
            frame = self.sock.recv_multipart()
            self.frames.append(frame)
            topic, seq, payload = frame
            assert topic == self.topic and len(seq) == 8
            ts, events, dp = self._dec.decode(payload)
            seen = any(h in e.get("block_hashes", ()) for e in events)
            kept = []
            for e in events:
                if e["type"] == "BlockRemoved":
                    e = dict(e, block_hashes=[x for x in e["block_hashes"] if x not in self.marker_hashes])
                    if not e["block_hashes"]:
                        continue
                kept.append(e)
            if kept:
                out.append((int.from_bytes(seq, "big"), ts, kept, dp))
            if seen:
                return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def stored(frames) -> list[dict]:
    return [e for _, _, evs, _ in frames for e in evs if e["type"] == "BlockStored"]


def stored_hashes(frames) -> list[int]:
    return [h for e in stored(frames) for h in e["block_hashes"]]


def removed_hashes(frames) -> list[int]:
    return [h for _, _, evs, _ in frames for e in evs if e["type"] == "BlockRemoved" for h in e["block_hashes"]]


def decode(raw) -> list:
    """Raw ``(topic, seq8, payload)`` frames (a replay's) as ``upto_now`` gives them."""
    dec = msgspec.msgpack.Decoder()
    out = []
    for _, seq, payload in raw:
        ts, events, dp = dec.decode(payload)
        out.append((int.from_bytes(seq, "big"), ts, events, dp))
    return out


def apply(frames, blocks: set) -> set:
    """A subscriber's DISK tally: ``blocks`` after the frames' stored and removed events, in order."""
    for _, _, evs, _ in frames:
        for e in evs:
            if e.get("medium") != "DISK":
                continue
            if e["type"] == "BlockStored":
                blocks.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                blocks.difference_update(e["block_hashes"])
    return blocks
