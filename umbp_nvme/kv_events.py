"""DISK-tier KV events: what this store holds, published on SGLang's KV-event bus.

A router (Dynamo's KV router, llm-d's indexer, SGLang's router) learns where a prefix is cached
from ``BlockStored`` / ``BlockRemoved`` events. The scheduler publishes its GPU and CPU_PINNED
tiers; this module publishes the L3 tier, ``medium="DISK"``, in the same wire format:

- frames ``[topic, 8-byte big-endian sequence, msgpack(KVEventBatch)]`` on a ZMQ PUB socket, and
  an optional ROUTER replay socket (a DEALER sends ``["", seq8]`` and gets every buffered batch
  from that sequence on, then an end marker), exactly as sglang 0.5.23's ``ZmqEventPublisher``;
- the batch and event classes are sglang's own (``sglang.srt.disaggregation.kv_events``) when
  sglang imports, else msgspec structs of the same shape (a test checks the bytes are equal);
- a page's event hash is SGLang's ``hash_str_to_int64`` of its page key, its parent's the previous
  page key's (tests check it against the wheel's function).

Nothing here may slow or fail a ``batch_*`` call: the store's hooks (kv_residency.py) hand page
lists to a bounded queue (``offer``, a few microseconds, never blocking); a full queue drops the
item, counts it (``dropped``) and schedules a re-announcement of what the store holds. One daemon
thread drains the queue, coalesces items into batches, owns both sockets and serves replays.

Sequence numbers start at the wall clock in microseconds, so a restarted publisher continues above
its previous run: a subscriber (Dynamo's indexer) sees a gap, asks the replay socket, and gets the
re-announcement instead of ignoring a sequence that went back to 0 (docs/fleet.md).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

log = logging.getLogger(__name__)

MEDIUM_DISK = "DISK"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end marker (sglang's)
QUEUE_MAX_DEFAULT = 10_000  # items (one store call's pages each) waiting for the thread
BUFFER_STEPS_DEFAULT = 10_000  # batches kept for replay (sglang's default)
BATCH_PAGES_MAX = 4096  # pages in one published batch (live or re-announced)
TOKENS_GRACE_S = 1.0  # relay mode: how long a stored page waits for the engine's event with its tokens
_IDLE_POLL_S = 0.05

# extra_config keys this module reads (the backend pops them before load_config)
KEYS = (
    "kv_events_endpoint", "kv_events_topic", "kv_events_replay_endpoint", "kv_events_queue_max",
    "kv_events_buffer_steps", "kv_events_reannounce", "kv_events_engine_endpoint",
)  # fmt: skip


def hash_str_to_int64(page_key: str) -> int:
    """SGLang's event hash of a page key: its first 16 hex digits as a signed int64."""
    v = int(page_key[:16], 16)
    return v - (1 << 64) if v >= (1 << 63) else v


def offset_endpoint_port(endpoint: Optional[str], dp_rank: int) -> Optional[str]:
    """The endpoint of DP rank ``dp_rank``: sglang's rule (tcp: port + rank; inproc: ``_dp{rank}``)."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint and ":" in endpoint:
        i = endpoint.rfind(":")
        return f"{endpoint[:i]}:{int(endpoint[i + 1:]) + dp_rank}"
    return endpoint


def binds(endpoint: str) -> bool:
    """sglang's heuristic: wildcard hosts, ipc and inproc bind; a concrete host is connected to."""
    return any(h in endpoint for h in ("*", "::", "0.0.0.0")) or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True)
class EventsConfig:
    endpoint: str
    topic: str = ""
    replay_endpoint: Optional[str] = None
    dp_rank: int = 0
    queue_max: int = QUEUE_MAX_DEFAULT
    buffer_steps: int = BUFFER_STEPS_DEFAULT
    reannounce: bool = True  # announce what the store holds once it opens
    engine_endpoint: Optional[str] = None  # the scheduler's --kv-events-config endpoint (kv_relay.py)


def _endpoint(value: Any, key: str) -> Optional[str]:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"extra_config[{key!r}] must be a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH, "
                         f"inproc://NAME), got {value!r}")  # fmt: skip
    if value.startswith("tcp://"):
        port = value.rpartition(":")[2]
        if not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"extra_config[{key!r}] must end in a port 1..65535 (tcp://*:5600), got {value!r}")
    return value


