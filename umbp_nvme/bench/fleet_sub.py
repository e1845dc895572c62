"""A KV-event subscriber that tallies one node's DISK blocks, as a router's indexer does.

It follows sglang's protocol the way Dynamo's indexer does: a SUB socket on the node's endpoint;
on the first frame, and whenever a sequence number skips, it asks the replay socket for
everything from the next expected number (a DEALER sends ``["", seq8]``, gets
``["", topic, seq8, payload]...`` and an end marker). Restarted publishers continue above their
old sequence, so a restart is a gap and the replay brings the re-announcement.
"""

from __future__ import annotations

import time
from typing import Optional

END = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_MS = 10_000


class DiskTally:
    def __init__(self, ctx, endpoint: str, replay_endpoint: str, topic: bytes = b""):
        import msgspec
        import zmq

        self._zmq = zmq
        self.ctx = ctx
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self._dec = msgspec.msgpack.Decoder()
        self.blocks: set[int] = set()  # event hashes of DISK blocks announced and not removed
        self.last_seq: Optional[int] = None
        self.stats = {"frames": 0, "replays": 0, "replayed_frames": 0, "stored": 0, "removed": 0, "cleared": 0,
                      "unfilled_gaps": 0}  # fmt: skip

    def pump(self, until_seq: Optional[int] = None, timeout_s: float = 10.0) -> bool:
        """Take frames for up to ``timeout_s``, or until ``until_seq`` has been applied (True)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if until_seq is not None and self.last_seq is not None and self.last_seq >= until_seq:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return until_seq is None
            if not self.sock.poll(int(min(left, 0.1) * 1000) + 1):
                continue
            _topic, seq8, payload = self.sock.recv_multipart()
            self.stats["frames"] += 1
            seq = int.from_bytes(seq8, "big")
            if self.last_seq is not None and seq <= self.last_seq:
                continue  # already had it through a replay
            if self.last_seq is None or seq != self.last_seq + 1:
                self._replay(0 if self.last_seq is None else self.last_seq + 1)
                if self.last_seq is not None and seq <= self.last_seq:
                    continue
                if self.last_seq is not None and seq != self.last_seq + 1:
                    self.stats["unfilled_gaps"] += 1  # the replay did not reach it: what was missed stays missed
            self._apply(seq, payload)

    def _replay(self, start: int) -> None:
        zmq = self._zmq
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        s.connect(self.replay_endpoint)
        self.stats["replays"] += 1
        try:
            s.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                _, _topic, seq8, payload = s.recv_multipart()
                if seq8 == END:
                    return
                seq = int.from_bytes(seq8, "big")
                if self.last_seq is None or seq > self.last_seq:
                    self.stats["replayed_frames"] += 1
                    self._apply(seq, payload)
        except zmq.Again:
            pass  # no answer: the live stream goes on, the next gap asks again
        finally:
            s.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        batch = self._dec.decode(payload)
        for e in batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else ():
            kind = e.get("type")
            if kind == "AllBlocksCleared":
                self.blocks.clear()
                self.stats["cleared"] += 1
            elif e.get("medium") != "DISK":
                continue
            elif kind == "BlockStored":
                self.blocks.update(e["block_hashes"])
                self.stats["stored"] += len(e["block_hashes"])
            elif kind == "BlockRemoved":
                self.blocks.difference_update(e["block_hashes"])
                self.stats["removed"] += len(e["block_hashes"])

    def close(self) -> None:
        self.sock.close(linger=0)
