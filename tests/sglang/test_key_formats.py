"""Key formats of docs/sglang.md §4 (against the 0.5.23 wheel, §1), pinned with literal strings."""

from __future__ import annotations

import threading
from enum import Enum
from types import SimpleNamespace as NS

import pytest

from umbp_nvme.sglang.keys import (
    KeyScheme,
    PoolRegistry,
    UnregisteredPoolError,
    is_mla_follower,
    make_config_prefix,
    page_of,
    pool_name_str,
    rank_subdir,
    unique_rank,
)


class PoolName(str, Enum):  # stand-in for sglang's enum (str mixin, __str__ = value)
    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DEEPSEEK_V4_C4 = "deepseek_v4_c4"

    def __str__(self) -> str:
        return self.value


class PlainPoolName(str, Enum):  # a str enum without the __str__ override
    SWA = "swa"


def cfg(**kw):
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False, model_name=None, extra_config={})
    base.update(kw)
    return NS(**base)


H = "ab12"

# ---------------------------------------------------------------------------- v1 (KV) keys

V1_CASES = [
    ("mha tp0", cfg(), [f"{H}_0_k", f"{H}_0_v"]),
    ("mha tp3 of 4", cfg(tp_rank=3, tp_size=4), [f"{H}_3_k", f"{H}_3_v"]),
    ("mha pp: tp3 pp1", cfg(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2), [f"{H}_3_1_k", f"{H}_3_1_v"]),
    ("mla no pp: double underscore", cfg(is_mla_model=True, tp_rank=5, tp_size=8), [f"{H}__k"]),
    ("mla pp2", cfg(is_mla_model=True, pp_rank=2, pp_size=4), [f"{H}_2_k"]),
    (
        "split heads tp1 of 2, lcm 4",
        cfg(tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=True),
        [f"{H}_2_k", f"{H}_2_v", f"{H}_3_k", f"{H}_3_v"],
    ),
    (
        "split heads with pp",
        cfg(tp_rank=0, tp_size=2, tp_lcm_size=6, should_split_heads=True, pp_rank=1, pp_size=2),
        [f"{H}_0_1_k", f"{H}_0_1_v", f"{H}_1_1_k", f"{H}_1_1_v", f"{H}_2_1_k", f"{H}_2_1_v"],
    ),
    ("v1 keys never carry the config prefix", cfg(model_name="org/m", extra_config={"extra_backend_tag": "t"}), [f"{H}_0_k", f"{H}_0_v"]),
]


@pytest.mark.parametrize("case,config,expected", V1_CASES, ids=[c[0] for c in V1_CASES])
def test_v1_keys_for_one_page(case, config, expected):
    scheme = KeyScheme.from_storage_config(config)
    assert scheme.v1_keys([H]) == expected
    assert scheme.multiplier == len(expected)


def test_v1_keys_are_page_major():
    scheme = KeyScheme.from_storage_config(cfg())
    assert scheme.v1_keys(["a", "b"]) == ["a_0_k", "a_0_v", "b_0_k", "b_0_v"]


def test_suffix_attributes():
    mha = KeyScheme.from_storage_config(cfg(tp_rank=3, tp_size=4))
    assert (mha.mha_suffix, mha.mla_suffix) == ("3", "")
    pp = KeyScheme.from_storage_config(cfg(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2))
    assert (pp.mha_suffix, pp.mla_suffix) == ("3_1", "1")
    split = KeyScheme.from_storage_config(cfg(tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=True))
    assert split.mha_suffix == ["2", "3"]
    assert split.multiplier == 4


ENVELOPE_CASES = [
    ("mha", cfg(), f"{H}_0_kv"),
    ("mha pp", cfg(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2), f"{H}_3_1_kv"),
    ("mla uses the mha suffix", cfg(is_mla_model=True, tp_rank=2, tp_size=4), f"{H}_2_kv"),
    ("split heads: the rank's own suffix", cfg(tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=True), f"{H}_1_kv"),
]


