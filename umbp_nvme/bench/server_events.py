"""``bench server --kv-events``: the real server's KV events, relayed with ours, against what each tier holds.

The umbp server runs with SGLang's ``--kv-events-config`` (its scheduler publishes GPU and
CPU_PINNED events, with a replay socket) and this store's backend in relay mode
(``kv_events_engine_endpoint``: the backend subscribes to the scheduler, forwards its frames and
adds DISK pages with the engine's token ids, in one ordered stream with one replay socket). Three
subscribers watch:

- the **reference**: a plain subscriber on the scheduler's own endpoint (replaying from 0 on its
  first frame): what the radix cache holds on GPU and in the host pool, by the scheduler's word;
- **ours** (fleet_sub.py's protocol, every tier kept) on the relay's endpoint;
- NVIDIA **Dynamo's** standalone indexer (fleet_dynamo.py) with the worker registered on the
  relay's endpoint and replay socket, read from ``/dump`` per storage tier.

At each checkpoint the truth per tier is: GPU and CPU_PINNED = the reference's; DISK = the pages
whose objects the store's index holds (read-only, from the file). ``phantom`` (announced, not held)
and ``missing`` (held, not announced) must be 0 for ours and Dynamo's once they converge; the wait
is bounded (SETTLE_S) and reported. ``query`` asks Dynamo's ``/query`` (and our tally's prefix match)
how many tokens of a prompt each tier serves.
"""

from __future__ import annotations

import json
import os
import time

from .fleet_sub import DiskTally

MEDIUMS = ("GPU", "CPU_PINNED", "DISK")
DYNAMO_TIER = {"GPU": "device", "CPU_PINNED": "host_pinned", "DISK": "disk"}  # Dynamo 1.6.1's storage_tier
SETTLE_S = 30.0  # a hang guard: how long subscribers may take to agree with the tiers
WORKER = 1
MODEL = "bench-server"
U64 = (1 << 64) - 1


class Ports:
    """The events' ports: the five after the server's HTTP port (one server runs at a time), or
    the five given (a test's free ports)."""

    def __init__(self, http_port: int, ports: list[int] | None = None):
        ports = list(ports) if ports is not None else list(range(http_port + 1, http_port + 6))
        if len(ports) != 5:
            raise ValueError(f"five ports expected (engine, its replay, relay, its replay, Dynamo), got {ports}")
        self.engine, self.engine_replay, self.relay, self.relay_replay, self.dynamo = ports

    def endpoint(self, port: int) -> str:
        return f"tcp://127.0.0.1:{port}"


def server_flags(p: Ports) -> list[str]:
    """SGLang's own publisher: binds ``tcp://*`` as the docs write it, with a replay socket."""
    return ["--kv-events-config", json.dumps({"publisher": "zmq", "endpoint": f"tcp://*:{p.engine}",
                                              "replay_endpoint": p.endpoint(p.engine_replay)})]  # fmt: skip


def extra_config(p: Ports) -> dict:
    """The backend's relay mode (docs/fleet.md): the engine endpoint as copied from --kv-events-config."""
    return {"kv_events_endpoint": f"tcp://*:{p.relay}", "kv_events_replay_endpoint": p.endpoint(p.relay_replay),
            "kv_events_engine_endpoint": f"tcp://*:{p.engine}"}  # fmt: skip


class Tiers:
    """What a subscriber believes each tier holds, from decoded batches applied in order:
    ``tiers[medium]`` the event hashes announced there and not removed, ``disk_tokens`` a DISK
    block's token ids as announced; AllBlocksCleared empties every tier."""

    def __init__(self, stats: dict | None = None):
        self.tiers: dict[str, set[int]] = {m: set() for m in MEDIUMS}
        self.disk_tokens: dict[int, tuple] = {}
        self.stats = stats if stats is not None else {}
        for k in ("stored", "removed", "cleared", *(f"removed_{m}" for m in MEDIUMS)):
            self.stats.setdefault(k, 0)

    def apply(self, batch) -> None:
        for e in batch[1] if isinstance(batch, (list, tuple)) and len(batch) > 1 else ():
            kind, tier = e.get("type"), self.tiers.get(e.get("medium"))
            if kind == "AllBlocksCleared":
                for t in self.tiers.values():
                    t.clear()
                self.disk_tokens.clear()
                self.stats["cleared"] += 1
            elif tier is None:
                continue
            elif kind == "BlockStored":
                hs = e["block_hashes"]
                tier.update(hs)
                self.stats["stored"] += len(hs)
                toks = e.get("token_ids") or []
                if e["medium"] == "DISK" and hs:
                    n = len(toks) // len(hs)
                    self.disk_tokens.update((h, tuple(toks[i * n : (i + 1) * n])) for i, h in enumerate(hs))
            elif kind == "BlockRemoved":
                tier.difference_update(e["block_hashes"])
                self.stats["removed"] += len(e["block_hashes"])
                self.stats[f"removed_{e['medium']}"] += len(e["block_hashes"])
                if e["medium"] == "DISK":
                    for h in e["block_hashes"]:
                        self.disk_tokens.pop(h, None)


