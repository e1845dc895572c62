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

Nothing here may slow or fail a ``batch_*`` call: the store's hooks (kv_residency.py) hand key
or page lists to a bounded queue (``offer``, about a microsecond per put, never blocking); a full
queue drops the item, counts it (``dropped``) and schedules a re-announcement. One daemon thread
drains the queue a tick at a time, works out the pages (the residency's ``resolve``), coalesces
them into batches, owns both sockets and serves replays (kv_replay.py).

Subscribers converge on what the store holds, removals included: before a batch goes out the
thread records what it tells (kv_tokens.py, a copy on every drive), and a re-announcement first
removes every page subscribers may believe held and the store does not (told stored and not held:
a dropped removal, a page lost across a restart; at open and for a replay from before the buffer
also the pages lately told removed, which such a subscriber may have missed), then announces what
the store holds. It runs to its end once: live events go out beside it (each turn sends the live
items, then one chunk, skipping the pages a live event told of since its snapshot), a replay is
served from the buffer meanwhile, and a re-announcement asked for meanwhile starts after it.

Sequence numbers start at the wall clock in microseconds, so a restarted publisher continues above
its previous run: a subscriber (Dynamo's indexer) sees a gap, asks the replay socket, and gets the
re-announcement instead of ignoring a sequence that went back to 0 (docs/fleet.md).

Relay mode (kv_relay.py), a new life of the worker: the first publisher of a stream in a process
(the scheduler started, crashed or restarted) first sends ``AllBlocksCleared``, then re-announces
DISK. The restarted scheduler's own start-up clear went out before our relay subscribed, and a
router that kept the worker registered would keep its earlier GPU/CPU blocks. A later publisher of
the same stream in the same process (``set_kv_events(True)`` after off) sends none: the engine
still holds its blocks, and a clear would make every one of them missing at the router.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .keys import hash_str_to_int64  # noqa: F401 - part of this module's interface (tests, bench)
from .kv_replay import END_SEQ  # noqa: F401 - part of this module's interface (tests, bench)

log = logging.getLogger(__name__)

MEDIUM_DISK = "DISK"
QUEUE_MAX_DEFAULT = 10_000  # items (one store call's pages each) waiting for the thread
BUFFER_STEPS_DEFAULT = 10_000  # batches kept for replay (sglang's default)
BATCH_PAGES_MAX = 4096  # pages in one published batch (live or re-announced)
_IDLE_POLL_S = 0.05  # after an error
TICK_S = 0.01  # the publisher thread's turn: items queued meanwhile go out together (the engine is polled as often)
IDLE_WAIT_S = 0.1  # idle, the thread wakes this often (replay requests, heartbeats)
# An idle publisher sends an empty batch this often: a subscriber that lost frames (PUB/SUB drops
# what is sent while it reconnects, e.g. to a restarted node) sees the gap within this long and
# asks the replay socket, instead of waiting for the node's next real event.
HEARTBEAT_S = 1.0

# extra_config keys this module reads (the backend pops them before load_config)
KEYS = (
    "kv_events_endpoint", "kv_events_topic", "kv_events_replay_endpoint", "kv_events_queue_max",
    "kv_events_buffer_steps", "kv_events_reannounce", "kv_events_engine_endpoint",
)  # fmt: skip


# (pid, our endpoint) of the relay streams started in this process: the first start is a new life
# of the worker (a clear first), a later one is not (a fork is a new process: the pid tells)
_STREAMS_STARTED: set[tuple[int, str]] = set()
_STREAMS_LOCK = threading.Lock()


def _first_start(endpoint: str) -> bool:
    key = (os.getpid(), endpoint)
    with _STREAMS_LOCK:
        first = key not in _STREAMS_STARTED
        _STREAMS_STARTED.add(key)
    return first


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
    from ..config import parse_bool

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


def event_types(prefer_sglang: bool = True):
    """(BlockStored, BlockRemoved, KVEventBatch, source): sglang's classes, else the same shapes
    (also when UMBP_NVME_NO_SGLANG=1 forces the backend's stand-in)."""
    if prefer_sglang and os.environ.get("UMBP_NVME_NO_SGLANG", "") not in ("1", "true", "yes"):
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
        """``items``: ``("stored", [(page or its hash, parent page or its hash | None, token ids | None),
        ...])`` and ``("removed", [page or its hash, ...])``, in order. A run of stored pages that
        chain (each one's parent is the page before it) is one BlockStored, as the scheduler's
        recorder coalesces them."""
        out: list = []
        h = hash_str_to_int64
        for kind, pages in items:
            if kind == "removed":
                hashes = [p if type(p) is int else h(p) for p in pages]
                tail = out[-1] if out else None
                if isinstance(tail, self.removed_cls):
                    tail.block_hashes.extend(hashes)
                elif hashes:
                    out.append(self.removed_cls(block_hashes=hashes, medium=MEDIUM_DISK))
                continue
            tail = out[-1] if out and isinstance(out[-1], self.stored_cls) else None
            prev_page = prev_hash = None
            for page, parent, tokens in pages:
                bh = page if type(page) is int else h(page)
                if parent is None or type(parent) is int:
                    ph = parent
                else:  # a chain's parent is the page just before it, whose hash is known
                    ph = prev_hash if parent is prev_page or parent == prev_page else h(parent)
                prev_page, prev_hash = page, bh
                if tail is not None and ph is not None and tail.block_hashes[-1] == ph and bool(tokens) == bool(tail.token_ids):
                    tail.block_hashes.append(bh)
                    if tokens:
                        tail.token_ids.extend(tokens)
                    continue
                tail = self.stored_cls(block_hashes=[bh], parent_block_hash=ph, token_ids=list(tokens) if tokens else [],
                                       block_size=self.block_size, lora_id=None, medium=MEDIUM_DISK)  # fmt: skip
                out.append(tail)
        return out

    def encode_clear(self) -> bytes:
        """A batch of one ``AllBlocksCleared``: a tagged map with no other field (sglang's bytes)."""
        return self.encode([{"type": "AllBlocksCleared"}])

    def encode(self, events: list, ts: Optional[float] = None) -> bytes:
        batch = self.batch_cls(ts=time.time() if ts is None else ts, events=events, attn_dp_rank=self.dp_rank)
        return self._enc.encode(batch)


# ------------------------------------------------------------------------------------- publisher


class Publisher:
    """The queue, the sockets and the thread. ``offer`` is the only call on the data path.

    ``snapshot``: a callable returning the pages to re-announce (``[(page, parent, tokens), ...]``),
    run on this thread at start (``reannounce``), after drops, and when a replay asks for batches no
    longer buffered. ``resolve``: kv_residency.Residency.resolve, run on this thread over every
    batch of queued items. ``record_paths``: where what subscribers were told is recorded (a copy
    of kv_tokens.TokenLog per drive; with the engine's tokens in relay mode): a re-announcement
    also removes every page told stored or lately removed that the store does not hold.
    ``record_sync_s``: 0 makes the record durable before each batch that tells pages stored (a
    strict store); else at most this often and at close (a relaxed store, whose acknowledged
    pages are not durable at once either: on ext4 a record fdatasync also writes back the
    store's dirty data, which would make relaxed puts wait for the disk).
    """

    def __init__(self, cfg: EventsConfig, block_size: int, *, snapshot: Optional[Callable[[], list]] = None,
                 resolve: Optional[Callable[[list], list]] = None, prefer_sglang: bool = True,
                 record_paths: Optional[list] = None, record_sync_s: float = 0.0):  # fmt: skip
        import zmq

        from .kv_tokens import TokenLog

        self.cfg = cfg
        self.encoder = Encoder(block_size, cfg.dp_rank, prefer_sglang)
        self.endpoint = offset_endpoint_port(cfg.endpoint, cfg.dp_rank)
        self.replay_endpoint = offset_endpoint_port(cfg.replay_endpoint, cfg.dp_rank)
        self._topic = cfg.topic.encode()
        self._q: queue.Queue = queue.Queue(maxsize=cfg.queue_max)
        self._buffer: deque = deque(maxlen=cfg.buffer_steps)
        self._next_seq = time.time_ns() // 1000
        # the first sequence number sent after the latest re-announcement's snapshot: a replay that
        # starts in the buffer at or before it gets the whole state (see _before_buffer)
        self._full_from: Optional[int] = None
        self._snapshot = snapshot
        self._resolve = resolve
        self._pending: deque = deque()  # re-announced pages still to send
        self._pending_removed: deque = deque()  # hashes the re-announcement removes, sent first
        self._superseded: set[int] = set()  # hashes a live event told of since the snapshot
        self._resync = bool(cfg.reannounce and snapshot is not None)
        # the next re-announcement also removes what subscribers were lately told removed: they may
        # have missed it (a restart; a replay from before the buffer), unlike after queue drops
        self._resync_full = self._resync
        # held by the thread while it works: flush() sees queue, pending and resync change together
        self._lock = threading.Lock()
        self.record = TokenLog(record_paths) if record_paths else None
        self._sync_every_s, self._synced_at = float(record_sync_s), time.monotonic()
        self._clear_first = False  # relay mode, a new life: send AllBlocksCleared before anything
        self._clear_seq: Optional[int] = None  # its sequence number, until the re-announcement starts
        self.relay = None  # kv_relay.EngineRelay: the engine's stream, forwarded, and its token ids
        self.tokens = None  # kv_relay.PageTokens: relay mode: the tokens of DISK pages
        self.stats = dict.fromkeys(("batches", "stored_pages", "removed_pages", "dropped", "dropped_pages",
                                    "replays", "bad_replay_requests", "reannounced_pages", "reannounced_removed",
                                    "skipped_no_tokens", "errors", "start_clears", "start_clears_skipped"), 0)  # fmt: skip
        self._stop = threading.Event()
        self._last_send = time.monotonic()
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
                from .kv_replay import ReplaySocket

                self._replay = ReplaySocket(self._ctx, self.replay_endpoint, self._topic, cfg.buffer_steps, self.stats)
            if cfg.engine_endpoint:
                from .kv_relay import EngineRelay, PageTokens

                self.relay = EngineRelay(self._ctx, offset_endpoint_port(cfg.engine_endpoint, cfg.dp_rank))
                self.tokens = PageTokens(self.relay, self.record, self.stats)
                # a new life of the worker: clear its tiers at routers first (module docstring)
                self._clear_first = _first_start(self.endpoint)
                if not self._clear_first:
                    self.stats["start_clears_skipped"] += 1
        except Exception:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="umbp-kv-events", daemon=True)
        self._thread.start()

    # --- the data path: never blocks, never raises

    def offer(self, kind: str, pages) -> bool:
        """Queue ``("stored" | "removed", pages)`` (or kv_residency's ``"shown"`` keys and ``"links"``);
        False (counted, resync scheduled) when full."""
        if not pages:
            return True
        try:
            if kind == "links" or len(pages) <= BATCH_PAGES_MAX:
                parts = (pages,)
            else:  # a clear() of a big store: many batches
                parts = [pages[i : i + BATCH_PAGES_MAX] for i in range(0, len(pages), BATCH_PAGES_MAX)]
            for part in parts:
                try:
                    self._q.put_nowait((kind, part))
                except queue.Full:
                    self.stats["dropped"] += 1
                    self.stats["dropped_pages"] += len(part) if kind != "links" else 0
                    self._resync = True
                    self._full_from = None  # what was dropped is in no buffered batch
                    return False
            return True
        except Exception:  # noqa: BLE001
            self.stats["errors"] += 1
            return False

    # --- the thread

    def _run(self) -> None:
        import zmq

        with self._lock:  # before the re-announcement, which reads it (and before flush answers)
            if self.record is not None:
                self.record.open()
            try:
                if self._clear_first:  # before any engine frame or DISK page of this life
                    self._send_start_clear()
            except Exception as e:  # noqa: BLE001 - counted; the events go on
                self.stats["errors"] += 1
                log.error("umbp_nvme: KV event publisher: the start clear failed: %r", e)
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay.sock, zmq.POLLIN)
        while not self._stop.is_set():
            taken = self._take()
            try:
                with self._lock:
                    try:
                        if self._replay is not None and poller.poll(0):
                            self._replay.serve(self._buffer, self._before_buffer)
                        if self.relay is not None:
                            for payload in self.relay.poll():
                                self._send_payload(payload)
                            if self.relay.cleared:  # after the clear went out: DISK is announced again
                                self.relay.cleared, self._resync = False, True
                            self._publish(self.tokens.ripe())
                        self._turn(taken)
                        if self._sync_every_s and time.monotonic() - self._synced_at >= self._sync_every_s:
                            self._sync_record()
                    finally:  # only now is a taken item done: flush() waits for it (Queue.unfinished_tasks)
                        for _ in taken:
                            self._q.task_done()
            except Exception as e:  # noqa: BLE001 - the thread outlives any one bad batch
                self.stats["errors"] += 1
                log.error("umbp_nvme: KV event publisher: %r", e, exc_info=self.stats["errors"] == 1)
                time.sleep(_IDLE_POLL_S)

    def _send_start_clear(self) -> None:
        """``AllBlocksCleared``, then a re-announcement of DISK (a router wipes DISK too)."""
        self._clear_first = False
        self._clear_seq = self._next_seq
        self._send_payload(self.encoder.encode_clear())
        self.stats["start_clears"] += 1
        self._resync = self._resync or self._snapshot is not None
        log.info("umbp_nvme: relay stream %s starts a new life of the worker: AllBlocksCleared sent first "
                 "(sequence %d)", self.endpoint, self._clear_seq)  # fmt: skip

    def _turn(self, taken: list) -> None:
        """The live items first, then one chunk of a running re-announcement: both make progress
        however busy the store is. A new re-announcement starts only once the last one is out."""
        items = self._resolve(taken) if taken and self._resolve is not None else taken
        for kind, p in items:
            self.stats["stored_pages" if kind == "stored" else "removed_pages"] += len(p)
        if items and (self._pending or self._pending_removed):
            self._supersede(items)
        if items and self.tokens is not None:
            items = self.tokens.attach(items)
        if items:
            self._publish(items)
        if self._pending_removed or self._pending:
            self._send_chunk()
        elif self._resync and self._q.empty():
            self._start_reannounce()
            self._send_chunk()
        elif not items and time.monotonic() - self._last_send >= HEARTBEAT_S:
            self._send_payload(self.encoder.encode([]))

    def _take(self) -> list:
        """The items queued by now (up to BATCH_PAGES_MAX pages). Idle, it waits for the first item
        (or IDLE_WAIT_S: replays and heartbeats), then one tick more: the items that follow come
        in the same turn, so the store's puts and this thread share the GIL in a few long turns,
        not one short turn (and two thread switches) per put. Relay mode polls every tick."""
        items, pages = [], 0
        if not (self._pending or self._pending_removed or self._resync):
            try:
                first = self._q.get(timeout=IDLE_WAIT_S if self.relay is None else TICK_S)
            except queue.Empty:
                return []
            items, pages = [first], len(first[1])
            self._stop.wait(TICK_S)
        while pages < BATCH_PAGES_MAX:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                break
            items.append(it)
            pages += len(it[1])
        return items

    def _start_reannounce(self) -> None:
        """What the store holds now, to announce stored, and what subscribers may believe it holds
        and it does not (the record's), to announce removed first."""
        full, self._resync, self._resync_full = self._resync_full, False, False
        if self._snapshot is None:
            return
        if full:  # before the snapshot: a drop meanwhile clears it again; after a start clear, from it
            self._full_from = self._next_seq if self._clear_seq is None else self._clear_seq
        self._clear_seq = None
        pages = self._snapshot()
        removed: list = []
        if self.record is not None:
            removed = self.record.reconcile({hash_str_to_int64(p) for p, _, _ in pages}, told_removed=full)
        if self.tokens is not None:  # relay mode: with their tokens, parents first
            pages = self.tokens.resolve(pages)
        self._pending, self._pending_removed, self._superseded = deque(pages), deque(removed), set()
        log.info("umbp_nvme: announcing the %d pages the store holds (medium DISK) on %s%s", len(pages),
                 self.endpoint, f", and {len(removed)} it does not" if removed else "")  # fmt: skip

    def _supersede(self, items: list) -> None:
        """Live events are newer than the running re-announcement's snapshot: it skips their pages."""
        h, out = hash_str_to_int64, self._superseded
        for kind, pages in items:
            if kind == "removed":
                out.update(p if type(p) is int else h(p) for p in pages)
            else:
                out.update(h(p[0]) for p in pages)

    def _send_chunk(self) -> None:
        gone, pending = self._pending_removed, self._pending
        src, kind = (gone, "removed") if gone else (pending, "stored")
        chunk = [src.popleft() for _ in range(min(BATCH_PAGES_MAX, len(src)))]
        if self._superseded:
            skip, h = self._superseded, hash_str_to_int64
            chunk = [x for x in chunk if (x if kind == "removed" else h(x[0])) not in skip]
        self.stats["reannounced_removed" if kind == "removed" else "reannounced_pages"] += len(chunk)
        if chunk:  # the record has the held pages already (reconcile): only tokens records are new
            self._publish([(kind, chunk)], recorded=kind == "stored" and self.tokens is None)
        if not (gone or pending):
            self._superseded = set()

    def _publish(self, items: list, recorded: bool = False) -> None:
        """Record what subscribers are about to be told (durably, when pages are told stored and
        the store is strict), then tell them. The record takes the hashes the encoder worked out."""
        events = self.encoder.events(items) if items else []
        if self.record is not None and events and not recorded:
            self._note(events)
        self._send(events)

    def _note(self, events: list) -> None:
        rec, stored = self.record, False
        for e in events:
            if isinstance(e, self.encoder.removed_cls):
                rec.forget(e.block_hashes)
            elif self.tokens is None:  # no token ids: a hash-list record
                rec.keep_hashes(e.block_hashes)
                stored = True
            else:  # each page's tokens are its share of the event's, its parent the page before it
                hs, toks, parent = e.block_hashes, e.token_ids, e.parent_block_hash
                n = len(toks) // len(hs)
                rec.keep([(hv, hs[i - 1] if i else parent, toks[i * n : (i + 1) * n]) for i, hv in enumerate(hs)])
                stored = True
        if stored and not self._sync_every_s:
            self._sync_record()

    def _sync_record(self) -> None:
        if self.record is not None:
            self.record.sync()
        self._synced_at = time.monotonic()

    def _send(self, events: list) -> None:
        if events:
            self._send_payload(self.encoder.encode(events))

    def _send_payload(self, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._last_send = time.monotonic()
        self._buffer.append((seq, payload))
        self.stats["batches"] += 1

    def _before_buffer(self, start_seq: int) -> None:
        """A replay starts before the buffer: the batches it missed are gone, so it needs the whole
        state: a re-announcement that started inside the buffer (running or done, nothing dropped
        since its snapshot) gives it; else one is scheduled, after the running one, never instead."""
        f = self._full_from
        if self._snapshot is not None and (f is None or f < self._buffer[0][0]):
            self._resync_full = self._resync = True

    # --- lifecycle

    @property
    def oldest_seq(self) -> int | None:
        """The sequence number of the oldest batch a replay can still send (None before the first)."""
        return self._buffer[0][0] if self._buffer else None

    @property
    def full_from(self) -> int | None:
        """The first sequence number of the last full re-announcement, while every page dropped since
        is in a buffered batch (None otherwise): a replay from before the buffer re-announces then."""
        return self._full_from

    @property
    def last_seq(self) -> int | None:
        """The sequence number of the newest batch sent (None before the first)."""
        return self._buffer[-1][0] if self._buffer else None

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued (and re-announced) has been sent (tests, close); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive():
            if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:  # the thread is between turns: what it has not done yet is in these
                busy = (self._q.unfinished_tasks or self._resync or self._pending or self._pending_removed
                        or self._clear_first or (self.tokens is not None and self.tokens.waiting))  # fmt: skip
            finally:
                self._lock.release()
            if not busy:
                return True
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
        if self.record is not None and not self._thread.is_alive():
            self.record.sync()
            self.record.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

