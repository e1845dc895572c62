"""The engine's own KV-event stream, relayed: one stream per worker, and the token ids DISK events need.

SGLang's storage backend is given page keys, never token ids; Dynamo's KV router drops a
``BlockStored`` without them ("token_ids too short"). The scheduler publishes them with its GPU and
CPU_PINNED events (``--kv-events-config``). With ``kv_events_engine_endpoint`` set, the publisher
(kv_events.py) subscribes there and:

- forwards every engine frame's payload unchanged under its own sequence numbers, so a router
  registers one endpoint per worker (and DP rank) and sees every tier of it in one ordered stream,
  with one replay socket (ours) for all of it;
- keeps, per engine block hash, the block's token ids and parent (a bounded LRU): a DISK page whose
  event hash matches a block the engine announced is published with those tokens (PageTokens);
  the publisher records them beside the store (kv_tokens.py) so that a restart re-announces with them.
- after forwarding an engine ``AllBlocksCleared`` (SGLang's ``/flush_cache`` resets the radix tree
  and the host pool, not L3), has the publisher re-announce the store's pages: a router wipes every
  tier of the worker on that event (Dynamo 1.6.1 does), DISK included.
- is preceded, at the publisher's first start in a process, by our own ``AllBlocksCleared``: the
  restarted scheduler's start-up clear went out before this socket subscribed (kv_events.py).

A page the engine never announced under the same hash is not announced on DISK in this mode
(counted as ``skipped_no_tokens``): its hash is namespaced (LoRA adapter, ``cache_salt``, the
``dynamo`` event format: the storage key no longer gives the event hash), or the engine's event
is older than the token cache. Dynamo would drop it anyway; a wrong hash would be worse.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict, deque
from typing import Optional

from .keys import hash_str_to_int64

log = logging.getLogger(__name__)

TOKEN_CACHE_BLOCKS = 200_000  # blocks whose tokens are kept (~0.3 KiB each at 64 tokens per page)
FRAMES_PER_POLL = 256  # engine frames taken per publisher-loop turn
TOKENS_GRACE_S = 1.0  # how long a stored page waits for the engine's event with its tokens


def connectable(endpoint: str) -> str:
    """A bind address copied from the scheduler's config (``tcp://*:5557``) as one to connect to."""
    for wild in ("*", "0.0.0.0"):
        if endpoint.startswith(f"tcp://{wild}:"):
            return "tcp://127.0.0.1:" + endpoint.rpartition(":")[2]
    if endpoint.startswith("tcp://[::]:"):
        return "tcp://[::1]:" + endpoint.rpartition(":")[2]
    return endpoint


class EngineRelay:
    def __init__(self, ctx, endpoint: str, topic: bytes = b"", cache_blocks: int = TOKEN_CACHE_BLOCKS):
        import msgspec
        import zmq

        self.endpoint = connectable(endpoint)
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic)
        self._sock.connect(self.endpoint)
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK
        self._dec = msgspec.msgpack.Decoder()
        self._tokens: OrderedDict[int, tuple[array, Optional[int]]] = OrderedDict()
        self._cap = int(cache_blocks)
        self._last_seq: Optional[int] = None
        # an engine AllBlocksCleared was forwarded: a router wipes every tier of the worker on it
        # (Dynamo 1.6.1), DISK included, so the publisher re-announces what the store holds
        self.cleared = False
        self.stats = {"engine_frames": 0, "engine_gaps": 0, "engine_bad_frames": 0, "engine_clears": 0,
                      "token_blocks": 0}  # fmt: skip

    def poll(self) -> list[bytes]:
        """The payloads of the engine frames waiting now (to forward), their tokens learnt."""
        out = []
        for _ in range(FRAMES_PER_POLL):
            try:
                frame = self._sock.recv_multipart(self._noblock)
            except self._again:
                break
            if len(frame) != 3 or len(frame[1]) != 8:
                self.stats["engine_bad_frames"] += 1
                continue
            seq = int.from_bytes(frame[1], "big")
            if self._last_seq is not None and seq != self._last_seq + 1:
                self.stats["engine_gaps"] += 1
                if self.stats["engine_gaps"] == 1:
                    log.warning("umbp_nvme: the engine's KV events skipped from %d to %d (a slow relay or an "
                                "engine restart); tokens of the missed blocks are not known", self._last_seq, seq)  # fmt: skip
            self._last_seq = seq
            self.stats["engine_frames"] += 1
            try:
                self._learn(self._dec.decode(frame[2]))
            except Exception:  # noqa: BLE001 - an undecodable batch is forwarded, not learnt from
                self.stats["engine_bad_frames"] += 1
            out.append(frame[2])
        return out

    def _learn(self, batch) -> None:
        events = batch[1] if isinstance(batch, (list, tuple)) and len(batch) >= 2 else ()
        for e in events:
            if isinstance(e, dict) and e.get("type") == "AllBlocksCleared":
                self.cleared = True  # SGLang's /flush_cache: the radix tree and host pool, never L3
                self.stats["engine_clears"] += 1
            if not isinstance(e, dict) or e.get("type") != "BlockStored":
                continue
            if e.get("lora_id") is not None or e.get("lora_name") or e.get("cache_salt"):
                continue  # namespaced: its hashes never equal a storage key's
            hashes, toks = e.get("block_hashes") or [], e.get("token_ids") or []
            if not hashes or len(toks) % len(hashes):
                continue
            n = len(toks) // len(hashes)
            parent = e.get("parent_block_hash")
            for i, h in enumerate(hashes):
                try:
                    t = array("q", toks[i * n : (i + 1) * n])
                except TypeError:  # EAGLE bigram pages carry token pairs: not relayable as ids
                    break
                self._tokens[h] = (t, parent)
                self._tokens.move_to_end(h)
                parent = h
            while len(self._tokens) > self._cap:
                self._tokens.popitem(last=False)
        self.stats["token_blocks"] = len(self._tokens)

    def lookup(self, block_hash: int) -> Optional[tuple[list[int], Optional[int]]]:
        got = self._tokens.get(block_hash)
        return None if got is None else (got[0].tolist(), got[1])

    def close(self) -> None:
        self._sock.close(linger=0)