class TierTally(DiskTally):
    """fleet_sub's subscriber (SUB + replay on gaps) keeping every tier (``Tiers``)."""

    def __init__(self, ctx, endpoint: str, replay_endpoint: str):
        super().__init__(ctx, endpoint, replay_endpoint)
        self.state = Tiers(self.stats)
        self.tiers, self.disk_tokens = self.state.tiers, self.state.disk_tokens
        self.blocks = self.tiers["DISK"]
        self.stats["quiet_since"] = time.monotonic()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.stats["quiet_since"] = time.monotonic()
        self.state.apply(self._dec.decode(payload))


def page_keys(store_dir: str) -> dict[str, int]:
    """Page key -> objects of it in the store's index (read-only: the server keeps writing). A key
    is in the index before a lookup can see it and after it stopped being visible only until the
    delete's commit, so a settled store reads exactly."""
    from ..store.index import Index

    ix = Index(os.path.join(store_dir, "index.lmdb"), readonly=True, map_size=1 << 30, durable=False, wait_s=0.0)
    try:
        keys, _ = ix.scan()
    finally:
        ix.close()
    out: dict[str, int] = {}
    for k in keys:
        out[k[:64]] = out.get(k[:64], 0) + 1
    return out


def disk_held(store_dir: str) -> set[int]:
    """The event hashes of the pages whose every KV object is there (the tiny MHA model: ``_0_k``
    and ``_0_v``; a page is as complete as the most complete one)."""
    from ..sglang.keys import hash_str_to_int64

    pages = page_keys(store_dir)
    full = max(pages.values(), default=0)
    return {hash_str_to_int64(p) for p, n in pages.items() if n == full}