@pytest.mark.parametrize("case,config,expected", ENVELOPE_CASES, ids=[c[0] for c in ENVELOPE_CASES])
def test_page_envelope_is_one_object_per_page(case, config, expected):
    scheme = KeyScheme.from_storage_config(config)
    assert scheme.v1_keys([H], envelope=True) == [expected]
    assert scheme.v1_multiplier(envelope=True) == 1


def test_dcp_adds_the_shard_to_the_mla_suffix():
    scheme = KeyScheme.from_storage_config(cfg(is_mla_model=True, tp_rank=1, tp_size=4, dcp_size=2, dcp_rank=1))
    assert scheme.v1_keys([H]) == [f"{H}_dcp1_cp0_k"]
    assert KeyScheme.from_storage_config(cfg(is_mla_model=True, dcp_size=1)).v1_keys([H]) == [f"{H}__k"]


def test_bad_split_geometry_is_refused():
    with pytest.raises(ValueError, match="tp_lcm_size=3, tp_size=2"):
        KeyScheme.from_storage_config(cfg(tp_size=2, tp_lcm_size=3, should_split_heads=True))


def test_no_config_means_rank_zero_mha():
    scheme = KeyScheme.from_storage_config(None)
    assert scheme.v1_keys([H]) == [f"{H}_0_k", f"{H}_0_v"]
    assert scheme.config_prefix is None


# ---------------------------------------------------------------------------- config prefix

PREFIX_CASES = [
    ({"extra_backend_tag": "prod"}, "deepseek-ai/DeepSeek-V3", "prod_deepseek-ai-DeepSeek-V3"),
    ({}, "deepseek-ai/DeepSeek-V3", "deepseek-ai-DeepSeek-V3"),
    ({"extra_backend_tag": "prod"}, None, "prod"),
    ({"extra_backend_tag": 7}, "m", "7_m"),
    ({"extra_backend_tag": None}, "a/b/c", "a-b-c"),
    ({}, None, None),
    (None, "", None),
]


@pytest.mark.parametrize("extra,model,expected", PREFIX_CASES)
def test_config_prefix(extra, model, expected):
    assert make_config_prefix(extra, model) == expected
    assert KeyScheme.from_storage_config(cfg(extra_config=extra, model_name=model)).config_prefix == expected


# ---------------------------------------------------------------------------- side-pool keys

MAMBA = NS(conv_buffer=[object(), object()], temporal_state_elem_size=4)
MAMBA_CONV_ONLY = NS(conv_buffer=[object()], temporal_state_elem_size=0)
SWA_MHA = NS(v_buffer=object())
PLAIN = NS()
PACKED = NS(components=["k", "v"], packed=True)
UNPACKED = NS(components=["k", "v"], packed=False)
ONE_COMPONENT = NS(components=["x"])

