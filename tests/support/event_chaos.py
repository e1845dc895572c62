"""The KV-event part of tools/chaos_report.py: a subscriber's DISK view against the store after
event-queue drops, restarts (clean and SIGKILL) and lost drives (issue 34).

A node is `bench fleet`'s (umbp_nvme/bench/fleet_node.py: a backend process over three drives,
publishing DISK events, fed by a stand-in engine in relay mode) and the subscriber is ours
(umbp_nvme/bench/fleet_sub.py: SUB + replay on every gap, its tally kept across restarts). The
event queue holds one item, so bursts of puts and per-page deletes drop events all the time.
Each cycle: start the node (its drives as the last cycle left them), check, back up and delete
at random, check, then stop it (clean, or every other time without the relay SIGKILL while a
backup runs) and, in turn, remove a drive from the roots, wipe one, bring a removed one back
(behind: cleared at open), make one fail to open, shrink the capacity, or leave them. A check waits for the node's events to be out and the
subscriber to have applied them, then counts ``phantom_pages`` (the subscriber believes the
store holds them; it does not) and ``missing_pages`` (the store holds them; the subscriber does
not know), over every page key ever backed up.

Kills run in the sequence without the relay: with it, a page put and not yet announced when the
process dies has no token ids after the restart and is, by design, not announced (Dynamo drops
a DISK event without them; docs/fleet.md), which this count would call missing.
"""

from __future__ import annotations

import os
import random
import shutil
import time

from umbp_nvme.bench.fleet import NodeProc, free_ports
from umbp_nvme.bench.fleet_sub import DiskTally

SETTLE_S = 60.0  # a hang guard for the subscriber catching up, not a bound
CAPACITY = 24 << 20  # over 3 drives: 8 MiB each, 64 pages of 2 x 64 KiB: backups evict
SHRUNK = 18 << 20
DRIVE_EVENTS = ("remove", "wipe", "return", "unopenable", "shrink", "none")  # in turn, from a random start


