"""One node of `bench fleet`: a backend over its own store, publishing DISK events, fed by a stand-in engine.

Run as ``python -m umbp_nvme.bench.fleet_node --dir D --engine-port E --events-port P --replay-port R``
(``--roots D1,D2``: a store over those drives instead; ``--queue-max N``: the event queue's size;
``--no-relay``: no engine stand-in, DISK events without token ids);
it answers one JSON line on stdout per JSON command line on stdin (``{"op": ..., ...}``):

- ``backup conv pages``: the engine stand-in announces the conversation's pages on GPU with their
  tokens (as the scheduler does), the backend stores them (``batch_set_v1`` with prefix keys, as
  the cache controller's backup does), then the engine drops its GPU copies;
- ``delete conv first [last] [each]``: the store deletes those pages' objects (as an operator or a
  drop would; ``each``: one call per page); ``clear``; ``held keys``: which page keys the store holds now (``batch_exists``);
- ``sync``: every event sent, and the last sequence number; ``stats``; ``quit``.

The backend runs in relay mode (``kv_events_engine_endpoint``): the router registers this node's
endpoint and sees the engine's GPU events and our DISK events in one stream, with tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import struct
import sys
import time

import numpy as np

PAGE_TOKENS = 16
OBJECT_BYTES = 64 << 10  # one K or V object of a page
POOL_PAGES = 64  # host pool: the most pages one backup call moves
SYSTEM_PROMPT = "system"  # every conversation starts with this page: chains share a root


def conversation(name: str, pages: int, page_tokens: int = PAGE_TOKENS) -> tuple[list[int], list[str]]:
    """(token ids, page keys): SGLang's chained SHA-256 page keys over little-endian u32 tokens;
    the first page is the shared system prompt."""
    sys_rng, rng = random.Random(SYSTEM_PROMPT), random.Random(name)
    tokens = [sys_rng.randrange(32000) for _ in range(page_tokens)]
    tokens += [rng.randrange(32000) for _ in range((pages - 1) * page_tokens)]
    keys, prev = [], b""
    for p in range(pages):
        chunk = tokens[p * page_tokens : (p + 1) * page_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(chunk)}I", *chunk)).digest()
        keys.append(prev.hex())
    return tokens, keys


class HostPool:
    """page_first MHA host pool over one numpy buffer (K half, V half), as SGLang's describes itself."""

    layout = "page_first"
    dtype = "uint8"

    def __init__(self, pages: int, page_tokens: int, object_bytes: int):
        self.page_size = page_tokens
        self.size = pages * page_tokens
        self.token_bytes = object_bytes // page_tokens
        self.kv_buffer = np.zeros((2, self.size, self.token_bytes), np.uint8)

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]

    def get_page_buffer_meta(self, indices):
        base, half = self.kv_buffer.ctypes.data, self.size * self.token_bytes
        ptrs, sizes = [], []
        for t0 in list(indices)[:: self.page_size]:
            k = base + int(t0) * self.token_bytes
            ptrs += [k, k + half]
            sizes += [self.page_size * self.token_bytes] * 2
        return ptrs, sizes


class StorageConfig:
    """The HiCacheStorageConfig fields the backend reads."""

    def __init__(self, extra: dict):
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, 1, 0, 1
        self.is_mla_model = False
        self.enable_storage_metrics = False
        self.model_name = "fleet-bench"
        self.extra_config = extra


class Engine:
    """The scheduler's KV-event publisher, standing in: GPU events with tokens on a PUB socket."""

    def __init__(self, ctx, endpoint: str, page_tokens: int):
        import msgspec
        import zmq

        from ..sglang.kv_events import event_types

        self.stored, self.removed, self.batch, _ = event_types()
        self._enc = msgspec.msgpack.Encoder()
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.seq = 0
        self.page_tokens = page_tokens

    def publish(self, events: list) -> None:
        payload = self._enc.encode(self.batch(ts=time.time(), events=events, attn_dp_rank=0))
        self.sock.send_multipart((b"", self.seq.to_bytes(8, "big"), payload))
        self.seq += 1

    def gpu_stored(self, keys: list[str], parent: str | None, tokens: list[int]) -> None:
        from ..sglang.keys import hash_str_to_int64 as h

        self.publish([self.stored(block_hashes=[h(k) for k in keys], parent_block_hash=None if parent is None else h(parent),
                                  token_ids=tokens, block_size=self.page_tokens, lora_id=None, medium="GPU")])  # fmt: skip

    def gpu_removed(self, keys: list[str]) -> None:
        from ..sglang.keys import hash_str_to_int64 as h

        self.publish([self.removed(block_hashes=[h(k) for k in keys], medium="GPU")])


