"""The DISK events' bytes and hashes against the sglang 0.5.23 wheel (issue 27).

- the encoder's msgpack is byte for byte what sglang's own classes give, and so are the msgspec
  structs used when sglang does not import;
- a page's event hash is the wheel's ``hash_str_to_int64`` of its page key, for every key format
  the backend writes (MHA, MLA, TP > 1, PP, split heads, envelopes, legacy flat pages), and
  side-pool objects are never announced.
"""

from __future__ import annotations

import hashlib
import random
from types import SimpleNamespace as NS

import pytest

from umbp_nvme.sglang.kv_events import Encoder, hash_str_to_int64, offset_endpoint_port
from umbp_nvme.sglang.kv_residency import Residency
from umbp_nvme.sglang.keys import KeyScheme

wheel_utils = pytest.importorskip("sglang.srt.mem_cache.utils")
wheel_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")


def page(i, salt="w"):
    return hashlib.sha256(f"{salt}{i}".encode()).hexdigest()


def test_the_event_hash_is_the_wheels_for_any_page_key():
    rng = random.Random(27)
    keys = [page(i) for i in range(500)] + ["f" * 64, "0" * 64, "8" + "0" * 63, "7" + "f" * 63]
    keys += ["".join(rng.choice("0123456789abcdef") for _ in range(64)) for _ in range(500)]
    assert [hash_str_to_int64(k) for k in keys] == [wheel_utils.hash_str_to_int64(k) for k in keys]


ITEMS = [
    ("stored", [(page(0), None, None), (page(1), page(0), None), (page(2), page(1), None)]),
    ("stored", [(page(9), page(7), [5, 6, 7, 8])]),
    ("removed", [page(1), page(2)]),
    ("removed", [page(3)]),
    ("stored", [(page(4), None, [1, 2, 3, 4])]),
]


@pytest.mark.parametrize("dp", [0, 3])
def test_the_encoding_is_sglangs_and_the_standin_structs_match_it(dp):
    ours = Encoder(4, dp, prefer_sglang=True)
    standin = Encoder(4, dp, prefer_sglang=False)
    assert ours.source == "sglang" and standin.source == "umbp_nvme"
    a = ours.encode(ours.events(ITEMS), ts=1234.5)
    b = standin.encode(standin.events(ITEMS), ts=1234.5)
    assert a == b
    # and what sglang's own classes give for the same events, built by hand
    W = wheel_events
    by_hand = W.KVEventBatch(ts=1234.5, attn_dp_rank=dp, events=[
        W.BlockStored(block_hashes=[hash_str_to_int64(page(i)) for i in range(3)], parent_block_hash=None,
                      token_ids=[], block_size=4, lora_id=None, medium="DISK"),
        W.BlockStored(block_hashes=[hash_str_to_int64(page(9))], parent_block_hash=hash_str_to_int64(page(7)),
                      token_ids=[5, 6, 7, 8], block_size=4, lora_id=None, medium="DISK"),
        W.BlockRemoved(block_hashes=[hash_str_to_int64(page(i)) for i in (1, 2, 3)], medium="DISK"),
        W.BlockStored(block_hashes=[hash_str_to_int64(page(4))], parent_block_hash=None,
                      token_ids=[1, 2, 3, 4], block_size=4, lora_id=None, medium="DISK"),
    ])  # fmt: skip
    import msgspec

    assert a == msgspec.msgpack.Encoder().encode(by_hand)


@pytest.mark.parametrize("endpoint, rank", [("tcp://*:5557", 0), ("tcp://*:5557", 3), ("tcp://10.0.0.1:6000", 2),
                                            ("inproc://cache", 1), ("ipc:///tmp/x", 0)])  # fmt: skip
def test_ports_are_offset_per_dp_rank_as_sglang_does(endpoint, rank):
    assert offset_endpoint_port(endpoint, rank) == wheel_events.ZmqEventPublisher.offset_endpoint_port(endpoint, rank)


class Offers:
    """A publisher that resolves the residency's items at once, as its thread does."""

    def __init__(self):
        self.items = []
        self.rz = None

    def offer(self, kind, pages):
        for k, p in self.rz.resolve([(kind, pages)]):
            self.items.append((k, list(p)))
        return True


def cfg(**kw):
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False, model_name="m", extra_config={})
    base.update(kw)
    return NS(**base)


SCHEMES = [
    ("mha", cfg(), False),
    ("mha tp3 of 4", cfg(tp_rank=3, tp_size=4), False),
    ("mha pp", cfg(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2), False),
    ("mla tp8", cfg(is_mla_model=True, tp_size=8), False),
    ("mla pp", cfg(is_mla_model=True, pp_rank=1, pp_size=2), False),
    ("split heads", cfg(tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=True), False),
    ("envelope", cfg(tp_rank=1, tp_size=2), True),
]


@pytest.mark.parametrize("name, sc, envelope", SCHEMES, ids=[s[0] for s in SCHEMES])
def test_every_key_format_announces_its_page_with_the_wheels_hash(name, sc, envelope):
    scheme = KeyScheme.from_storage_config(sc)
    sfx = scheme.v1_suffixes(envelope=envelope)
    pages = [page(i, name) for i in range(4)]
    keys = scheme.v1_keys(pages, envelope=envelope)
    held = set(keys)
    offers = Offers()
    rz = offers.rz = Residency(offers, sfx)
    rz.exists = lambda ks: [k in held for k in ks]
    rz.shown(keys)
    assert offers.items == [("stored", [(p, None, None) for p in pages])]
    enc = Encoder(4, 0)
    events = enc.events(offers.items)
    assert [h for ev in events for h in ev.block_hashes] == [wheel_utils.hash_str_to_int64(p) for p in pages]
    # removing one object of page 1 removes page 1, once
    held.discard(keys[len(sfx)])
    rz.hidden([keys[len(sfx)]])
    assert offers.items[-1] == ("removed", [pages[1]])


def test_side_pool_and_foreign_keys_are_not_announced():
    scheme = KeyScheme.from_storage_config(cfg(extra_config={"extra_backend_tag": "t"}))
    pages = [page(i, "side") for i in range(3)]
    side = [f"{scheme.config_prefix}_{p}_0_mamba_{j}" for p in pages for j in range(2)] + [f"{pages[0]}_0_swa_k"]
    offers = Offers()
    rz = offers.rz = Residency(offers, scheme.v1_suffixes())
    rz.exists = lambda ks: [True] * len(ks)
    rz.shown(side + ["short_0_k", 17, ""])
    rz.hidden(side)
    assert offers.items == []


def test_legacy_flat_pages_are_announced_by_their_page_hash():
    offers = Offers()
    rz = offers.rz = Residency(offers, ("_0",), prefix="flat_")
    held = {f"flat_{page(1)}_0"}
    rz.exists = lambda ks: [k in held for k in ks]
    rz.shown([f"flat_{page(1)}_0", f"{page(2)}_0_k"])
    assert offers.items == [("stored", [(page(1), None, None)])]
