"""The replay socket: a ZMQ ROUTER that answers ``["", seq8]`` with every buffered batch from
``seq`` on, then an end marker (sglang 0.5.23's ``ZmqEventPublisher`` protocol).

It faces whatever can reach its address, so it takes nothing it does not need:

- a request is two frames of 0 and 8 bytes: ``ZMQ_MAXMSGSIZE`` makes ZMQ disconnect a peer that
  sends a bigger frame before reading it (a 32 MiB "request" costs nothing);
- each peer's queues are bounded (``ZMQ_RCVHWM`` requests in, ``ZMQ_SNDHWM`` one whole replay out:
  a peer that never reads holds at most one answer, whose payloads share the buffer's bytes);
- a malformed request is counted (``bad_replay_requests``) and logged at most once a minute;
- at most ``REPLAYS_PER_TURN`` requests are served per publisher turn: live events keep flowing.

Bind it to the address routers use (``tcp://127.0.0.1:5601`` when they run on the node), not
``*`` on a network others share (docs/fleet.md).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

log = logging.getLogger("umbp_nvme.sglang.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the end marker (sglang's)
REQUEST_MAX_BYTES = 64  # the largest frame a peer may send (a request's are 0 and 8 bytes)
REQUESTS_PER_PEER = 16  # requests queued per peer (ZMQ_RCVHWM)
REPLAYS_PER_TURN = 8
BAD_REQUEST_LOG_S = 60.0


def is_wildcard(endpoint: str) -> bool:
    return endpoint.startswith(("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:", "tcp://:::"))


class ReplaySocket:
    def __init__(self, ctx, endpoint: str, topic: bytes, buffer_steps: int, stats: dict):
        import zmq

        self._zmq = zmq
        self.endpoint, self._topic, self.stats = endpoint, topic, stats
        stats.setdefault("bad_replay_requests", 0)
        self.sock = ctx.socket(zmq.ROUTER)
        try:
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.MAXMSGSIZE, REQUEST_MAX_BYTES)
            self.sock.setsockopt(zmq.RCVHWM, REQUESTS_PER_PEER)
            self.sock.setsockopt(zmq.SNDHWM, buffer_steps + 2)  # one whole replay and its end marker
            self.sock.bind(endpoint)
        except Exception:
            self.sock.close(linger=0)
            raise
        if is_wildcard(endpoint):
            log.info("umbp_nvme: the KV event replay socket %s answers every interface; bind the address "
                     "routers use (tcp://127.0.0.1:PORT on the node; docs/fleet.md)", endpoint)  # fmt: skip
        self._logged_bad, self._log_after = 0, 0.0

    def serve(self, buffer, before_buffer: Callable[[int], None]) -> None:
        """Answer the requests waiting now (up to REPLAYS_PER_TURN) from ``buffer`` (``(seq,
        payload)``, oldest first); ``before_buffer(start)`` is told of a start older than it."""
        zmq = self._zmq
        for _ in range(REPLAYS_PER_TURN):
            try:
                frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frame) != 3 or len(frame[2]) != 8:
                self._bad(frame)
                continue
            client, start = frame[0], int.from_bytes(frame[2], "big")
            self.stats["replays"] += 1
            if buffer and start < buffer[0][0]:
                before_buffer(start)
            send = self.sock.send_multipart
            for seq, payload in buffer:
                if seq >= start:  # payloads of 64 KiB and more are sent from the buffer's own bytes
                    send((client, b"", self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            send((client, b"", b"", END_SEQ, b""))

    def _bad(self, frame: list) -> None:
        self.stats["bad_replay_requests"] += 1
        now = time.monotonic()
        if now < self._log_after:
            return
        n = self.stats["bad_replay_requests"] - self._logged_bad
        self._logged_bad, self._log_after = self.stats["bad_replay_requests"], now + BAD_REQUEST_LOG_S
        log.warning("umbp_nvme: %d KV event replay request(s) on %s ignored: not [\"\", 8-byte sequence] "
                    "(the last: %d frames of %s bytes); logged at most once a minute", n, self.endpoint,
                    len(frame) - 1, [len(f) for f in frame[1:4]])  # fmt: skip

    def close(self) -> None:
        self.sock.close(linger=0)