SIDE_CASES = [
    ("mamba", cfg(model_name="m"), PoolName.MAMBA, MAMBA, ["m_h_0_temporal", "m_h_0_conv_0", "m_h_0_conv_1"]),
    ("mamba conv-only drops temporal", cfg(model_name="m"), PoolName.MAMBA, MAMBA_CONV_ONLY, ["m_h_0_conv_0"]),
    ("mamba on mla uses the mha suffix", cfg(model_name="m", is_mla_model=True, tp_rank=1, tp_size=2), PoolName.MAMBA, MAMBA_CONV_ONLY, ["m_h_1_conv_0"]),
    ("mamba with pp", cfg(model_name="m", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2), "mamba", MAMBA, ["m_h_1_1_temporal", "m_h_1_1_conv_0", "m_h_1_1_conv_1"]),
    ("swa mha with v_buffer", cfg(model_name="m"), PoolName.SWA, SWA_MHA, ["m_h_0_swa_k", "m_h_0_swa_v"]),
    ("swa mha without v_buffer", cfg(model_name="m"), PoolName.SWA, PLAIN, ["m_h_0_swa"]),
    ("indexer mla", cfg(model_name="m", is_mla_model=True), PoolName.INDEXER, PLAIN, ["m_h__indexer"]),
    ("indexer mla pp", cfg(model_name="m", is_mla_model=True, pp_rank=1, pp_size=2), PoolName.INDEXER, PLAIN, ["m_h_1_indexer"]),
    ("deepseek v4 rank-replicated", cfg(model_name="m", is_mla_model=True), PoolName.DEEPSEEK_V4_C4, PLAIN, ["m_h__deepseek_v4_c4"]),
    ("mla swa with v_buffer is one object", cfg(model_name="m", is_mla_model=True), PoolName.SWA, SWA_MHA, ["m_h__swa"]),
    ("packed 2-component", cfg(model_name="m"), "draft", PACKED, ["m_h_0_draft"]),
    ("unpacked 2-component", cfg(model_name="m"), "draft", UNPACKED, ["m_h_0_draft_k", "m_h_0_draft_v"]),
    ("1-component uses the mla suffix", cfg(model_name="m"), "draft_swa", ONE_COMPONENT, ["m_h__draft_swa"]),
    ("no prefix", cfg(), PoolName.SWA, SWA_MHA, ["h_0_swa_k", "h_0_swa_v"]),
    ("tag and model prefix", cfg(model_name="deepseek-ai/DeepSeek-V3", extra_config={"extra_backend_tag": "prod"}, is_mla_model=True), PoolName.INDEXER, PLAIN, ["prod_deepseek-ai-DeepSeek-V3_h__indexer"]),
    ("enum without __str__ renders its value", cfg(), PlainPoolName.SWA, PLAIN, ["h_0_swa"]),
    ("split heads: side pools use the rank's own suffix", cfg(tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=True), PoolName.SWA, SWA_MHA, ["h_1_swa_k", "h_1_swa_v"]),
]


@pytest.mark.parametrize("case,config,name,pool,expected", SIDE_CASES, ids=[c[0] for c in SIDE_CASES])
def test_side_pool_keys_for_one_page(case, config, name, pool, expected):
    keys, m = KeyScheme.from_storage_config(config).side_pool_keys(["h"], name, pool)
    assert keys == expected
    assert m == len(expected)


def test_side_pool_keys_are_page_major_suffix_minor():
    keys, m = KeyScheme.from_storage_config(cfg(model_name="m")).side_pool_keys(["a", "b"], PoolName.MAMBA, MAMBA)
    assert m == 3
    assert keys == [
        "m_a_0_temporal", "m_a_0_conv_0", "m_a_0_conv_1",
        "m_b_0_temporal", "m_b_0_conv_0", "m_b_0_conv_1",
    ]


def test_rank_suffix_overrides_both_suffixes():
    scheme = KeyScheme.from_storage_config(cfg(is_mla_model=True, model_name="m"))
    assert scheme.side_pool_keys(["h"], "indexer", PLAIN, rank_suffix="7")[0] == ["m_h_7_indexer"]
    assert scheme.side_pool_keys(["h"], "mamba", MAMBA_CONV_ONLY, rank_suffix="7")[0] == ["m_h_7_conv_0"]


def test_unsupported_component_count():
    with pytest.raises(ValueError) as err:
        KeyScheme().side_pool_keys(["h"], PoolName.SWA, NS(components=[1, 2, 3]))
    assert str(err.value) == "Unsupported UMBP component count for pool swa: 3"


# ---------------------------------------------------------------------------- registry

def test_registry_ignores_kv():
    reg = PoolRegistry()
    assert reg.register(PoolName.KV, object()) is False
    assert reg.register("kv", object()) is False
    assert reg.names() == []


def test_registry_enum_and_string_names_are_the_same_pool():
    reg = PoolRegistry()
    pool = object()
    assert reg.register(PoolName.MAMBA, pool) is True
    assert reg.get("mamba") is pool
    assert reg.get(PoolName.MAMBA) is pool
    assert PoolName.MAMBA in reg and "mamba" in reg and len(reg) == 1
    assert reg.names() == ["mamba"]