def _positive(value: Any, key: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit() or int(value) < 1:
        raise ValueError(f"extra_config[{key!r}] must be a positive integer, got {value!r}")
    return int(value)


def pop_config(extra: dict, storage_config=None) -> Optional[EventsConfig]:
    """Remove this module's keys from ``extra``; the events config, or None when off (no endpoint).

    The DP rank offsets the ports as SGLang's publisher does: the attention-DP rank the storage
    config carries, else ``SGLANG_DP_RANK`` (pure DP: every replica has attention-DP rank 0).
    """
    from .config import parse_bool

    raw = {k: extra.pop(k) for k in KEYS if k in extra}
    endpoint = _endpoint(raw.get("kv_events_endpoint"), "kv_events_endpoint")
    if endpoint is None:
        return None
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as e:
        raise ValueError(f"extra_config['kv_events_endpoint'] is set, but publishing KV events needs pyzmq and "
                         f"msgspec ({e}): pip install 'umbp_nvme[kv_events]'") from e  # fmt: skip
    topic = raw.get("kv_events_topic") or ""
    if not isinstance(topic, str):
        raise ValueError(f"extra_config['kv_events_topic'] must be a string, got {topic!r}")
    dp = int(getattr(storage_config, "dp_rank", 0) or 0)
    if dp == 0 and os.environ.get("SGLANG_DP_RANK", "").strip().isdigit():
        dp = int(os.environ["SGLANG_DP_RANK"])
    return EventsConfig(
        endpoint=endpoint,
        topic=topic,
        replay_endpoint=_endpoint(raw.get("kv_events_replay_endpoint"), "kv_events_replay_endpoint"),
        dp_rank=dp,
        queue_max=_positive(raw.get("kv_events_queue_max"), "kv_events_queue_max", QUEUE_MAX_DEFAULT),
        buffer_steps=_positive(raw.get("kv_events_buffer_steps"), "kv_events_buffer_steps", BUFFER_STEPS_DEFAULT),
        reannounce=parse_bool(raw.get("kv_events_reannounce", True), "extra_config['kv_events_reannounce']"),
        engine_endpoint=_endpoint(raw.get("kv_events_engine_endpoint"), "kv_events_engine_endpoint"),
    )


# ------------------------------------------------------------------------------------- encoding


def event_types(prefer_sglang: bool = True):
    """(BlockStored, BlockRemoved, KVEventBatch, source): sglang's classes, else the same shapes."""
    if prefer_sglang:
        try:
            from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored, KVEventBatch

            return BlockStored, BlockRemoved, KVEventBatch, "sglang"
        except Exception as e:  # noqa: BLE001 - any failure inside sglang's import means "not usable"
            log.debug("sglang's KV event classes not importable (%r); using msgspec structs of the same shape", e)
    from ._kv_event_structs import BlockRemoved, BlockStored, KVEventBatch

    return BlockStored, BlockRemoved, KVEventBatch, "umbp_nvme"


class Encoder:
    """Page lists -> one msgpack ``KVEventBatch`` (sglang's bytes)."""

    def __init__(self, block_size: int, dp_rank: int, prefer_sglang: bool = True):
        import msgspec

        self.stored_cls, self.removed_cls, self.batch_cls, self.source = event_types(prefer_sglang)
        self._enc = msgspec.msgpack.Encoder()
        self.block_size = int(block_size)
        self.dp_rank = dp_rank

    def events(self, items) -> list:
        """``items``: ``("stored", [(page, parent page or its hash | None, token ids | None), ...])`` and
        ``("removed", [page, ...])``, in order. A run of stored pages that chain (each one's parent is
        the page before it) is one BlockStored, as the scheduler's recorder coalesces them."""
        out: list = []
        h = hash_str_to_int64
        for kind, pages in items:
            if kind == "removed":
                hashes = [h(p) for p in pages]
                tail = out[-1] if out else None
                if isinstance(tail, self.removed_cls):
                    tail.block_hashes.extend(hashes)
                elif hashes:
                    out.append(self.removed_cls(block_hashes=hashes, medium=MEDIUM_DISK))
                continue
            for page, parent, tokens in pages:
                bh = h(page)
                ph = parent if parent is None or isinstance(parent, int) else h(parent)
                tail = out[-1] if out else None
                toks = list(tokens) if tokens else []
                if (isinstance(tail, self.stored_cls) and ph is not None and tail.block_hashes
                        and tail.block_hashes[-1] == ph and bool(toks) == bool(tail.token_ids)):  # fmt: skip
                    tail.block_hashes.append(bh)
                    tail.token_ids.extend(toks)
                    continue
                out.append(self.stored_cls(block_hashes=[bh], parent_block_hash=ph, token_ids=toks,
                                           block_size=self.block_size, lora_id=None, medium=MEDIUM_DISK))  # fmt: skip
        return out

    def encode(self, events: list, ts: Optional[float] = None) -> bytes:
        batch = self.batch_cls(ts=time.time() if ts is None else ts, events=events, attn_dp_rank=self.dp_rank)
        return self._enc.encode(batch)


# ------------------------------------------------------------------------------------- publisher


class Publisher:
    """The queue, the sockets and the thread. ``offer`` is the only call on the data path.

    ``snapshot``: a callable returning the pages to re-announce (``[(page, parent, tokens), ...]``),
    run on this thread at start (``reannounce``), after drops, and when a replay asks for batches no
    longer buffered. ``relay``: an optional kv_relay.EngineRelay polled on this thread.
    """

    def __init__(self, cfg: EventsConfig, block_size: int, *, snapshot: Optional[Callable[[], list]] = None,
                 prefer_sglang: bool = True):  # fmt: skip
        import zmq

        self.cfg = cfg
        self.encoder = Encoder(block_size, cfg.dp_rank, prefer_sglang)
        self.endpoint = offset_endpoint_port(cfg.endpoint, cfg.dp_rank)
        self.replay_endpoint = offset_endpoint_port(cfg.replay_endpoint, cfg.dp_rank)
        self._topic = cfg.topic.encode()
        self._q: queue.Queue = queue.Queue(maxsize=cfg.queue_max)
        self._buffer: deque = deque(maxlen=cfg.buffer_steps)
        self._seq = itertools.count(time.time_ns() // 1000)
        self._snapshot = snapshot
        self._pending: deque = deque()  # re-announced pages still to send
        self._resync = bool(cfg.reannounce and snapshot is not None)
        self.relay = None  # kv_relay.EngineRelay: the engine's stream, forwarded, and its token ids
        self._waiting: deque = deque()  # relay mode: (deadline, page, parent) until its tokens are known
        self.stats = dict.fromkeys(("batches", "stored_pages", "removed_pages", "dropped", "dropped_pages",
                                    "replays", "reannounced_pages", "skipped_no_tokens", "errors"), 0)  # fmt: skip
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            if binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
            if cfg.engine_endpoint:
                from .kv_relay import EngineRelay

                self.relay = EngineRelay(self._ctx, offset_endpoint_port(cfg.engine_endpoint, cfg.dp_rank))
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="umbp-kv-events", daemon=True)
        self._thread.start()

    # --- the data path: never blocks, never raises

    def offer(self, kind: str, pages: list) -> bool:
        """Queue ``("stored" | "removed", pages)``; False (counted, resync scheduled) when full."""
        if not pages:
            return True
        try:
            for i in range(0, len(pages), BATCH_PAGES_MAX):  # a clear() of a big store: many batches
                part = pages[i : i + BATCH_PAGES_MAX] if len(pages) > BATCH_PAGES_MAX else pages
                try:
                    self._q.put_nowait((kind, part))
                except queue.Full:
                    self.stats["dropped"] += 1
                    self.stats["dropped_pages"] += len(part)
                    self._resync = True
                    return False
            return True
        except Exception:  # noqa: BLE001
            self.stats["errors"] += 1
            return False

    # --- the thread

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if self._replay is not None and dict(poller.poll(0)).get(self._replay):
                    self._serve_replay()
                if self.relay is not None:
                    for payload in self.relay.poll():
                        self._send_payload(payload)
                    self._send(self.encoder.events(self._ripe()))
                items = self._take()
                if items and self.relay is not None:
                    items = self._with_tokens(items)
                if items:
                    self._send(self.encoder.events(items))
                elif self._resync and self._q.empty():
                    self._start_reannounce()
                elif self._pending:
                    chunk = [self._pending.popleft() for _ in range(min(BATCH_PAGES_MAX, len(self._pending)))]
                    self.stats["reannounced_pages"] += len(chunk)
                    items = [("stored", chunk)]
                    self._send(self.encoder.events(self._with_tokens(items, wait=False) if self.relay else items))
            except Exception as e:  # noqa: BLE001 - the thread outlives any one bad batch
                self.stats["errors"] += 1
                log.error("umbp_nvme: KV event publisher: %r", e, exc_info=self.stats["errors"] == 1)
                time.sleep(_IDLE_POLL_S)

    def _take(self) -> list:
        # relay mode: the engine's socket is polled once per turn, so turns are short
        wait = 0 if (self._pending or self._resync) else (_IDLE_POLL_S if self.relay is None else 0.005)
        try:
            first = self._q.get(timeout=wait) if wait else self._q.get_nowait()
        except queue.Empty:
            return []
        items, pages = [first], len(first[1])
        while pages < BATCH_PAGES_MAX:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                break
            items.append(it)
            pages += len(it[1])
        for kind, p in items:
            self.stats["stored_pages" if kind == "stored" else "removed_pages"] += len(p)
        return items

    def _with_tokens(self, items: list, wait: bool = True) -> list:
        """Relay mode: stored pages with the engine's tokens; the others wait (or are skipped)."""
        out, now = [], time.monotonic()
        for kind, pages in items:
            if kind == "removed":
                if self._waiting:  # never announce a page after its removal
                    gone = set(pages)
                    self._waiting = deque(w for w in self._waiting if w[1] not in gone)
                out.append((kind, pages))
                continue
            ready = []
            for page, parent, _ in pages:
                got = self.relay.lookup(hash_str_to_int64(page))
                if got is not None:
                    ready.append((page, parent if parent is not None else got[1], got[0]))
                elif wait:
                    self._waiting.append((now + TOKENS_GRACE_S, page, parent))
                else:
                    self.stats["skipped_no_tokens"] += 1
            if ready:
                out.append(("stored", ready))
        return out

    def _ripe(self) -> list:
        """Waiting pages whose tokens arrived; those past their grace are skipped (counted)."""
        if not self._waiting:
            return []
        now, ready, keep = time.monotonic(), [], deque()
        for deadline, page, parent in self._waiting:
            got = self.relay.lookup(hash_str_to_int64(page))
            if got is not None:
                ready.append((page, parent if parent is not None else got[1], got[0]))
            elif now >= deadline:
                self.stats["skipped_no_tokens"] += 1
            else:
                keep.append((deadline, page, parent))
        self._waiting = keep
        return [("stored", ready)] if ready else []

    def _start_reannounce(self) -> None:
        self._resync = False
        if self._snapshot is None:
            return
        pages = self._snapshot()
        self._pending = deque(pages)
        log.info("umbp_nvme: announcing the %d pages the store holds (medium DISK) on %s", len(pages), self.endpoint)

    def _send(self, events: list) -> None:
        if events:
            self._send_payload(self.encoder.encode(events))

    def _send_payload(self, payload: bytes) -> None:
        seq = next(self._seq)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.stats["batches"] += 1

    def _serve_replay(self) -> None:
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            log.warning("umbp_nvme: KV event replay request with %d frames ignored", len(frame))
            return
        client, _, start = frame
        start_seq = int.from_bytes(start, "big")
        self.stats["replays"] += 1
        if self._buffer and start_seq < self._buffer[0][0] and self._snapshot is not None:
            self._resync = True  # batches it missed are gone from the buffer: announce the whole state
        for seq, buf in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), buf))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # --- lifecycle

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued (and re-announced) has been sent (tests, close)."""
        deadline = time.monotonic() + timeout_s
        while (not self._q.empty() or self._pending or self._resync or self._waiting) and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        if self._stop.is_set():
            return
        self.flush(timeout_s)
        self._stop.set()
        self._thread.join(timeout_s)
        if self.relay is not None:
            self.relay.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()