def prompt_hashes(ids: list[int], page: int) -> list[int]:
    """The event hashes of a prompt's full pages: SGLang's chained SHA-256 page keys over
    little-endian u32 token ids (what its page hash computes; checked against the store by the run)."""
    import hashlib
    import struct

    from ..sglang.keys import hash_str_to_int64

    out, prev = [], b""
    for i in range(len(ids) // page):
        chunk = ids[i * page : (i + 1) * page]
        prev = hashlib.sha256(prev + struct.pack(f"<{page}I", *chunk)).digest()
        out.append(hash_str_to_int64(prev.hex()))
    return out


def compare(held: set[int], announced: set[int]) -> dict:
    return {"announced": len(announced), "phantom": len(announced - held), "missing": len(held - announced)}


class Watch:
    """The three subscribers of one umbp server (and of its restart on the same store)."""

    def __init__(self, ports: Ports, work: str, dynamo_python: str = ""):
        import zmq

        self.p, self.ctx, self.indexer = ports, zmq.Context(), None
        self.ref = self.ours = None
        self.rows: list[dict] = []
        self.queries: list[dict] = []
        if dynamo_python:
            from .fleet_dynamo import Indexer

            self.indexer = Indexer(dynamo_python, ports.dynamo, os.path.join(work, "dynamo-indexer.log"), MODEL, 64)

    def attach(self) -> None:
        """Before the first request: every frame of the server's counts (the reference replays from 0)."""
        p = self.p
        self.ref = TierTally(self.ctx, p.endpoint(p.engine), p.endpoint(p.engine_replay))
        self.ours = TierTally(self.ctx, p.endpoint(p.relay), p.endpoint(p.relay_replay))
        if self.indexer is not None:
            self.indexer.register(WORKER, p.endpoint(p.relay), p.endpoint(p.relay_replay))

    def detach(self) -> None:
        """The server died: a router's discovery drops the worker when its lease ends, and so do we
        (the next server's scheduler starts its sequence at 0 again)."""
        for t in (self.ref, self.ours):
            if t is not None:
                t.close()
        self.ref = self.ours = None
        if self.indexer is not None:
            self.indexer.unregister(WORKER)

    def _dynamo(self) -> dict[str, set[int]]:
        if self.indexer is None:
            return {}
        out: dict[str, set[int]] = {}
        for m, tier in DYNAMO_TIER.items():
            got = self.indexer.blocks(tier).get(WORKER, set())
            out[m] = {h if h < (1 << 63) else h - (1 << 64) for h in got}
        return out

    def _pump(self, s: float) -> None:
        self.ref.pump(timeout_s=s)
        self.ours.pump(timeout_s=s)

    def checkpoint(self, step: str, store_dir: str) -> list[dict]:
        """Until ours and Dynamo's agree with every tier on two looks in a row, the reference quiet
        for a second (or SETTLE_S passed): a row per tier."""
        t0, agreed = time.monotonic(), 0
        while True:
            self._pump(0.25)
            truth = {"GPU": set(self.ref.tiers["GPU"]), "CPU_PINNED": set(self.ref.tiers["CPU_PINNED"]),
                     "DISK": disk_held(store_dir)}  # fmt: skip
            dyn = self._dynamo()
            same = all(self.ours.tiers[m] == truth[m] and (not dyn or dyn[m] == truth[m]) for m in MEDIUMS)
            quiet = time.monotonic() - self.ref.stats["quiet_since"] >= 1.0
            agreed = agreed + 1 if same and quiet else 0
            waited = time.monotonic() - t0
            if agreed >= 2 or waited > SETTLE_S:
                break
        rows = []
        for m in MEDIUMS:
            row = {"step": step, "tier": m, "held": len(truth[m]),
                   **{f"ours_{k}": v for k, v in compare(truth[m], self.ours.tiers[m]).items()}}  # fmt: skip
            if dyn:
                row.update({f"dynamo_{k}": v for k, v in compare(truth[m], dyn[m]).items()})
            row["wait_s"] = round(waited, 2)
            rows.append(row)
        self.rows += rows
        return rows

    def query(self, step: str, ids: list[int], page: int) -> dict:
        """How many tokens of ``ids`` each tier serves: our tally's prefix match per tier, and
        Dynamo's ``/query`` (cumulative by tier: a GPU block counts toward cpu and disk too)."""
        hashes = prompt_hashes(ids, page)

        def prefix(blocks):
            n = 0
            while n < len(hashes) and hashes[n] in blocks:
                n += 1
            return n * page

        out = {"step": step, "prompt_tokens": len(ids),
               "ours": {m: prefix(self.ours.tiers[m]) for m in MEDIUMS}}  # fmt: skip
        if self.indexer is not None:
            inst = self.indexer.query(ids).get("instances", {}).get(str(WORKER), {})
            out["dynamo"] = {k: int(inst.get(k, 0)) for k in ("longest_matched", "gpu", "cpu", "disk")}
        self.queries.append(out)
        return out

    def close(self) -> None:
        for t in (self.ref, self.ours):
            if t is not None:
                t.close()
        if self.indexer is not None:
            self.indexer.close()
        self.ctx.term()


def failures(rows: list[dict], queries: list[dict]) -> list[str]:
    out = [f"{r['step']}, {r['tier']}: {k} = {r[k]}" for r in rows
           for k in ("ours_phantom", "ours_missing", "dynamo_phantom", "dynamo_missing") if r.get(k)]  # fmt: skip
    out += [f"{r['step']}: DISK holds no page (nothing exercised)" for r in rows if r["tier"] == "DISK" and not r["held"]]
    return out


def print_rows(rows: list[dict], queries: list[dict]) -> None:
    cols = [c for c in ("step", "tier", "held", "ours_announced", "ours_phantom", "ours_missing", "dynamo_announced",
                        "dynamo_phantom", "dynamo_missing", "wait_s") if any(c in r for r in rows)]  # fmt: skip
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(width[c]) for c in cols))
    for q in queries:
        print(f"query ({q['step']}, {q['prompt_tokens']} tokens): ours {q['ours']}"
              + (f"; dynamo {q['dynamo']}" if "dynamo" in q else ""))