def test_unregistered_pool_error_begins_with_umbp_message():
    reg = PoolRegistry()
    reg.register(PoolName.MAMBA, MAMBA)
    reg.register(PoolName.INDEXER, PLAIN)
    with pytest.raises(ValueError) as err:
        reg.get(PoolName.SWA)
    msg = str(err.value)
    assert msg.startswith("Unregistered UMBP hybrid pool: swa")
    assert "mamba, indexer" in msg
    assert "register_mem_host_pool_v2(host_pool, name)" in msg
    assert isinstance(err.value, UnregisteredPoolError) and err.value.pool_name == "swa"


def test_unregistered_error_lists_none_when_empty():
    with pytest.raises(ValueError, match=r"^Unregistered UMBP hybrid pool: swa\. Registered pools: none\."):
        PoolRegistry().get("swa")


def test_kv_transfer_raises_unregistered():
    with pytest.raises(ValueError) as err:
        PoolRegistry().get(PoolName.KV)
    assert str(err.value).startswith("Unregistered UMBP hybrid pool: kv")


def test_component_keys_raises_when_composing_keys_for_unregistered_pool():
    scheme = KeyScheme.from_storage_config(cfg(model_name="m"))
    reg = PoolRegistry()
    with pytest.raises(ValueError, match="^Unregistered UMBP hybrid pool: swa"):
        scheme.component_keys(["h"], PoolName.SWA, reg)
    reg.register(PoolName.SWA, SWA_MHA)
    assert scheme.component_keys(["h"], PoolName.SWA, reg) == (["m_h_0_swa_k", "m_h_0_swa_v"], 2)


def test_side_pool_keys_with_no_pool_raises_unregistered():
    with pytest.raises(ValueError, match="^Unregistered UMBP hybrid pool: mamba"):
        KeyScheme().side_pool_keys(["h"], PoolName.MAMBA, None)


def test_registry_concurrent_registration():
    reg = PoolRegistry()

    def worker(i):
        for j in range(200):
            reg.register(f"p{i}_{j}", j)
            reg.names()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reg) == 1600


def test_pool_name_str():
    assert pool_name_str(PoolName.SWA) == "swa"
    assert pool_name_str(PlainPoolName.SWA) == "swa"
    assert pool_name_str("mamba") == "mamba"


# ---------------------------------------------------------------------------- rank directories

SUBDIR_CASES = [
    ("single rank", cfg(), {}, ""),
    ("tp1 of 2", cfg(tp_rank=1, tp_size=2), {}, "tp1"),
    ("tp0 of 2", cfg(tp_rank=0, tp_size=2), {}, "tp0"),
    ("pp1 tp0", cfg(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2), {}, "pp1_tp0"),
    ("pp only", cfg(pp_rank=1, pp_size=2), {}, "pp1"),
    ("dp from env", cfg(tp_rank=0, tp_size=2), {"SGLANG_DP_RANK": "1"}, "dp1_tp0"),
    ("dp from config", cfg(tp_rank=1, tp_size=2, dp_rank=1), {}, "dp1_tp1"),
    ("dp0 with dp_size", cfg(dp_rank=0, dp_size=2), {}, "dp0"),
    ("dp0 without dp_size is no hint", cfg(dp_rank=0), {}, ""),
    ("LOCAL_RANK on a 1-rank config", cfg(), {"LOCAL_RANK": "3"}, "rank3"),
    ("LOCAL_RANK 0", cfg(), {"LOCAL_RANK": "0"}, ""),
    ("mla tp>1 shares one dir", cfg(is_mla_model=True, tp_rank=3, tp_size=4), {}, ""),
    ("mla tp>1 with dp", cfg(is_mla_model=True, tp_rank=3, tp_size=4), {"SGLANG_DP_RANK": "2"}, "dp2"),
    ("mla tp>1 with pp", cfg(is_mla_model=True, tp_rank=3, tp_size=4, pp_rank=1, pp_size=2), {}, "pp1"),
    ("mla tp1 with dp", cfg(is_mla_model=True, dp_rank=1), {}, "dp1"),
]


