"""Relay mode: the engine's ``AllBlocksCleared`` (SGLang's ``/flush_cache``: radix tree and host
pool reset, L3 kept) is forwarded, and the DISK pages the store still holds are announced again
after it: a router wipes every tier of the worker on that event (Dynamo 1.6.1), DISK included,
and would otherwise believe the store empty (found with the real server, bench server --kv-events)."""

from __future__ import annotations

import pytest

from support.kv_sub import Sub, stored

W = pytest.importorskip("sglang.srt.disaggregation.kv_events")
sglang_hash = pytest.importorskip("sglang.srt.mem_cache.utils").hash_str_to_int64

from test_kv_events import PAGE, keys_of, open_backend, put  # noqa: E402


def _disk(frames):
    return [e for e in stored(frames) if e["medium"] == "DISK"]


def test_an_engine_clear_is_forwarded_then_the_disk_pages_are_announced_again_with_tokens(tmp_path):
    engine = W.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"ipc://{tmp_path}/engine")
    be = open_backend(tmp_path, kv_events_engine_endpoint=f"ipc://{tmp_path}/engine")
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()
        sub.sync_engine(lambda page: engine.publish(W.KVEventBatch(
            ts=0.0, events=[W.BlockRemoved(block_hashes=[sglang_hash(page)], medium="GPU")])))  # fmt: skip
        keys = keys_of(3, "clear")
        hashes = [sglang_hash(k) for k in keys]
        tokens = [100 * i + t for i in range(3) for t in range(PAGE)]
        engine.publish(W.KVEventBatch(ts=0.0, events=[W.BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=PAGE, lora_id=None,
            medium="GPU")]))  # fmt: skip
        assert put(be, keys) == [True] * 3
        assert be.publisher.flush(60)
        assert [h for e in _disk(sub.upto_now()) for h in e["block_hashes"]] == hashes

        engine.publish(W.KVEventBatch(ts=0.0, events=[W.AllBlocksCleared()]))
        frames = []
        while not any(e["type"] == "AllBlocksCleared" for _, _, evs, _ in frames for e in evs):
            frames += sub.upto_now()
        assert be.publisher.flush(60)
        frames += sub.upto_now()
        at = next(i for i, (_, _, evs, _) in enumerate(frames) if any(e["type"] == "AllBlocksCleared" for e in evs))
        assert _disk(frames[:at]) == []  # nothing re-announced before the clear went out
        again = _disk(frames[at:])
        assert sorted(h for e in again for h in e["block_hashes"]) == sorted(hashes)  # each page once, after it
        assert sorted(t for e in again for t in e["token_ids"]) == sorted(tokens)  # with the engine's tokens
        assert be.publisher.relay.stats["engine_clears"] == 1 and be.publisher.stats["reannounced_pages"] == 3
    finally:
        sub.close()
        be.close()
        engine.shutdown()


def test_without_an_engine_clear_nothing_is_announced_again(tmp_path):
    """The control: the same stream with a GPU removal instead of the clear re-announces nothing."""
    engine = W.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"ipc://{tmp_path}/engine")
    be = open_backend(tmp_path, kv_events_engine_endpoint=f"ipc://{tmp_path}/engine")
    sub = Sub(f"ipc://{tmp_path}/ev", be.publisher)
    try:
        sub.sync()
        gpu_removed = lambda page: engine.publish(W.KVEventBatch(  # noqa: E731
            ts=0.0, events=[W.BlockRemoved(block_hashes=[sglang_hash(page)], medium="GPU")]))
        sub.sync_engine(gpu_removed)
        keys = keys_of(2, "noclear")
        engine.publish(W.KVEventBatch(ts=0.0, events=[W.BlockStored(
            block_hashes=[sglang_hash(k) for k in keys], parent_block_hash=None,
            token_ids=list(range(2 * PAGE)), block_size=PAGE, lora_id=None, medium="GPU")]))  # fmt: skip
        assert put(be, keys) == [True] * 2
        assert be.publisher.flush(60)
        sub.upto_now()
        sub.sync_engine(gpu_removed)
        assert be.publisher.flush(60)
        assert _disk(sub.upto_now()) == [] and be.publisher.stats["reannounced_pages"] == 0
    finally:
        sub.close()
        be.close()
        engine.shutdown()