class Node:
    def __init__(self, args):
        import zmq

        from ..sglang.backend import UMBPNvmeStore

        self.ctx = zmq.Context()
        self.page_tokens = args.page_tokens
        self.engine = None if args.no_relay else Engine(self.ctx, f"tcp://*:{args.engine_port}", args.page_tokens)
        roots = args.roots.split(",") if args.roots else None
        extra = {
            "backend_name": "umbp_nvme", "interface_v1": 1,
            "ssd_storage_dir": json.dumps(roots) if roots and len(roots) > 1 else (roots or [args.dir])[0],
            "ssd_capacity_bytes": args.capacity_bytes, "ssd_segment_size_bytes": 1 << 20,
            "ssd_durability_mode": "relaxed",
            "kv_events_endpoint": f"tcp://*:{args.events_port}",
            "kv_events_replay_endpoint": f"tcp://127.0.0.1:{args.replay_port}",  # routers on this host (docs/fleet.md)
            "kv_events_queue_max": args.queue_max,
        }  # fmt: skip
        if self.engine is not None:
            extra["kv_events_engine_endpoint"] = f"tcp://127.0.0.1:{args.engine_port}"
        self.be = UMBPNvmeStore(StorageConfig(extra), {})
        self.pool = HostPool(POOL_PAGES, args.page_tokens, args.object_bytes)
        self.be.register_mem_pool_host(self.pool)
        self.pub = self.be.publisher
        if self.pub is not None and self.engine is not None:
            self._engine_joined()

    def _engine_joined(self) -> None:
        """Publish empty batches until the relay hears the engine (a SUB misses what precedes its join)."""
        relay = self.pub.relay
        deadline = time.monotonic() + 30
        while relay.stats["engine_frames"] == 0 and time.monotonic() < deadline:
            self.engine.publish([])
            time.sleep(0.02)

    def op_backup(self, conv: str, pages: int) -> dict:
        from ..sglang.backend import HiCacheStorageExtraInfo

        tokens, keys = conversation(conv, pages, self.page_tokens)
        pt = self.page_tokens
        if self.engine is not None:
            self.engine.gpu_stored(keys, None, tokens)
        ok = 0
        for i in range(0, pages, POOL_PAGES):
            part = keys[i : i + POOL_PAGES]
            idx = np.arange(len(part) * pt, dtype=np.int64)
            self.pool.kv_buffer[:, : len(part) * pt] = (i + len(conv)) % 251  # bytes differ per call
            ok += sum(self.be.batch_set_v1(part, idx, HiCacheStorageExtraInfo(prefix_keys=keys[:i])))
        if self.engine is not None:
            self.engine.gpu_removed(keys)
        return {"stored": ok}

    def op_delete(self, conv: str, pages: int, first: int, last: int | None = None, each: bool = False) -> dict:
        """``each``: one call per page (a burst of removal events, one queue item each)."""
        _, keys = conversation(conv, pages, self.page_tokens)
        sfx = self.be.v1_suffixes
        calls = [[k + s for s in sfx] for k in keys[first:last]] if each else [[k + s for k in keys[first:last] for s in sfx]]
        return {"deleted": sum(sum(self.be.store.delete_many(objs)) for objs in calls) // len(sfx)}

    def op_clear(self) -> dict:
        self.be.clear()
        return {}

    def op_held(self, keys: list[str]) -> dict:
        return {"held": [self.be.batch_exists([k]) == 1 for k in keys]}

    def op_sync(self) -> dict:
        if self.pub is None:
            return {"last_seq": None}
        self.pub.flush(60)
        return {"last_seq": self.pub.last_seq}

    def op_stats(self) -> dict:
        st = self.be.store_stats()["store"]
        out = {k: st.get(k, 0) for k in ("objects", "evictions", "deletes", "puts")}
        if self.pub is not None:
            out.update(self.pub.stats)
            if self.pub.relay is not None:
                out.update(self.pub.relay.stats)
            if self.pub.record is not None:
                out.update(self.pub.record.stats)
        return out

    def close(self) -> None:
        self.be.close()
        if self.engine is not None:
            self.engine.sock.close(linger=0)
        self.ctx.term()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--engine-port", type=int, required=True)
    p.add_argument("--events-port", type=int, required=True)
    p.add_argument("--replay-port", type=int, required=True)
    p.add_argument("--capacity-bytes", type=int, default=16 << 20)
    p.add_argument("--roots", default="", help="comma-separated drive directories (default: --dir alone)")
    p.add_argument("--queue-max", type=int, default=10_000, help="the KV event queue's size (items)")
    p.add_argument("--no-relay", action="store_true", help="no engine stand-in: DISK events without token ids")
    p.add_argument("--page-tokens", type=int, default=PAGE_TOKENS)
    p.add_argument("--object-bytes", type=int, default=OBJECT_BYTES)
    args = p.parse_args(argv)
    node = Node(args)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd.pop("op")
            if op == "quit":
                break
            try:
                out = {"ok": True, **getattr(node, f"op_{op}")(**cmd)}
            except Exception as e:  # noqa: BLE001 - reported to the controller, which decides
                out = {"ok": False, "error": repr(e)}
            print(json.dumps(out), flush=True)
    finally:
        node.close()
    print(json.dumps({"ok": True, "closed": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
