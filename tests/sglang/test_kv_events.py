"""DISK-tier KV events (issue 27): what a real ZMQ subscriber on localhost receives from the backend.

Every test drives UMBPNvmeStore through its SGLang calls (batch_set_v1 with prefix keys, clear,
close and reopen) and the store's own drops (eviction, delete, a bad CRC), and reads the frames a
SUB socket gets: ``[topic, 8-byte sequence, msgpack KVEventBatch]``. Hashes are checked against
the values SGLang's own ``hash_str_to_int64`` gives for the page keys.
"""

from __future__ import annotations

import hashlib
import socket
import threading

import msgspec
import numpy as np
import pytest
import zmq

from conftest import damage_object
from support.kv_sub import Sub, removed_hashes, stored, stored_hashes
from support.standin_pools import PAGE, Config, FakeMHAPool
from umbp_nvme.metrics import samples_from_stats
from umbp_nvme.sglang.backend import HiCacheStorageExtraInfo, UMBPNvmeStore

wheel_utils = pytest.importorskip("sglang.srt.mem_cache.utils")
sglang_hash = wheel_utils.hash_str_to_int64

OBJ = 64 << 10  # token_bytes 16 KiB x PAGE 4 = one 64 KiB object per K and per V


def keys_of(n, salt):
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def idx(pages):
    return np.arange(pages * PAGE, dtype=np.int64)


