"""``umbp-nvme bench fleet``: two nodes, their DISK events, and what a router believes about them.

Two backend processes (fleet_node.py), each with its own store, event endpoint, replay socket
and stand-in engine, are "node A" (a store over two drives) and "node B". The scenario backs up
conversations on both (one shared), fills A past its capacity (evictions), deletes pages on B,
restarts A, restarts A again without its second drive (its pages are lost: the re-announcement
removes them) and with a one-item event queue, backs up and deletes on A while that queue drops
events (the re-announcements that follow repair them), clears B and backs up on B a conversation
only B holds. After every step each node is asked which pages it holds (``batch_exists``) and
that is compared with what subscribers believe it holds on disk:

- ours (fleet_sub.py: SUB + replay on gaps, as Dynamo's indexer does), always;
- NVIDIA Dynamo's standalone indexer (``python -m dynamo.indexer`` run by ``--dynamo-python``),
  when that interpreter can import it: both nodes registered, disk-tier blocks read from /dump.

Across A's restarts ours keeps its tally (it must notice the gap and replay). At the first,
Dynamo is told the worker left and registers it again (as its discovery does when a lease ends):
everything it knows of A afterwards comes from A's re-announcement, tokens included
(kv_tokens.py). At the second (a quick restart within the lease) it stays registered and must
take the lost drive's pages out from the removals the re-announcement sends.

``phantom`` (announced, not held) and ``missing`` (held, not announced) must both be 0. At the
end, the prompt of B's conversation is queried: Dynamo's /query overlap (and our tallies' prefix
match) must prefer node B. Exit status 1 when any of it fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from .fleet_node import PAGE_TOKENS, conversation

U64 = (1 << 64) - 1
SETTLE_S = 30.0  # how long a subscriber may take to catch up with a node (a hang guard, not a bound)


def free_ports(n: int) -> list[int]:
    socks, out = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        out.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return out


class NodeProc:
    def __init__(self, name: str, directory: str, ports: list[int], capacity_bytes: int, log_dir: str,
                 roots: list[str] | None = None, *, relay: bool = True, queue_max: int = 10_000, start: bool = True):  # fmt: skip
        self.name, self.directory, self.capacity_bytes = name, directory, capacity_bytes
        self.roots, self.queue_max, self.relay = roots, queue_max, relay
        self.runs: list[dict] = []  # each run's stats, taken before it stopped
        self.engine_port, self.events_port, self.replay_port = ports
        self.endpoint = f"tcp://127.0.0.1:{self.events_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        self.log_path = os.path.join(log_dir, f"node-{name}.log")
        self.keys: dict[str, None] = {}  # every page key ever backed up here (the universe for `held`)
        self.proc = None
        if start:
            self.start()

    def start(self, roots: list[str] | None = None, queue_max: int | None = None) -> None:
        self.roots = roots or self.roots
        self.queue_max = queue_max or self.queue_max
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "umbp_nvme.bench.fleet_node", "--dir", self.directory,
             "--engine-port", str(self.engine_port), "--events-port", str(self.events_port),
             "--replay-port", str(self.replay_port), "--capacity-bytes", str(self.capacity_bytes),
             "--roots", ",".join(self.roots or []), "--queue-max", str(self.queue_max),
             *([] if self.relay else ["--no-relay"])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )  # fmt: skip
        self._reply()

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node {self.name} exited (status {self.proc.wait()}); see {self.log_path}")
        out = json.loads(line)
        if not out.pop("ok"):
            raise RuntimeError(f"node {self.name}: {out.get('error')}")
        return out

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def backup(self, conv: str, pages: int) -> int:
        self.keys.update(dict.fromkeys(conversation(conv, pages)[1]))
        return self.call("backup", conv=conv, pages=pages)["stored"]

    def held(self) -> set[int]:
        from ..sglang.keys import hash_str_to_int64

        keys = list(self.keys)
        got = self.call("held", keys=keys)["held"]
        return {hash_str_to_int64(k) for k, h in zip(keys, got) if h}

    def kill(self, op: dict | None = None) -> None:
        """SIGKILL, after its stats are taken; ``op``: a command sent first and not waited for
        (the kill lands while it runs)."""
        self.runs.append(self.call("stats"))
        if op is not None:
            self.proc.stdin.write(json.dumps(op) + "\n")
            self.proc.stdin.flush()
        self.proc.kill()
        self.proc.wait()
        self._log.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.runs.append(self.call("stats"))
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def scenario(quick: bool) -> dict:
    k = 1 if quick else 3
    return {
        "pages": 8, "convs": 4 * k, "evict_convs": 10 * k, "evict_pages": 12, "drop_convs": 4 * k,
        "capacity_bytes": (16 << 20) * k,
    }


def compare(held: set[int], announced: set[int]) -> dict:
    return {"announced": len(announced), "phantom": len(announced - held), "missing": len(held - announced)}


class Fleet:
    def __init__(self, cfg, directory: str):
        import zmq

        from .fleet_sub import DiskTally

        self.cfg, self.sc = cfg, scenario(cfg.quick)
        self.ctx = zmq.Context()
        self.nodes = {}
        self.ours = {}
        self.indexer = None
        ports = free_ports(7)
        for name in "AB":  # a fresh pair of stores: the steps' expectations start from empty
            shutil.rmtree(os.path.join(directory, f"node{name}"), ignore_errors=True)
        for i, name in enumerate("AB"):
            d = os.path.join(directory, f"node{name}")
            roots = [os.path.join(d, "d0"), os.path.join(d, "d1")] if name == "A" else None
            self.nodes[name] = NodeProc(name, d, ports[3 * i : 3 * i + 3], self.sc["capacity_bytes"], directory, roots)
            n = self.nodes[name]
            self.ours[name] = DiskTally(self.ctx, n.endpoint, n.replay_endpoint)
        if cfg.dynamo_python:
            from .fleet_dynamo import Indexer

            self.indexer = Indexer(cfg.dynamo_python, ports[6], os.path.join(directory, "dynamo-indexer.log"),
                                   "fleet-bench", PAGE_TOKENS)  # fmt: skip
            for i, name in enumerate("AB"):
                self.indexer.register(i + 1, self.nodes[name].endpoint, self.nodes[name].replay_endpoint)
        self.rows: list[dict] = []

    def checkpoint(self, step: str) -> None:
        held = {}
        for name, node in self.nodes.items():
            last = node.call("sync")["last_seq"]
            self.ours[name].pump(until_seq=last, timeout_s=SETTLE_S)
            held[name] = node.held()
        dyn, waited = self._dynamo(held)
        for i, (name, node) in enumerate(self.nodes.items()):
            row = {"step": step, "node": name, "held": len(held[name]),
                   **{f"ours_{k}": v for k, v in compare(held[name], self.ours[name].blocks).items()}}  # fmt: skip
            if dyn is not None:
                disk = {h if h < (1 << 63) else h - (1 << 64) for h in dyn.get(i + 1, set())}
                row.update({f"dynamo_{k}": v for k, v in compare(held[name], disk).items()}, dynamo_wait_s=waited)
            self.rows.append(row)

    def _dynamo(self, held: dict) -> tuple[dict | None, float]:
        """Dynamo's disk blocks per worker once they match what the nodes hold (or SETTLE_S passed)."""
        if self.indexer is None:
            return None, 0.0
        t0 = time.monotonic()
        want = {i + 1: {h & U64 for h in held[name]} for i, name in enumerate(self.nodes)}
        while True:
            got = self.indexer.blocks("disk")
            if all(got.get(w, set()) == hs for w, hs in want.items()) or time.monotonic() - t0 > SETTLE_S:
                return got, round(time.monotonic() - t0, 2)
            time.sleep(0.2)

    def run(self) -> dict:
        sc, A, B = self.sc, self.nodes["A"], self.nodes["B"]
        p = sc["pages"]
        for c in range(sc["convs"]):
            A.backup(f"a{c}", p)
            B.backup(f"b{c}", p)
        A.backup("shared", p)
        B.backup("shared", p)
        self.checkpoint("backups")
        for c in range(sc["evict_convs"]):
            A.backup(f"e{c}", sc["evict_pages"])
        self.checkpoint("evictions on A")
        B.call("delete", conv="b1", pages=p, first=p // 2)  # a conversation's tail
        B.call("delete", conv="b2", pages=p, first=p // 2, last=p // 2 + 1)  # one page inside a chain
        self.checkpoint("deletes on B")
        A.stop()
        if self.indexer is not None:  # Dynamo forgets the dead worker: the re-announcement must bring it all back
            self.indexer.unregister(1)
        A.start()
        if self.indexer is not None:
            self.indexer.register(1, A.endpoint, A.replay_endpoint)
        A.backup("after-restart", p)  # traffic goes on: the next frame shows subscribers the gap
        self.checkpoint("restart of A")
        before = len(A.held())
        A.stop()  # back within the lease: Dynamo keeps A registered and replays the gap
        A.start(roots=A.roots[:1], queue_max=1)  # drive 1 removed: its pages are gone
        self.lost_pages = before - len(A.held())
        self.checkpoint("A without drive 1")
        for c in range(sc["drop_convs"]):  # a one-item queue: most of these events are dropped
            A.backup(f"d{c}", p)
            A.call("delete", conv=f"d{c}", pages=p, first=p // 2, each=True)
            A.call("delete", conv=f"e{c}", pages=sc["evict_pages"], first=1, each=True)
        self.checkpoint("drops on A")
        B.call("clear")
        B.backup("only-b", p)
        self.checkpoint("clear of B")
        tokens, keys = conversation("only-b", p)
        stats = {n: x.call("stats") for n, x in self.nodes.items()}
        for n, t in self.ours.items():
            stats[n].update({f"ours_{k}": v for k, v in t.stats.items()})
        exercised = {"lost_pages": self.lost_pages, "dropped": stats["A"].get("dropped", 0),
                     "dropped_pages": stats["A"].get("dropped_pages", 0),
                     "reannounced_removed": sum(r.get("reannounced_removed", 0) for r in A.runs + [stats["A"]])}  # fmt: skip
        return {"rows": self.rows, "query": self._query(tokens, keys), "stats": stats, "scenario": sc,
                "exercised": exercised, "earlier_runs": {n: list(x.runs) for n, x in self.nodes.items()}}  # fmt: skip

    def _query(self, tokens: list[int], keys: list[str]) -> dict:
        from ..sglang.keys import hash_str_to_int64

        hashes = [hash_str_to_int64(k) for k in keys]
        ours = {}
        for name, tally in self.ours.items():
            n = 0
            while n < len(hashes) and hashes[n] in tally.blocks:
                n += 1
            ours[name] = n * PAGE_TOKENS
        out = {"prompt_tokens": len(tokens), "ours_matched_tokens": ours, "ours_prefers_b": ours["B"] > ours["A"]}
        if self.indexer is not None:
            inst = self.indexer.query(tokens).get("instances", {})
            disk = {name: int(inst.get(str(i + 1), {}).get("disk", 0)) for i, name in enumerate(self.nodes)}
            out.update(dynamo_disk_tokens=disk, dynamo_prefers_b=disk["B"] > disk["A"])
        return out

    def close(self) -> None:
        for t in self.ours.values():
            t.close()
        for n in self.nodes.values():
            n.stop()
        if self.indexer is not None:
            self.indexer.close()
        self.ctx.term()


def failures(result: dict) -> list[str]:
    out = []
    for r in result["rows"]:
        for k in ("ours_phantom", "ours_missing", "dynamo_phantom", "dynamo_missing"):
            if r.get(k):
                out.append(f"{r['step']}, node {r['node']}: {k} = {r[k]}")
    ex = result.get("exercised", {})
    for k in ("lost_pages", "dropped_pages", "reannounced_removed"):
        if k in ex and not ex[k]:
            out.append(f"{k} = 0: the run did not exercise what it checks ({ex})")
    q = result["query"]
    for k in ("ours_prefers_b", "dynamo_prefers_b"):
        if k in q and not q[k]:
            out.append(f"the query of B's conversation: {k} is False ({q})")
    return out


def run(cfg) -> dict:
    directory = cfg.dir or tempfile.mkdtemp(prefix="umbp-fleet-")
    fleet = Fleet(cfg, directory)
    try:
        result = fleet.run()
    except BaseException:
        fleet.close()
        print(f"node and indexer logs are in {directory}", file=sys.stderr)
        raise
    fleet.close()
    result["dir"] = directory
    if not cfg.dir and not cfg.keep:
        shutil.rmtree(directory, ignore_errors=True)
    return result


def print_report(result: dict, notes: list[str], out=sys.stdout) -> None:
    cols = ["step", "node", "held", "ours_announced", "ours_phantom", "ours_missing"]
    if any("dynamo_announced" in r for r in result["rows"]):
        cols += ["dynamo_announced", "dynamo_phantom", "dynamo_missing", "dynamo_wait_s"]
    width = {c: max(len(c), *(len(str(r.get(c, ""))) for r in result["rows"])) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols), file=out)
    for r in result["rows"]:
        print("  ".join(str(r.get(c, "")).ljust(width[c]) for c in cols), file=out)
    print(f"query of B's conversation ({result['query']['prompt_tokens']} tokens): {json.dumps(result['query'])}", file=out)
    for n, s in result["stats"].items():
        keep = ("evictions", "deletes", "stored_pages", "removed_pages", "reannounced_pages", "reannounced_removed",
                "replays", "skipped_no_tokens", "dropped", "dropped_pages", "record_errors", "ours_replays",
                "ours_unfilled_gaps")  # fmt: skip
        print(f"node {n} (its last run): " + ", ".join(f"{k} {s[k]}" for k in keep if k in s), file=out)
    if "exercised" in result:
        print("exercised: " + ", ".join(f"{k} {v}" for k, v in result["exercised"].items()), file=out)
    for line in notes:
        print(f"note: {line}", file=out)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="umbp-nvme bench fleet", description="Two nodes, their DISK KV events, and "
                                "what a router believes about them (docs/fleet.md).",
                                epilog="Install Dynamo's indexer with tools/install_dynamo.sh VENV.")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="the small scenario (a few seconds)")
    p.add_argument("--dynamo-python", metavar="PYTHON", default=os.environ.get("UMBP_DYNAMO_PYTHON", ""),
                   help="an interpreter that imports dynamo.indexer (ai-dynamo-runtime); default $UMBP_DYNAMO_PYTHON")
    p.add_argument("--dir", help="where the two stores go (default: a temporary directory, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (stores and logs)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    p.add_argument("--plot", help=argparse.SUPPRESS)  # accepted for `umbp-nvme bench --plot`; nothing to plot
    o = p.add_argument_group("--overhead: what the events cost put and get through the backend (events_cost.py)")
    o.add_argument("--overhead", action="store_true", help="measure events on vs off instead of the fleet run")
    o.add_argument("--rounds", type=int, help="alternating rounds per side (default 7; --quick 5)")
    o.add_argument("--objects", default="16k,256k", help="K/V object sizes (default 16k,256k)")
    o.add_argument("--calls", type=int, help="batch_set_v1 calls of 128 pages per round (default 4; --quick 2)")
    o.add_argument("--durability", default="relaxed", choices=("relaxed", "strict"))
    o.add_argument("--evicting", action="store_true", help="a full store: every round's puts evict (BlockRemoved)")
    return p.parse_args(argv)


def overhead(cfg) -> int:
    from .common import WorkDir, finish, parse_bytes, print_table
    from .events_cost import measure, targets

    rounds, calls = cfg.rounds or (5 if cfg.quick else 7), cfg.calls or (2 if cfg.quick else 4)
    work = WorkDir(cfg, os.path.join(tempfile.gettempdir(), "umbp-bench-events"), "umbp-events-", "bench fleet --overhead")
    try:
        rows = measure(work.path, [parse_bytes(x) for x in cfg.objects.split(",")], rounds, calls, cfg.durability,
                       cfg.evicting)  # fmt: skip
    finally:
        work.cleanup()
    print(f"events on vs off through the backend: {rounds} alternating rounds of {calls} x 128 pages per side"
          + (", the store full (every put evicts)" if cfg.evicting else ""))
    print_table(rows, ratio_keys=("vs_events_off",))
    cfg.plot = None
    finish(cfg, rows, [], targets=targets(rows), source="issue 27")
    return 0


def main(argv=None) -> int:
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    if cfg.overhead:
        return overhead(cfg)
    notes = []
    if cfg.dynamo_python:
        from .fleet_dynamo import available

        why = available(cfg.dynamo_python)
        if why:
            notes.append(f"Dynamo's indexer not run: {why}")
            cfg.dynamo_python = ""
    else:
        notes.append("Dynamo's indexer not run: no --dynamo-python (tools/install_dynamo.sh)")
    t0 = time.perf_counter()
    result = run(cfg)
    print(f"fleet benchmark: 2 nodes, {len(result['rows']) // 2} steps, {time.perf_counter() - t0:.0f} s")
    bad = failures(result)
    print_report(result, notes + [f"FAILED: {b}" for b in bad])
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump({**result, "notes": notes, "failures": bad}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