@pytest.mark.parametrize("case,config,env,expected", SUBDIR_CASES, ids=[c[0] for c in SUBDIR_CASES])
def test_rank_subdir(case, config, env, expected):
    assert rank_subdir(config, env) == expected


def test_unique_rank_formula():
    assert unique_rank(cfg(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2), {"SGLANG_DP_RANK": "1"}) == ((1 * 2) + 1) * 2 + 1
    assert unique_rank(cfg(), {"LOCAL_RANK": "5"}) == 5


def test_bad_env_rank_is_named():
    with pytest.raises(ValueError, match="SGLANG_DP_RANK must be an integer, got 'x'"):
        rank_subdir(cfg(), {"SGLANG_DP_RANK": "x"})


FOLLOWER_CASES = [
    ("mha", cfg(tp_rank=1, tp_size=2), False),
    ("mla tp1", cfg(is_mla_model=True), False),
    ("mla leader", cfg(is_mla_model=True, tp_rank=0, tp_size=4), False),
    ("mla follower", cfg(is_mla_model=True, tp_rank=2, tp_size=4), True),
    ("is_storage_writer True wins", cfg(is_mla_model=True, tp_rank=1, tp_size=4, is_storage_writer=True), False),
    ("is_storage_writer False", cfg(is_mla_model=True, tp_rank=0, tp_size=4, is_storage_writer=False), True),
    ("no config", None, False),
]


@pytest.mark.parametrize("case,config,expected", FOLLOWER_CASES, ids=[c[0] for c in FOLLOWER_CASES])
def test_is_mla_follower(case, config, expected):
    assert is_mla_follower(config) is expected


def test_is_storage_writer_property_is_honoured():
    class Config:
        is_mla_model = True
        tp_size = 4
        tp_rank = 1
        dcp_rank = 1

        @property
        def is_storage_writer(self):
            return not self.is_mla_model or self.tp_rank == self.dcp_rank

    assert is_mla_follower(Config()) is False


def test_with_sglang_storage_config_when_installed():
    hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

    def make(**kw):
        base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                    enable_storage_metrics=False, is_page_first_layout=True, model_name="deepseek-ai/DeepSeek-V3",
                    extra_config={"extra_backend_tag": "prod"})
        base.update(kw)
        return hs.HiCacheStorageConfig(**base)

    mla = make(is_mla_model=True, tp_rank=1, tp_size=2)
    scheme = KeyScheme.from_storage_config(mla)
    assert scheme.v1_keys([H]) == [f"{H}__k"]
    assert scheme.config_prefix == "prod_deepseek-ai-DeepSeek-V3"
    reg = PoolRegistry()
    reg.register(hs.PoolName.INDEXER, PLAIN)
    assert scheme.component_keys(["h"], hs.PoolName.INDEXER, reg)[0] == ["prod_deepseek-ai-DeepSeek-V3_h__indexer"]
    with pytest.raises(ValueError, match="^Unregistered UMBP hybrid pool: swa"):
        scheme.component_keys(["h"], hs.PoolName.SWA, reg)
    assert is_mla_follower(mla) is True
    assert is_mla_follower(make(is_mla_model=True, tp_rank=0, tp_size=2)) is False
    assert rank_subdir(make(tp_rank=1, tp_size=2), {}) == "tp1"


def test_page_of_finds_the_page_hash_behind_prefixes_and_suffixes():
    h64 = "0123456789abcdef" * 4
    assert page_of("abc_0_k") == page_of("abc_0_v") == page_of("abc__k") == page_of("abc_1_2_k") == "abc"
    assert page_of("flat_abc_0") == "abc"
    assert page_of("tag_org-model_abc_0_swa_k", "tag_org-model") == "abc"
    assert page_of(f"tag_org-model_{h64}_0_mamba_temporal") == page_of(f"{h64}_0_k") == h64