class PageTokens:
    """Relay mode: a stored DISK page gets its tokens and parent from the engine's stream (the
    relay's cache) or, for a page announced before a restart, from the record (kv_tokens.py).
    A page whose tokens are not known yet waits up to TOKENS_GRACE_S, then is skipped (counted in
    ``stats["skipped_no_tokens"]``). Runs on the publisher's thread only; the publisher records
    what it announces."""

    def __init__(self, relay: EngineRelay, token_log=None, stats: Optional[dict] = None):
        self.relay = relay
        self.log = token_log
        self.stats = stats if stats is not None else {"skipped_no_tokens": 0}
        self._waiting: deque = deque()  # (deadline, page, parent) until its tokens are known

    @property
    def waiting(self) -> bool:
        return bool(self._waiting)

    def lookup(self, page: str) -> Optional[tuple[list[int], Optional[int]]]:
        h = hash_str_to_int64(page)
        got = self.relay.lookup(h)
        if got is None and self.log is not None:
            got = self.log.get(h)
        return got

    def attach(self, items: list, wait: bool = True) -> list:
        """Stored pages with their tokens; the others wait (or are skipped when ``wait`` is False)."""
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
                got = self.lookup(page)
                if got is not None:
                    ready.append((page, parent if parent is not None else got[1], got[0]))
                elif wait:
                    self._waiting.append((now + TOKENS_GRACE_S, page, parent))
                else:
                    self.stats["skipped_no_tokens"] += 1
            if ready:
                out.append(("stored", ready))
        return out

    def ripe(self) -> list:
        """Waiting pages whose tokens arrived; those past their grace are skipped (counted)."""
        if not self._waiting:
            return []
        now, ready, keep = time.monotonic(), [], deque()
        for deadline, page, parent in self._waiting:
            got = self.lookup(page)
            if got is not None:
                ready.append((page, parent if parent is not None else got[1], got[0]))
            elif now >= deadline:
                self.stats["skipped_no_tokens"] += 1
            else:
                keep.append((deadline, page, parent))
        self._waiting = keep
        return [("stored", ready)] if ready else []

    def resolve(self, pages: list) -> list:
        """A re-announcement: the pages whose tokens are known, each parent before its children
        (Dynamo's indexer files a block under its parent), the rest skipped (counted)."""
        ready = []
        for page, parent, _ in pages:
            got = self.lookup(page)
            if got is None:
                self.stats["skipped_no_tokens"] += 1
            else:
                ready.append((page, parent if parent is not None else got[1], got[0]))
        return parents_first(ready)


def _hash_of(parent) -> Optional[int]:
    return parent if parent is None or isinstance(parent, int) else hash_str_to_int64(parent)


def parents_first(items: list) -> list:
    """``(page, parent, tokens)`` items ordered so that a page whose parent is among them comes
    after it, each chain contiguous (the encoder joins a chain into one BlockStored)."""
    by_hash = {hash_str_to_int64(it[0]): it for it in items}
    children: dict[int, list] = {}
    roots = []
    for it in items:
        ph = _hash_of(it[1])
        if ph is not None and ph in by_hash and ph != hash_str_to_int64(it[0]):
            children.setdefault(ph, []).append(it)
        else:
            roots.append(it)
    out, seen = [], set()
    for root in roots:
        stack = [root]
        while stack:
            it = stack.pop()
            h = hash_str_to_int64(it[0])
            if h in seen:
                continue
            seen.add(h)
            out.append(it)
            stack.extend(reversed(children.get(h, ())))
    out += [it for it in items if hash_str_to_int64(it[0]) not in seen]  # a cycle: no order is right
    return out