class Sequence:
    """One node and our subscriber, cycle after cycle."""

    def __init__(self, directory: str, relay: bool, rng: random.Random, log, backups: tuple[int, int] = (3, 6)):
        import zmq

        self.dir, self.relay, self.rng, self.log, self.backups = directory, relay, rng, log, backups
        self.roots = [os.path.join(directory, p, f"d{i}") for i, p in enumerate("abc")]
        self.active = list(self.roots)  # the roots the next start gets
        self.unopenable: str | None = None  # a root whose parent is a file for one cycle
        self.convs: list[tuple[str, int]] = []  # every conversation backed up: (name, pages)
        self.last_held: set[int] = set()  # what the store held at the last check
        os.makedirs(directory, exist_ok=True)
        self.node = NodeProc("A", directory, free_ports(3), CAPACITY, directory, list(self.roots), relay=relay,
                             queue_max=1, start=False)  # fmt: skip
        self.turn = rng.randrange(len(DRIVE_EVENTS))
        self.ctx = zmq.Context()
        self.sub = DiskTally(self.ctx, self.node.endpoint, self.node.replay_endpoint)
        self.out = {"cycles": 0, "restarts": 0, "kills": 0, "checks": 0, "phantom_pages": 0, "missing_pages": 0,
                    "event_queue_drops": 0, "dropped_pages": 0, "lost_drive_events": {}, "pages_lost_at_open": 0,
                    "reannounced_removed": 0, "held_max": 0, "errors": []}  # fmt: skip

    def cycle(self, last: bool) -> None:
        n, rng = self.node, self.rng
        n.start(roots=self.active)
        self.out["cycles"] += 1
        if self.out["cycles"] > 1:
            self.out["restarts"] += 1
            self.out["pages_lost_at_open"] += len(self.last_held - n.held())
        self.check("after the start")
        for c in range(rng.randint(*self.backups)):
            conv, pages = f"c{self.out['cycles']}-{c}", rng.randint(4, 12)
            n.backup(conv, pages)
            self.convs.append((conv, pages))
            if rng.random() < 0.8:  # a burst of per-page deletes: removal events, most of them dropped
                n.call("delete", conv=conv, pages=pages, first=rng.randint(1, pages - 1), each=True)
            if rng.random() < 0.4:  # pages of an older conversation (maybe evicted or lost already)
                old, opages = rng.choice(self.convs)
                n.call("delete", conv=old, pages=opages, first=rng.randint(0, opages - 1), each=True)
        self.check("after backups and deletes")
        if last:
            n.stop()
        elif not self.relay and self.out["cycles"] % 2:
            conv = f"k{self.out['cycles']}"
            n.keys.update(dict.fromkeys(_keys(conv, 12)))
            self.convs.append((conv, 12))
            n.kill(op={"op": "backup", "conv": conv, "pages": 12})
            self.out["kills"] += 1
        else:
            n.stop()
        self.out["event_queue_drops"] += n.runs[-1].get("dropped", 0)
        self.out["dropped_pages"] += n.runs[-1].get("dropped_pages", 0)
        self.out["reannounced_removed"] += n.runs[-1].get("reannounced_removed", 0)
        if not last:
            self.lose_a_drive()

    def lose_a_drive(self) -> None:
        """What happens to the drives before the next start (at random, or nothing)."""
        rng = self.rng
        if self.unopenable is not None:  # its parent directory comes back
            parent = os.path.dirname(self.unopenable)
            os.unlink(parent)
            os.rename(parent + "-unplugged", parent)
            self.unopenable = None
        if self.node.capacity_bytes != CAPACITY and rng.random() < 0.5:
            self.node.capacity_bytes = CAPACITY
        what = DRIVE_EVENTS[self.turn % len(DRIVE_EVENTS)]
        self.turn += 1
        absent = [r for r in self.roots if r not in self.active]
        if what == "remove" and len(self.active) > 1:
            self.active.remove(rng.choice(self.active))
        elif what == "return" and absent:
            back = rng.choice(absent)  # it missed sessions that wrote: cleared at open before it serves
            self.active = [r for r in self.roots if r in self.active or r == back]
        elif what == "wipe":
            victim = rng.choice(self.active)
            shutil.rmtree(victim, ignore_errors=True)
            os.makedirs(victim)
        elif what == "unopenable" and len(self.active) > 1:
            victim = rng.choice(self.active)
            parent = os.path.dirname(victim)
            os.rename(parent, parent + "-unplugged")
            with open(parent, "w") as f:
                f.write("not a directory")
            self.unopenable = victim
        elif what == "shrink":
            self.node.capacity_bytes = SHRUNK
        else:
            what = "none"
        self.out["lost_drive_events"][what] = self.out["lost_drive_events"].get(what, 0) + 1

    def check(self, when: str) -> None:
        n = self.node
        last = n.call("sync")["last_seq"]
        if last is not None and not self.sub.pump(until_seq=last, timeout_s=SETTLE_S):
            self.out["errors"].append(f"cycle {self.out['cycles']} {when}: the subscriber did not reach {last}")
            return
        held = self.last_held = n.held()
        phantom, missing = len(self.sub.blocks - held), len(held - self.sub.blocks)
        self.out["checks"] += 1
        self.out["phantom_pages"] += phantom
        self.out["missing_pages"] += missing
        self.out["held_max"] = max(self.out["held_max"], len(held))
        if phantom or missing:
            self.log(f"events: cycle {self.out['cycles']} {when}: phantom {phantom}, missing {missing}")
            self.out["errors"].append(f"cycle {self.out['cycles']} {when}: phantom {phantom}, missing {missing}")

    def close(self) -> None:
        self.node.stop()
        self.sub.close()
        self.ctx.term()
        if self.unopenable is not None:
            parent = os.path.dirname(self.unopenable)
            os.unlink(parent)
            os.rename(parent + "-unplugged", parent)


def _keys(conv: str, pages: int) -> list[str]:
    from umbp_nvme.bench.fleet_node import conversation

    return conversation(conv, pages)[1]


def event_run(directory: str, *, restarts: int, backups: tuple[int, int] = (3, 6), seed: int = 0,
              log=lambda s: None) -> dict:  # fmt: skip
    """``restarts`` restarts in all, split over a relay-mode sequence (clean restarts) and one
    without the relay (clean restarts and kills), ``backups`` (min, max) conversations backed up
    per cycle; the figures summed."""
    t0 = time.monotonic()
    os.environ.setdefault("UMBP_NVME_NO_SGLANG", "1")  # the nodes start in a second, sglang not imported
    rng = random.Random(seed)
    total: dict = {}
    relay_restarts = restarts // 2
    for relay, n in ((True, relay_restarts), (False, restarts - relay_restarts)):
        seq = Sequence(os.path.join(directory, "relay" if relay else "plain"), relay, rng, log, backups)
        try:
            for i in range(n + 1):
                seq.cycle(last=i == n)
        except Exception as e:  # noqa: BLE001 - reported, with the node's log
            seq.out["errors"].append(f"{'relay' if relay else 'plain'}: {e!r}")
        finally:
            seq.close()
        for k, v in seq.out.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    total.setdefault(k, {})[kk] = total.get(k, {}).get(kk, 0) + vv
            else:
                total[k] = total.get(k, [] if isinstance(v, list) else 0) + v
    total["seconds"] = round(time.monotonic() - t0, 1)
    return total
