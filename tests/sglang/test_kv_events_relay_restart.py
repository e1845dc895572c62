"""Relay mode, a worker's new life: a router that kept the worker registered holds only what it holds now.

A restarted scheduler publishes its start-up ``AllBlocksCleared`` (sequence 0) before our relay
subscribes, so the relay never forwards it; a router that keeps the crashed worker registered (a
restart inside its lease) would keep the old GPU and CPU blocks (found with ``bench server
--kv-events --crash``, which unregistered the worker and hid it). The publisher's first start in a
process sends its own clear, then re-announces DISK. The router here is fleet_sub's (SUB, replay
on a gap, every tier, as Dynamo's indexer does), and Dynamo's own indexer when it is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import zmq

W = pytest.importorskip("sglang.srt.disaggregation.kv_events")
sglang_hash = pytest.importorskip("sglang.srt.mem_cache.utils").hash_str_to_int64

from test_kv_events import PAGE, held, keys_of, open_backend, put  # noqa: E402

from umbp_nvme.bench.fleet import free_ports  # noqa: E402
from umbp_nvme.bench.server_events import DYNAMO_TIER, TierTally  # noqa: E402
WORKER = 1


def dynamo_python() -> str | None:
    from umbp_nvme.bench.fleet_dynamo import available

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    py = os.environ.get("UMBP_DYNAMO_PYTHON") or os.path.join(root, ".venv-dynamo", "bin", "python")
    return None if available(py) else py


class Node:
    """One worker: an engine PUB (sglang's publisher) and our backend relaying it, on fixed ports."""

    def __init__(self, tmp_path, ports=None):
        self.tmp_path, self.ports = tmp_path, ports or free_ports(4)
        self.engine_port, relay, replay, self.dynamo_port = self.ports
        self.endpoint, self.replay = f"tcp://127.0.0.1:{relay}", f"tcp://127.0.0.1:{replay}"
        self.extra = {"kv_events_endpoint": f"tcp://*:{relay}", "kv_events_replay_endpoint": self.replay,
                      "kv_events_engine_endpoint": f"tcp://127.0.0.1:{self.engine_port}"}  # fmt: skip
        self.engine = self.be = None
        self._marks = 0

    def start_engine(self):
        """A scheduler's start: its radix tree reset is an AllBlocksCleared nobody relays yet."""
        self.engine = W.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://*:{self.engine_port}")
        self.publish([W.AllBlocksCleared()])

    def open(self):
        self.be = open_backend(self.tmp_path, **self.extra)
        relay = self.be.publisher.relay
        seen = relay.stats["engine_frames"]
        while relay.stats["engine_frames"] == seen:  # the relay is subscribed once a marker comes through
            self._marks += 1
            self.publish([W.BlockRemoved(block_hashes=[sglang_hash(keys_of(1, f"marker-{self._marks}")[0])], medium="GPU")])
            time.sleep(0.05)

    def publish(self, events):
        self.engine.publish(W.KVEventBatch(ts=0.0, events=events))

    def store_blocks(self, keys, medium, base=0):
        """The engine's BlockStored of ``keys`` as one chain, with token ids (Dynamo needs them)."""
        self.publish([W.BlockStored(block_hashes=[sglang_hash(k) for k in keys], parent_block_hash=None,
                                    token_ids=[base + t for t in range(len(keys) * PAGE)], block_size=PAGE,
                                    lora_id=None, medium=medium)])  # fmt: skip

    def crash(self):
        """Both die without a word to the router (the backend's close sends no clear either)."""
        self.be.close()
        self.engine.shutdown()


# The worker's next life, in a process of its own (as after a crash): the engine starts (its clear
# lost), the backend opens on the same store, the engine stores NEW; then it waits for the word to die.
NEXT_LIFE = """
import json, pathlib, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from test_kv_events_relay_restart import Node, keys_of, held, OLD, NEW
n = Node(pathlib.Path(sys.argv[3]), json.loads(sys.argv[4]))
n.start_engine()
n.open()
n.store_blocks(keys_of(NEW, "new"), "GPU", base=5000)
pub = n.be.publisher
assert pub.flush(60)
print(json.dumps({"last_seq": pub.last_seq, "stats": pub.stats, "held": held(n.be, keys_of(OLD, "old"))}), flush=True)
sys.stdin.readline()
n.crash()
"""
OLD, NEW = 3, 4


def next_life(n: Node):
    here = os.path.dirname(os.path.abspath(__file__))
    child = subprocess.Popen([sys.executable, "-c", NEXT_LIFE, here, os.path.dirname(here), str(n.tmp_path),
                              json.dumps(n.ports)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    line = child.stdout.readline()
    if not line:
        child.wait(60)
        pytest.fail(f"the next life's process ended with {child.returncode} before it published")
    return child, json.loads(line)


def converge(router, indexer, pub, truth: dict, last_seq=None) -> tuple[dict, dict]:
    """What the router and Dynamo hold per tier once ours caught up with everything sent."""
    if pub is not None:
        assert pub.flush(60)
        last_seq = pub.last_seq
    assert router.pump(until_seq=last_seq, timeout_s=60)
    ours = {m: set(router.tiers[m]) for m in truth}
    dyn: dict = {}
    deadline = time.monotonic() + 30
    while indexer is not None:
        dyn = {m: {h if h < 1 << 63 else h - (1 << 64) for h in indexer.blocks(t).get(WORKER, set())}
               for m, t in DYNAMO_TIER.items()}  # fmt: skip
        if dyn == truth or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return ours, dyn


def phantom_missing(got: dict, truth: dict) -> tuple[int, int]:
    return sum(len(got[m] - truth[m]) for m in truth), sum(len(truth[m] - got[m]) for m in truth)


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    py = dynamo_python()
    indexer = None
    if py:
        from umbp_nvme.bench.fleet_dynamo import Indexer

        indexer = Indexer(py, n.dynamo_port, str(tmp_path / "dynamo.log"), "m", PAGE)
    ctx = zmq.Context()
    router = TierTally(ctx, n.endpoint, n.replay)
    try:
        yield n, router, indexer
    finally:
        router.close()
        ctx.term()
        if indexer is not None:
            indexer.close()
        if n.be is not None:
            n.be.close()
        if n.engine is not None:
            n.engine.shutdown()


def test_a_restart_in_the_routers_lease_leaves_no_phantom_engine_block(node):
    n, router, indexer = node
    n.start_engine()
    n.open()
    if indexer is not None:
        indexer.register(WORKER, n.endpoint, n.replay)
    old, old_gpu_only, new = keys_of(OLD, "old"), keys_of(2, "old-gpu"), keys_of(NEW, "new")
    n.store_blocks(old + old_gpu_only, "GPU")
    n.store_blocks(old, "CPU_PINNED", base=1000)
    assert put(n.be, old) == [True] * 3  # on DISK with the engine's tokens
    disk = {sglang_hash(k) for k in old}
    before = {"GPU": {sglang_hash(k) for k in old + old_gpu_only}, "CPU_PINNED": disk, "DISK": disk}
    ours, dyn = converge(router, indexer, n.be.publisher, before)
    assert ours == before and (indexer is None or dyn == before)  # the router learnt the first life

    n.crash()
    n.be = n.engine = None
    child, got = next_life(n)
    try:
        assert got["held"] == [True] * OLD  # the store kept its pages across the crash
        truth = {"GPU": {sglang_hash(k) for k in new}, "CPU_PINNED": set(), "DISK": disk}
        ours, dyn = converge(router, indexer, None, truth, got["last_seq"])
        assert phantom_missing(ours, truth) == (0, 0), ours
        stats = got["stats"]
        assert stats["start_clears"] == 1 and stats["start_clears_skipped"] == 0 and stats["reannounced_pages"] == OLD
        assert router.stats["unfilled_gaps"] == 0
        if indexer is not None:
            assert phantom_missing(dyn, truth) == (0, 0), (dyn, indexer.log_tail())
    finally:
        child.communicate("die\n", timeout=60)
    assert child.returncode == 0


def test_publishing_restarted_in_the_same_process_sends_no_clear(node):
    """set_kv_events(True) mid-life: the engine still holds its blocks, so the router keeps them."""
    n, router, indexer = node
    n.start_engine()
    n.open()
    if indexer is not None:
        indexer.register(WORKER, n.endpoint, n.replay)
    assert n.be.publisher.stats["start_clears"] == 1  # the first start here
    keys = keys_of(3, "mid")
    n.store_blocks(keys, "GPU")
    assert put(n.be, keys) == [True] * 3
    hashes = {sglang_hash(k) for k in keys}
    truth = {"GPU": hashes, "CPU_PINNED": set(), "DISK": hashes}
    assert converge(router, indexer, n.be.publisher, truth)[0] == truth
    cleared = router.stats["cleared"]

    assert n.be.set_kv_events(False) is False and n.be.set_kv_events(True) is True
    pub = n.be.publisher
    assert pub.stats["start_clears"] == 0 and pub.stats["start_clears_skipped"] == 1
    ours, dyn = converge(router, indexer, pub, truth)
    assert ours == truth and router.stats["cleared"] == cleared  # no clear: the GPU blocks stay known
    assert pub.stats["reannounced_pages"] == 3
    if indexer is not None:
        assert dyn == truth, indexer.log_tail()


@pytest.mark.parametrize("prefer_sglang", [True, False])
def test_the_start_clear_is_sglangs_all_blocks_cleared_byte_for_byte(prefer_sglang):
    import msgspec

    from umbp_nvme.sglang.kv_events import Encoder

    payload = Encoder(PAGE, dp_rank=2, prefer_sglang=prefer_sglang).encode_clear()
    ts, events, dp = msgspec.msgpack.decode(payload)
    assert events == [{"type": "AllBlocksCleared"}] and dp == 2
    theirs = W.KVEventBatch(ts=ts, events=[W.AllBlocksCleared()], attn_dp_rank=2)
    assert payload == msgspec.msgpack.encode(theirs)
