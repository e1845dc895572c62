"""KV event shapes for when sglang does not import: msgspec structs that encode to the same msgpack.

sglang 0.5.23's wire format: a batch is a positional array ``[ts, events, attn_dp_rank]``; an event
is a map tagged ``type`` = its class name, fields left at their default omitted. The fields are
sglang's, in sglang's order, so the maps come out key for key equal (the wire test checks bytes).
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec


class EventBatch(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str] = None


class KVEventBatch(EventBatch):
    events: list[Any]
