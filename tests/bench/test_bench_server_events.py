"""bench server --kv-events' parts that need no server: the tier tally, the store's pages read from
its index, a prompt's page hashes, the comparison and its failures, the launch flags."""

from __future__ import annotations

import asyncio
import json

import pytest

from umbp_nvme.bench import server as S
from umbp_nvme.bench import server_events as E
from umbp_nvme.sglang.keys import hash_str_to_int64


def _batch(*events):
    return [0.0, list(events), None]


def test_the_tiers_are_kept_apart_with_disk_tokens_and_a_clear_empties_them_all():
    t = E.Tiers()
    t.apply(_batch({"type": "BlockStored", "block_hashes": [1, 2], "token_ids": [7, 8, 9, 10], "medium": "DISK"},
                   {"type": "BlockStored", "block_hashes": [1], "token_ids": [7, 8], "medium": "GPU"},
                   {"type": "BlockStored", "block_hashes": [3], "token_ids": [5, 6], "medium": "CPU_PINNED"}))
    assert t.tiers == {"GPU": {1}, "CPU_PINNED": {3}, "DISK": {1, 2}}
    assert t.disk_tokens == {1: (7, 8), 2: (9, 10)}
    t.apply(_batch({"type": "BlockRemoved", "block_hashes": [1], "medium": "DISK"},
                   {"type": "BlockRemoved", "block_hashes": [9], "medium": "EXTERNAL"}))
    assert t.tiers["DISK"] == {2} and t.tiers["GPU"] == {1} and 1 not in t.disk_tokens
    assert (t.stats["removed_DISK"], t.stats["removed_GPU"], t.stats["removed"]) == (1, 0, 1)
    t.apply(_batch({"type": "AllBlocksCleared"}))
    assert t.tiers == {m: set() for m in E.MEDIUMS} and t.disk_tokens == {} and t.stats["cleared"] == 1


def test_prompt_hashes_are_sglangs_page_keys_of_the_full_pages():
    utils = pytest.importorskip("sglang.srt.mem_cache.utils")
    ids = list(range(3, 3 + 2 * 64 + 10))
    try:
        keys = utils.get_hash_str(ids[: 2 * 64], None, page_size=64)
    except Exception as e:  # noqa: BLE001 - its C++ page hash may not build here
        pytest.skip(f"SGLang's page hash: {e!r}")
    assert E.prompt_hashes(ids, 64) == [hash_str_to_int64(k) for k in keys]


def test_disk_held_reads_complete_pages_from_the_index_of_a_store_another_process_writes(tmp_path):
    from umbp_nvme.config import StoreConfig
    from umbp_nvme.store.page_store import PageStore

    a, b = "a" * 64, "b" * 64

    async def write():
        s = await PageStore.open(str(tmp_path), StoreConfig(ssd_capacity_bytes=64 << 20, ssd_segment_size_bytes=4 << 20))
        try:
            buf = bytes(4096)
            assert await s.put_many([f"{a}_0_k", f"{a}_0_v", f"{b}_0_k"], [buf, buf, buf]) == [True] * 3
            return E.disk_held(str(tmp_path))  # the writer still holds it open
        finally:
            await s.close()

    assert asyncio.run(write()) == {hash_str_to_int64(a)}  # b lacks its V object: not on disk


def test_compare_and_failures_name_the_step_tier_and_count():
    assert E.compare({1, 2, 3}, {2, 3, 4}) == {"announced": 3, "phantom": 1, "missing": 1}
    rows = [{"step": "fill", "tier": "DISK", "held": 3, "ours_phantom": 0, "ours_missing": 0, "dynamo_missing": 2},
            {"step": "flush", "tier": "DISK", "held": 0, "ours_phantom": 0, "ours_missing": 0}]
    assert E.failures(rows, []) == ["fill, DISK: dynamo_missing = 2", "flush: DISK holds no page (nothing exercised)"]


def test_kv_events_add_the_schedulers_publisher_and_the_relay_to_the_umbp_arm_only(tmp_path):
    p = E.Ports(31000)
    assert (p.engine, p.engine_replay, p.relay, p.relay_replay, p.dynamo) == (31001, 31002, 31003, 31004, 31005)
    with pytest.raises(ValueError, match="five ports"):
        E.Ports(0, [1, 2])
    args, _ = S.arm_args("umbp", model_dir="m", port=31000, store_dir=str(tmp_path), events=p)
    cfg = json.loads(args[args.index("--kv-events-config") + 1])
    assert cfg == {"publisher": "zmq", "endpoint": "tcp://*:31001", "replay_endpoint": "tcp://127.0.0.1:31002"}
    extra = json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["kv_events_engine_endpoint"] == "tcp://*:31001" and extra["kv_events_endpoint"] == "tcp://*:31003"
    assert extra["kv_events_replay_endpoint"] == "tcp://127.0.0.1:31004"
    plain, _ = S.arm_args("umbp", model_dir="m", port=31000, store_dir="s")
    assert "--kv-events-config" not in plain and "kv_events" not in plain[plain.index("--hicache-storage-backend-extra-config") + 1]


def test_kv_events_without_dynamo_say_why(monkeypatch):
    monkeypatch.delenv("UMBP_DYNAMO_PYTHON", raising=False)
    assert "no --dynamo-python" in S.parse_args(["--kv-events"]).dynamo_note
    cfg = S.parse_args(["--kv-events", "--dynamo-python", "/no/such/python"])
    assert cfg.dynamo_python == "" and "does not exist" in cfg.dynamo_note