def open_backend(tmp_path, pool=None, *, name="s", **extra):
    cfg = Config(str(tmp_path / name))
    cfg.extra_config.update({"kv_events_endpoint": f"ipc://{tmp_path}/ev", "kv_events_replay_endpoint": f"ipc://{tmp_path}/replay"})
    cfg.extra_config.update(extra)
    be = UMBPNvmeStore(cfg, {})
    be.register_mem_pool_host(pool or FakeMHAPool(pages=16, token_bytes=OBJ // PAGE))
    return be


@pytest.fixture
def node(tmp_path):
    be = open_backend(tmp_path)
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    sub.sync()
    yield be, sub
    sub.close()
    be.close()


def put(be, keys, prefix=None):
    info = HiCacheStorageExtraInfo(prefix_keys=prefix) if prefix is not None else None
    return be.batch_set_v1(keys, idx(len(keys)), info)


def held(be, keys):
    return [be.batch_exists([k]) == 1 for k in keys]


def test_a_durable_page_is_announced_with_sglangs_hash_of_its_key_and_its_parents(node):
    be, sub = node
    keys = keys_of(5, "p")
    prefix = keys_of(3, "before")
    assert put(be, keys[:3], prefix) == [True] * 3
    assert put(be, keys[3:], prefix + keys[:3]) == [True] * 2
    frames = sub.upto_now()
    events = stored(frames)
    assert [h for e in events for h in e["block_hashes"]] == [sglang_hash(k) for k in keys]
    # one chain: the first page's parent is the last prefix key, each later page's the page before it
    assert events[0]["parent_block_hash"] == sglang_hash(prefix[-1])
    assert all(e["medium"] == "DISK" and e["block_size"] == PAGE and e["lora_id"] is None for e in events)
    for e in events[1:]:
        assert e["parent_block_hash"] in {sglang_hash(k) for k in keys}
    assert removed_hashes(frames) == []


def test_sequence_numbers_increase_by_one_per_batch(node):
    be, sub = node
    for i in range(4):
        put(be, keys_of(2, f"s{i}"))
        sub.upto_now()
    seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
    assert len(seqs) >= 4  # a put's pages and a marker may share a batch
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


class HalfRefusedPool(FakeMHAPool):
    """Page 1's V object points outside every registered range: the store refuses that object."""

    stray = np.zeros(OBJ, np.uint8)

    def get_page_buffer_meta(self, indices):
        ptrs, sizes = super().get_page_buffer_meta(indices)
        ptrs[3] = self.stray.ctypes.data
        return ptrs, sizes


def test_a_failed_put_announces_nothing_and_its_half_page_is_never_removed(tmp_path):
    be = open_backend(tmp_path, HalfRefusedPool(pages=16, token_bytes=OBJ // PAGE))
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()
        keys = keys_of(3, "f")
        assert put(be, keys) == [True, False, True]
        assert be.store.exists_many([keys[1] + be.v1_suffixes[0]]) == [True]  # its K landed alone
        frames = sub.upto_now()
        assert stored_hashes(frames) == [sglang_hash(keys[0]), sglang_hash(keys[2])]
        be.clear()
        assert sorted(removed_hashes(sub.upto_now())) == sorted([sglang_hash(keys[0]), sglang_hash(keys[2])])
    finally:
        sub.close()
        be.close()


def test_a_put_that_fails_whole_publishes_no_frame(node):
    be, sub = node
    assert be.batch_set_v1(keys_of(2, "bad"), idx(3)) == [False, False]  # index count mismatch
    assert sub.upto_now() == []


def test_eviction_removes_exactly_the_pages_that_left(node):
    be, sub = node
    keys = []
    for b in range(20):  # 20 x 8 pages of 128 KiB into a 16 MiB store: eviction runs
        ks = keys_of(8, f"e{b}")
        assert put(be, ks) == [True] * 8
        keys += ks
    frames = sub.upto_now()
    assert be.store_stats()["store"]["evictions"] > 0
    removed = removed_hashes(frames)
    assert len(removed) == len(set(removed))  # each page once, though both its objects went
    on_disk = {sglang_hash(k) for k, h in zip(keys, held(be, keys)) if h}
    announced = set(stored_hashes(frames))
    # admission may decline a page (its put answers True, nothing stored, nothing announced)
    assert on_disk <= announced <= {sglang_hash(k) for k in keys}
    assert set(removed) == announced - on_disk
    assert len(on_disk) < len(keys)


def test_deleting_one_object_removes_its_page_once(node):
    be, sub = node
    keys = keys_of(3, "d")
    put(be, keys)
    sub.upto_now()
    k_sfx, v_sfx = be.v1_suffixes
    assert be.store.delete_many([keys[1] + v_sfx]) == [True]
    assert removed_hashes(sub.upto_now()) == [sglang_hash(keys[1])]
    assert be.store.delete_many([keys[1] + k_sfx]) == [True]  # the page was already gone
    assert sub.upto_now() == []


def test_a_page_dropped_for_a_bad_crc_is_removed(node):
    be, sub = node
    keys = keys_of(2, "c")
    put(be, keys)
    be.flush()
    sub.upto_now()
    page_store = be.store.store
    damage_object(page_store.path, page_store, keys[0] + be.v1_suffixes[1], 100, b"\x00\xff\x00\xff")
    assert be.batch_get_v1(keys, idx(2)) == [False, True]
    assert removed_hashes(sub.upto_now()) == [sglang_hash(keys[0])]


def test_clear_removes_every_page_one_by_one_and_never_clears_all_tiers(node):
    be, sub = node
    keys = keys_of(6, "x")
    put(be, keys)
    sub.upto_now()
    be.clear()
    frames = sub.upto_now()
    assert sorted(removed_hashes(frames)) == sorted(sglang_hash(k) for k in keys)
    assert all(e["type"] != "AllBlocksCleared" for _, _, evs, _ in frames for e in evs)


def replay(endpoint, start_seq):
    """A DEALER's replay request, as Dynamo's indexer sends it: frames until the end marker."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 60_000)
    s.connect(endpoint)
    s.send_multipart((b"", start_seq.to_bytes(8, "big")))
    out = []
    while True:
        _, topic, seq, payload = s.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        out.append((topic, seq, payload))
    s.close(linger=0)
    ctx.term()
    return out


def test_replay_returns_the_live_frames_from_the_asked_sequence(node, tmp_path):
    be, sub = node
    for i in range(3):
        put(be, keys_of(2, f"r{i}"))
        sub.upto_now()
    live = [tuple(f) for f in sub.frames]
    start = int.from_bytes(live[2][1], "big")
    assert replay(f"ipc://{tmp_path}/replay", start) == live[2:]


def test_a_reopened_store_announces_what_it_holds_above_the_old_sequence(tmp_path):
    keys = keys_of(5, "o")
    be = open_backend(tmp_path)
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    sub.sync()
    put(be, keys)
    be.store.delete_many([keys[4] + be.v1_suffixes[0]])
    sub.upto_now()
    last = int.from_bytes(sub.frames[-1][1], "big")
    sub.close()
    be.close()

    be = open_backend(tmp_path)
    try:
        assert be.publisher.flush(60)
        # what a subscriber that saw `last` asks for once it sees the next sequence
        frames = replay(f"ipc://{tmp_path}/replay", last + 1)
        assert frames and int.from_bytes(frames[0][1], "big") > last
        dec = msgspec.msgpack.Decoder()
        hashes = [h for *_, p in frames for e in dec.decode(p)[1] if e["type"] == "BlockStored" for h in e["block_hashes"]]
        assert sorted(hashes) == sorted(sglang_hash(k) for k in keys[:4])
    finally:
        be.close()


def test_a_full_queue_drops_and_counts_and_never_blocks_a_batch_set(tmp_path):
    be = open_backend(tmp_path, kv_events_queue_max=1)
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    pub = be.publisher
    try:
        sub.sync()
        gate = threading.Event()
        events = pub.encoder.events

        def held_back(items):
            gate.wait()
            return events(items)

        pub.encoder.events = held_back  # the thread is stuck: nothing leaves the queue
        keys = []
        for b in range(6):
            ks = keys_of(2, f"q{b}")
            keys += ks
            assert put(be, ks) == [True, True]  # returns although the queue is full
        assert pub.stats["dropped"] >= 4
        dropped = be.store_stats()["store"]["kv_events_dropped"]
        assert dropped == pub.stats["dropped_pages"] >= 8
        assert ("umbp_nvme_kv_events_dropped", "counter", {}, float(dropped)) in samples_from_stats(be.store_stats()["store"])
        gate.set()
        assert pub.flush(60)  # the queue drains, then the re-announcement goes out
        # the drops schedule a re-announcement of what the store holds
        assert set(keys) <= {p for p, _, _ in be.residency.snapshot()}
        announced = set(stored_hashes(sub.upto_now()))
        assert {sglang_hash(k) for k in keys} <= announced
    finally:
        sub.close()
        be.close()


def free_port_pair():
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", p + 1))
                    return p
            except OSError:
                continue


def test_a_dp_rank_publishes_on_the_base_port_plus_its_rank(tmp_path):
    base = free_port_pair()
    cfg = Config(str(tmp_path / "s"), dp_rank=1)
    cfg.extra_config.update(kv_events_endpoint=f"tcp://*:{base}", kv_events_topic="node-a")
    be = UMBPNvmeStore(cfg, {})
    be.register_mem_pool_host(FakeMHAPool(pages=16, token_bytes=OBJ // PAGE))
    sub = Sub(f"tcp://127.0.0.1:{base + 1}", be.publisher, topic=b"node-a")
    try:
        sub.sync()
        put(be, keys_of(1, "dp"))
        frames = sub.upto_now()
        assert stored_hashes(frames) == [sglang_hash(keys_of(1, "dp")[0])]
        assert {dp for *_, dp in frames} == {1}
    finally:
        sub.close()
        be.close()


def test_only_tp_rank_0_publishes_for_an_mha_tp_group(tmp_path):
    """MHA with TP > 1: each rank stores its own heads; TP rank 0's store stands for the group
    (docs/fleet.md), so one publisher per KV cache, as SGLang's own."""
    made = []
    try:
        for rank in (0, 1):
            cfg = Config(str(tmp_path / "s"), tp_rank=rank, tp_size=2)
            cfg.extra_config.update(kv_events_endpoint=f"ipc://{tmp_path}/ev")
            be = UMBPNvmeStore(cfg, {})
            be.register_mem_pool_host(FakeMHAPool(pages=16, token_bytes=OBJ // PAGE))
            made.append(be)
        assert made[0].publisher is not None and made[0].residency is not None
        assert made[1].publisher is None and made[1].residency is None
        assert made[1].store.store.residency is None
    finally:
        for be in made:
            be.close()


def test_events_are_off_without_an_endpoint(tmp_path):
    be = UMBPNvmeStore(Config(str(tmp_path / "s")), {})
    be.register_mem_pool_host(FakeMHAPool(pages=16, token_bytes=OBJ // PAGE))
    try:
        assert be.publisher is None and be.store.store.residency is None
        assert put(be, keys_of(2, "off")) == [True, True]
    finally:
        be.close()


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("kv_events_endpoint", "localhost:5557", "must be a ZMQ endpoint"),
        ("kv_events_endpoint", "tcp://*:0", "must end in a port 1..65535"),
        ("kv_events_queue_max", 0, "must be a positive integer"),
        ("kv_events_replay_endpoint", 5558, "must be a ZMQ endpoint"),
    ],
)
def test_a_malformed_events_setting_is_refused_naming_the_key(tmp_path, key, value, match):
    cfg = Config(str(tmp_path / "s"))
    cfg.extra_config.update({"kv_events_endpoint": "tcp://*:5557", key: value})
    with pytest.raises(ValueError, match=rf"extra_config\['{key}'\] {match}"):
        UMBPNvmeStore(cfg, {})


def test_the_engines_stream_is_relayed_and_gives_disk_pages_their_token_ids(tmp_path):
    """kv_events_engine_endpoint: the scheduler's own publisher (sglang's ZmqEventPublisher) feeds
    us; a router on our endpoint sees its GPU events forwarded and our DISK pages with the tokens
    the engine announced for the same hashes. A page the engine never announced (a namespaced
    hash) is not announced on DISK."""
    W = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    engine = W.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"ipc://{tmp_path}/engine")
    be = open_backend(tmp_path, kv_events_engine_endpoint=f"ipc://{tmp_path}/engine")
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()

        def gpu_removed(page):
            engine.publish(W.KVEventBatch(ts=0.0, events=[W.BlockRemoved(block_hashes=[sglang_hash(page)], medium="GPU")]))

        sub.sync_engine(gpu_removed)
        keys = keys_of(3, "tok")
        tokens = [[100 * i + t for t in range(PAGE)] for i in range(2)]  # pages 0 and 1; page 2 unknown
        engine.publish(W.KVEventBatch(ts=0.0, events=[W.BlockStored(
            block_hashes=[sglang_hash(keys[0]), sglang_hash(keys[1])], parent_block_hash=None,
            token_ids=tokens[0] + tokens[1], block_size=PAGE, lora_id=None, medium="GPU")]))  # fmt: skip
        gpu = []
        while not gpu:
            gpu = [e for e in stored(sub.upto_now()) if e["medium"] == "GPU"]
        assert gpu[0]["block_hashes"] == [sglang_hash(keys[0]), sglang_hash(keys[1])]
        assert put(be, keys) == [True] * 3
        assert be.publisher.flush(60)  # page 2 waits for its tokens, then is skipped
        disk = [e for e in stored(sub.upto_now()) if e["medium"] == "DISK"]
        assert [h for e in disk for h in e["block_hashes"]] == [sglang_hash(keys[0]), sglang_hash(keys[1])]
        assert [t for e in disk for t in e["token_ids"]] == tokens[0] + tokens[1]
        assert be.publisher.stats["skipped_no_tokens"] == 1
        seqs = [int.from_bytes(f[1], "big") for f in sub.frames]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # one ordered stream for both sources
    finally:
        sub.close()
        be.close()
        engine.shutdown()


def test_a_store_over_two_drives_announces_and_removes_each_page_once(tmp_path):
    import json

    roots = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    be = open_backend(tmp_path, ssd_storage_dir=json.dumps(roots))
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        assert len([s for s in be.store.store.stores if s is not None and s.residency is be.residency]) == 2
        sub.sync()
        keys = keys_of(8, "two")
        assert put(be, keys) == [True] * 8
        assert sorted(stored_hashes(sub.upto_now())) == sorted(sglang_hash(k) for k in keys)
        be.clear()
        assert sorted(removed_hashes(sub.upto_now())) == sorted(sglang_hash(k) for k in keys)
    finally:
        sub.close()
        be.close()
