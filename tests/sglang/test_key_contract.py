"""The key and directory contract, over every small rank combination (issue 17).

Each test states one property of docs/sglang.md §4 (keys) / §8 (each rank's directory) and checks it
exhaustively over small (tp, pp, dp, dcp, cp, split-heads) combinations, against the literal
strings UMBP (and Mooncake, for DCP) writes. A mutant that makes two ranks share a key or a
store directory, or that drifts from UMBP's literal format, fails here.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections import Counter
from types import SimpleNamespace as NS

import pytest

from umbp_nvme.sglang.keys import KeyScheme, dp_rank_hint, is_mla_follower, rank_subdir, unique_rank

H = "ab12"
SIZES = (1, 2, 3, 4)
PP_SIZES = (1, 2, 3)


def cfg(**kw):
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False, model_name=None, extra_config={})
    base.update(kw)
    return NS(**base)


def v1(config) -> list[str]:
    return KeyScheme.from_storage_config(config).v1_keys([H])


def pp_tail(pp_rank, pp_size) -> str:
    return f"_{pp_rank}" if pp_size > 1 else ""


# ------------------------------------------------------------------------------------- MHA


def mha_ranks():
    for tp_size, pp_size in itertools.product(SIZES, PP_SIZES):
        for tp_rank, pp_rank in itertools.product(range(tp_size), range(pp_size)):
            yield tp_size, tp_rank, pp_size, pp_rank


def test_mha_keys_are_umbps_literal_strings_for_every_tp_pp_rank():
    for tp_size, tp_rank, pp_size, pp_rank in mha_ranks():
        config = cfg(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
        sfx = f"{tp_rank}_{pp_rank}" if pp_size > 1 else f"{tp_rank}"
        assert v1(config) == [f"{H}_{sfx}_k", f"{H}_{sfx}_v"], (tp_size, tp_rank, pp_size, pp_rank)


def test_every_mha_tp_pp_rank_of_a_deployment_owns_distinct_keys():
    for tp_size, pp_size in itertools.product(SIZES, PP_SIZES):
        seen: dict[str, tuple] = {}
        for tp_rank, pp_rank in itertools.product(range(tp_size), range(pp_size)):
            for key in v1(cfg(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)):
                assert key not in seen, f"{key} of tp{tp_rank} pp{pp_rank} also belongs to {seen[key]}"
                seen[key] = (tp_rank, pp_rank)
        assert len(seen) == 2 * tp_size * pp_size


# ------------------------------------------------------------------------------------- MLA / DCP


def dcp_ranks():
    """(tp_size, dcp_size, tp_rank, dcp_rank, cp_rank, pp_size, pp_rank) that sglang 0.5.23 accepts:
    dcp_size divides tp_size and dcp_rank == tp_rank % dcp_size."""
    for tp_size in (2, 4, 8):
        for dcp_size in (d for d in (2, 4, 8) if tp_size % d == 0):
            for tp_rank, cp_rank, pp_size in itertools.product(range(tp_size), range(3), PP_SIZES):
                for pp_rank in range(pp_size):
                    yield tp_size, dcp_size, tp_rank, tp_rank % dcp_size, cp_rank, pp_size, pp_rank


def mla_dcp(tp_size, dcp_size, tp_rank, dcp_rank, cp_rank, pp_size, pp_rank, **kw):
    return cfg(
        is_mla_model=True, tp_rank=tp_rank, tp_size=tp_size, dcp_size=dcp_size, dcp_rank=dcp_rank,
        attn_cp_rank=cp_rank, attn_cp_size=3, pp_rank=pp_rank, pp_size=pp_size, **kw,
    )


def test_mla_dcp_keys_are_mooncakes_literal_strings():
    # Mooncake's (and our) DCP suffix: dcp{shard}_cp{attn cp rank}, the PP rank last after "_".
    for tp_size, dcp_size, tp_rank, dcp_rank, cp_rank, pp_size, pp_rank in dcp_ranks():
        config = mla_dcp(tp_size, dcp_size, tp_rank, dcp_rank, cp_rank, pp_size, pp_rank)
        expected = f"{H}_dcp{dcp_rank}_cp{cp_rank}{pp_tail(pp_rank, pp_size)}_k"
        assert v1(config) == [expected], (tp_size, dcp_size, tp_rank, cp_rank, pp_size, pp_rank)


def test_every_dcp_cp_pp_triple_maps_to_its_own_key_and_replicas_share_it():
    for tp_size, dcp_size in ((2, 2), (4, 2), (4, 4), (8, 2), (8, 4)):
        key_of: dict[tuple, str] = {}
        for tp_rank, cp_rank, pp_rank in itertools.product(range(tp_size), range(3), range(3)):
            triple = (tp_rank % dcp_size, cp_rank, pp_rank)
            (key,) = v1(mla_dcp(tp_size, dcp_size, tp_rank, triple[0], cp_rank, 3, pp_rank))
            # TP replicas of one DCP shard hold the same bytes: one key (one writer, the others read it)
            assert key_of.setdefault(triple, key) == key, (tp_rank, triple)
        keys = list(key_of.values())
        assert len(set(keys)) == len(keys) == dcp_size * 3 * 3, "two (dcp, cp, pp) shards share a key"
        # and no DCP key collides with a non-DCP MLA key or an MHA key of the same page
        others = {k for pp in range(3) for k in v1(cfg(is_mla_model=True, pp_rank=pp, pp_size=3))}
        others |= {k for tp, pp in itertools.product(range(8), range(3)) for k in v1(cfg(tp_rank=tp, tp_size=8, pp_rank=pp, pp_size=3))}
        assert not others & set(keys)


def test_dcp_fields_missing_or_none_mean_shard_zero_of_one():
    # Older sglang configs have no dcp_* / attn_cp_rank fields, or carry None: UMBP's format.
    assert v1(cfg(is_mla_model=True, tp_rank=1, tp_size=2)) == [f"{H}__k"]
    assert v1(cfg(is_mla_model=True, dcp_size=None, dcp_rank=None, attn_cp_rank=None)) == [f"{H}__k"]
    # dcp_rank / attn_cp_rank of None or 0 on a DCP config is shard 0 / cp 0, never another shard's
    for none_or_zero in (None, 0):
        config = cfg(is_mla_model=True, tp_size=2, dcp_size=2, dcp_rank=none_or_zero, attn_cp_rank=none_or_zero)
        assert v1(config) == [f"{H}_dcp0_cp0_k"]
    assert v1(cfg(is_mla_model=True, tp_size=2, dcp_size=2, dcp_rank=1)) == [f"{H}_dcp1_cp0_k"]


def test_without_dcp_mla_keys_are_umbps_and_ignore_cp():
    # dcp_size 1: the double underscore without PP, the PP rank with PP; attention-CP ranks are
    # kept apart by their store directories (sglang_backend), not by the key.
    for tp_size, tp_rank, pp_size, pp_rank in mha_ranks():
        for cp_rank in range(3):
            config = cfg(is_mla_model=True, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size,
                         dcp_size=1, dcp_rank=0, attn_cp_rank=cp_rank)
            assert v1(config) == [f"{H}_{pp_rank if pp_size > 1 else ''}_k"]


def test_dcp_on_mha_config_changes_nothing():
    # sglang refuses DCP without MLA; MHA keys never carry a DCP shard.
    assert v1(cfg(tp_rank=1, tp_size=2, dcp_size=2, dcp_rank=1, attn_cp_rank=1)) == [f"{H}_1_k", f"{H}_1_v"]


def test_with_sglang_dcp_config_when_installed():
    hs = pytest.importorskip("sglang.srt.mem_cache.hicache_storage")
    if "dcp_size" not in {f.name for f in dataclasses.fields(hs.HiCacheStorageConfig)}:
        pytest.skip(f"sglang {sys.modules['sglang'].__version__} has no DCP storage config (sglang 0.5.23+)")
    for tp_rank in range(4):
        config = hs.HiCacheStorageConfig(
            tp_rank=tp_rank, tp_size=4, pp_rank=1, pp_size=2, attn_cp_rank=0, attn_cp_size=1, is_mla_model=True,
            enable_storage_metrics=False, is_page_first_layout=True, model_name=None, extra_config={},
            dcp_size=2, dcp_rank=tp_rank % 2, logical_page_size=64,
        )
        assert v1(config) == [f"{H}_dcp{tp_rank % 2}_cp0_1_k"]
        assert is_mla_follower(config) is (tp_rank >= 2)


# ------------------------------------------------------------------------------------- split heads


def split_cases():
    for tp_size in SIZES:
        for sf in (1, 2, 3, 4):
            for tp_rank, pp_size in itertools.product(range(tp_size), PP_SIZES):
                for pp_rank in range(pp_size):
                    yield tp_size, sf, tp_rank, pp_size, pp_rank


def split_cfg(tp_size, sf, tp_rank, pp_size, pp_rank):
    return cfg(tp_rank=tp_rank, tp_size=tp_size, tp_lcm_size=tp_size * sf, should_split_heads=True,
               pp_rank=pp_rank, pp_size=pp_size)


def test_split_heads_keys_are_head_group_major_k_then_v():
    for tp_size, sf, tp_rank, pp_size, pp_rank in split_cases():
        scheme = KeyScheme.from_storage_config(split_cfg(tp_size, sf, tp_rank, pp_size, pp_rank))
        expected = [f"{H}_{r}{pp_tail(pp_rank, pp_size)}_{c}" for r in range(tp_rank * sf, tp_rank * sf + sf) for c in "kv"]
        assert scheme.v1_keys([H]) == expected, (tp_size, sf, tp_rank, pp_size, pp_rank)
        assert scheme.multiplier == 2 * sf
        assert scheme.split_factor == sf


def test_split_heads_of_all_tp_ranks_cover_each_target_rank_exactly_once():
    # The tp_lcm_size target ranks are dealt out among the TP ranks, sf each, none twice: a
    # different TP size reading the store finds every head group under the key it expects.
    for tp_size, sf in itertools.product(SIZES, (1, 2, 3, 4)):
        for pp_size in PP_SIZES:
            for pp_rank in range(pp_size):
                keys = Counter(
                    k for tp_rank in range(tp_size) for k in v1(split_cfg(tp_size, sf, tp_rank, pp_size, pp_rank))
                )
                lcm = tp_size * sf
                expected = {f"{H}_{r}{pp_tail(pp_rank, pp_size)}_{c}" for r in range(lcm) for c in "kv"}
                assert set(keys) == expected and set(keys.values()) == {1}


def test_split_factor_one_equals_the_unsplit_keys():
    # tp_lcm_size == tp_size is a valid (if pointless) split: it must start, and write what an
    # unsplit rank writes.
    for tp_size, tp_rank, pp_size, pp_rank in mha_ranks():
        split = split_cfg(tp_size, 1, tp_rank, pp_size, pp_rank)
        plain = cfg(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
        assert v1(split) == v1(plain)


@pytest.mark.parametrize("lcm", [None, 0, 3, 5, 1])
def test_split_heads_with_lcm_not_a_multiple_of_tp_size_is_refused(lcm):
    with pytest.raises(ValueError, match=f"tp_lcm_size={lcm!r}, tp_size=2"):
        KeyScheme.from_storage_config(cfg(tp_size=2, tp_lcm_size=lcm, should_split_heads=True))


def test_split_heads_flag_off_ignores_tp_lcm_size():
    assert v1(cfg(tp_rank=1, tp_size=2, tp_lcm_size=4, should_split_heads=False)) == [f"{H}_1_k", f"{H}_1_v"]


def test_split_heads_tp_size_none_reads_as_one():
    scheme = KeyScheme.from_storage_config(cfg(tp_size=None, tp_lcm_size=2, should_split_heads=True))
    assert scheme.v1_keys([H]) == [f"{H}_0_k", f"{H}_0_v", f"{H}_1_k", f"{H}_1_v"]


# ------------------------------------------------------------------------------------- side pools


class Pool:
    """A host pool stand-in: only the attributes key composition reads."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_side_pool_keys_for_every_rank_are_literal_and_prefixed():
    mamba = Pool(conv_buffer=[0, 0], temporal_state_elem_size=2)
    swa = Pool(v_buffer=object())
    plain = Pool()
    for tp_size, tp_rank, pp_size, pp_rank in mha_ranks():
        mha_sfx = f"{tp_rank}{pp_tail(pp_rank, pp_size)}"
        mla_sfx = f"{pp_rank}" if pp_size > 1 else ""
        for is_mla in (False, True):
            scheme = KeyScheme.from_storage_config(
                cfg(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, is_mla_model=is_mla,
                    model_name="org/m", extra_config={"extra_backend_tag": "t"})
            )
            assert scheme.side_pool_keys([H], "mamba", mamba) == (
                [f"t_org-m_{H}_{mha_sfx}_temporal", f"t_org-m_{H}_{mha_sfx}_conv_0", f"t_org-m_{H}_{mha_sfx}_conv_1"], 3)
            swa_keys = [f"t_org-m_{H}_{mla_sfx}_swa"] if is_mla else [f"t_org-m_{H}_{mha_sfx}_swa_k", f"t_org-m_{H}_{mha_sfx}_swa_v"]
            assert scheme.side_pool_keys([H], "swa", swa) == (swa_keys, len(swa_keys))
            idx = f"t_org-m_{H}_{mla_sfx}_indexer" if is_mla else f"t_org-m_{H}_{mha_sfx}_indexer"
            assert scheme.side_pool_keys([H], "indexer", plain) == ([idx], 1)


def test_mamba_pool_attributes_decide_its_components():
    scheme = KeyScheme()
    # no temporal_state_elem_size attribute: UMBP's default 1 keeps the temporal state
    assert scheme.side_pool_keys([H], "mamba", Pool(conv_buffer=[0]))[0] == [f"{H}_0_temporal", f"{H}_0_conv_0"]
    # temporal 0: conv only; conv_buffer None or missing: temporal only
    assert scheme.side_pool_keys([H], "mamba", Pool(conv_buffer=[0], temporal_state_elem_size=0))[0] == [f"{H}_0_conv_0"]
    assert scheme.side_pool_keys([H], "mamba", Pool(conv_buffer=None, temporal_state_elem_size=1))[0] == [f"{H}_0_temporal"]
    assert scheme.side_pool_keys([H], "mamba", Pool())[0] == [f"{H}_0_temporal"]


def test_component_pools_without_packed_are_split_k_v():
    scheme = KeyScheme.from_storage_config(cfg(is_mla_model=True, tp_rank=1, tp_size=2))
    # a 2-component pool is MHA-shaped even on an MLA model: the rank's MHA suffix
    assert scheme.side_pool_keys([H], "draft", Pool(components=[1, 2]))[0] == [f"{H}_1_draft_k", f"{H}_1_draft_v"]
    assert scheme.side_pool_keys([H], "draft", Pool(components=[1, 2], packed=True))[0] == [f"{H}_1_draft"]
    assert scheme.side_pool_keys([H], "draft", Pool(components=[1]))[0] == [f"{H}__draft"]
    with pytest.raises(ValueError, match="^Unsupported UMBP component count for pool draft: 0$"):
        scheme.side_pool_keys([H], "draft", Pool(components=[]))


def test_side_pool_keys_of_a_page_range_are_page_major_and_prefixed_once():
    scheme = KeyScheme.from_storage_config(cfg(model_name="m"))
    keys, m = scheme.side_pool_keys(["a", "b", "c"], "swa", Pool(v_buffer=1))
    assert m == 2
    assert keys == ["m_a_0_swa_k", "m_a_0_swa_v", "m_b_0_swa_k", "m_b_0_swa_v", "m_c_0_swa_k", "m_c_0_swa_v"]
    assert scheme.side_pool_keys([], "swa", Pool(v_buffer=1)) == ([], 2)


def test_empty_prefix_parts_add_nothing():
    # An empty tag is still a part ("" joins as a leading "_"), as in UMBP; an empty model is not.
    assert KeyScheme.from_storage_config(cfg(extra_config={"extra_backend_tag": ""}, model_name="m")).config_prefix == "_m"
    assert KeyScheme.from_storage_config(cfg(model_name="")).config_prefix is None
    scheme = KeyScheme.from_storage_config(cfg(model_name=""))
    assert scheme.side_pool_keys([H], "swa", Pool())[0] == [f"{H}_0_swa"]


# ------------------------------------------------------------------------------------- directories


def deployment(tp_size, pp_size, dp_size, is_mla, dcp_size=1):
    """Every rank's storage config in one deployment (attention-DP ranks get dp_rank)."""
    for dp, pp, tp in itertools.product(range(dp_size), range(pp_size), range(tp_size)):
        # sglang 0.5.23's is_storage_writer: one MLA writer per DCP shard, in the first DCP group
        extra = dict(dcp_size=dcp_size, dcp_rank=tp % dcp_size, is_storage_writer=tp < dcp_size) if dcp_size > 1 else {}
        yield cfg(tp_rank=tp, tp_size=tp_size, pp_rank=pp, pp_size=pp_size, dp_rank=dp, dp_size=dp_size,
                  is_mla_model=is_mla, **extra)


def writer_of(config):
    """The writer rank whose store a follower reads: same DP group, PP stage (and DCP shard)."""
    dcp = getattr(config, "dcp_size", 1)
    return cfg(**{**vars(config), "tp_rank": getattr(config, "dcp_rank", 0) if dcp > 1 else 0})


DEPLOYMENTS = [
    (tp, pp, dp, mla, dcp)
    for tp, pp, dp, mla in itertools.product(SIZES, PP_SIZES, (1, 2), (False, True))
    for dcp in ((1, 2) if mla and tp % 2 == 0 else (1,))
]


@pytest.mark.parametrize("tp_size,pp_size,dp_size,is_mla,dcp_size", DEPLOYMENTS)
def test_each_writer_rank_owns_a_directory_and_followers_read_their_writers(tp_size, pp_size, dp_size, is_mla, dcp_size):
    dirs: dict[str, tuple] = {}
    for config in deployment(tp_size, pp_size, dp_size, is_mla, dcp_size):
        d = rank_subdir(config, {})
        rank = (config.dp_rank, config.pp_rank, config.tp_rank)
        if is_mla_follower(config):
            assert d == rank_subdir(writer_of(config), {}), f"follower {rank} reads {d!r}, not its writer's"
        else:
            assert d not in dirs, f"writers {dirs.get(d)} and {rank} share the store directory {d!r}"
            dirs[d] = rank


def test_rank_subdir_literal_names():
    for tp_size, tp_rank, pp_size, pp_rank in mha_ranks():
        for dp in (None, 0, 1, 2):
            env = {} if dp is None else {"SGLANG_DP_RANK": str(dp)}
            config = cfg(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
            parts = ([f"dp{dp}"] if dp is not None else []) + ([f"pp{pp_rank}"] if pp_size > 1 else [])
            mha = "_".join(parts + ([f"tp{tp_rank}"] if tp_size > 1 else []))
            assert rank_subdir(config, env) == mha, (tp_size, tp_rank, pp_size, pp_rank, dp)
            mla_cfg = cfg(**{**vars(config), "is_mla_model": True})
            mla = "_".join(parts) if tp_size > 1 else mha
            assert rank_subdir(mla_cfg, env) == mla, (tp_size, tp_rank, pp_size, pp_rank, dp)


def test_rank_subdir_dcp_shards_have_their_own_directory():
    for tp_rank in range(4):
        config = cfg(is_mla_model=True, tp_rank=tp_rank, tp_size=4, dcp_size=2, dcp_rank=tp_rank % 2)
        assert rank_subdir(config, {}) == f"dcp{tp_rank % 2}"
        config = cfg(**{**vars(config), "pp_rank": 1, "pp_size": 2})
        assert rank_subdir(config, {"SGLANG_DP_RANK": "1"}) == f"dp1_pp1_dcp{tp_rank % 2}"


@pytest.mark.parametrize("is_mla", [False, True])
@pytest.mark.parametrize("local", ["1", "3", "7"])
def test_single_rank_config_with_a_nonzero_local_rank_gets_rank_dir(is_mla, local):
    # Two processes with tp_size 1 on one machine (LOCAL_RANK 0 and 3) must not open one store.
    assert rank_subdir(cfg(is_mla_model=is_mla), {"LOCAL_RANK": local}) == f"rank{local}"
    assert rank_subdir(cfg(is_mla_model=is_mla), {"LOCAL_RANK": "0"}) == ""


def test_unique_rank_without_local_rank_is_row_major_dp_pp_tp():
    for tp_size, tp_rank, pp_size, pp_rank in mha_ranks():
        for dp in range(3):
            config = cfg(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, dp_rank=dp, dp_size=3)
            assert unique_rank(config, {}) == (dp * pp_size + pp_rank) * tp_size + tp_rank
    # all ranks of a 3 x 3 x 4 deployment are numbered 0 .. 35 exactly once
    got = sorted(unique_rank(c, {}) for c in deployment(4, 3, 3, False))
    assert got == list(range(36))


def test_unique_rank_reads_missing_or_none_sizes_as_one():
    assert unique_rank(NS(), {}) == 0
    assert unique_rank(NS(tp_rank=None, tp_size=None, pp_rank=None, pp_size=None), {}) == 0
    assert unique_rank(NS(tp_rank=1, tp_size=0, pp_rank=1, pp_size=0), {}) == 2


@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_blank_rank_environment_variables_are_unset(blank):
    env = {"LOCAL_RANK": blank, "SGLANG_DP_RANK": blank}
    assert unique_rank(cfg(tp_rank=1, tp_size=2), env) == 1
    assert dp_rank_hint(cfg(), env) is None
    assert rank_subdir(cfg(tp_rank=1, tp_size=2), env) == "tp1"


def test_rank_environment_variables_are_stripped_integers():
    assert unique_rank(cfg(), {"LOCAL_RANK": " 4 "}) == 4
    assert dp_rank_hint(cfg(), {"SGLANG_DP_RANK": " 0 "}) == 0
    assert rank_subdir(cfg(), {"SGLANG_DP_RANK": "0"}) == "dp0"
    with pytest.raises(ValueError, match=r"^environment variable LOCAL_RANK must be an integer, got 'x1'$"):
        unique_rank(cfg(), {"LOCAL_RANK": "x1"})


def test_dp_rank_hint_from_config():
    assert dp_rank_hint(cfg(), {}) is None
    assert dp_rank_hint(cfg(dp_rank=0, dp_size=1), {}) is None
    assert dp_rank_hint(cfg(dp_rank=0, dp_size=2), {}) == 0
    assert dp_rank_hint(cfg(dp_rank=1, dp_size=1), {}) == 1
    assert dp_rank_hint(cfg(dp_rank=None, dp_size=None), {}) is None
    assert dp_rank_hint(cfg(dp_rank=2, dp_size=4), {"SGLANG_DP_RANK": "3"}) == 3


def test_rank_functions_default_to_os_environ(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "6")
    monkeypatch.setenv("SGLANG_DP_RANK", "2")
    assert unique_rank(cfg()) == 6
    assert dp_rank_hint(cfg()) == 2
    assert rank_subdir(cfg(tp_rank=1, tp_size=2)) == "dp2_tp1"
    assert rank_subdir(None) == ""


def test_followers_are_exactly_the_non_writer_mla_ranks():
    for tp_size, tp_rank, pp_size, pp_rank in mha_ranks():
        mha = cfg(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
        assert is_mla_follower(mha) is False
        mla = cfg(**{**vars(mha), "is_mla_model": True})
        assert is_mla_follower(mla) is (tp_size > 1 and tp_rank != 0)
    # tp_size None reads as 1: no followers
    assert is_mla_follower(cfg(is_mla_model=True, tp_rank=1, tp_size=None)) is False
    # a truthy non-bool is_storage_writer is not sglang's property: UMBP's rule decides
    assert is_mla_follower(cfg(is_mla_model=True, tp_rank=1, tp_size=2, is_storage_writer=1)) is True
    assert is_mla_follower(cfg(is_mla_model=True, tp_rank=None, tp_size=2)) is False


# ------------------------------------------------------------------------------------- partial configs
# sglang's config fields move between commits (spec: read every optional field with a default).
# A config that lacks a field behaves as the field's default: no MLA, TP/PP size 1, rank 0.


def test_partial_configs_read_missing_fields_as_their_defaults():
    assert is_mla_follower(NS(tp_rank=1, tp_size=2)) is False  # no is_mla_model: not MLA
    assert is_mla_follower(NS(is_mla_model=True, tp_rank=1)) is False  # no tp_size: one rank
    assert is_mla_follower(NS(is_mla_model=True, tp_size=2)) is False  # no tp_rank: rank 0, the writer
    assert is_mla_follower(NS(is_mla_model=True, tp_size=2, tp_rank=1)) is True
    assert unique_rank(NS(pp_rank=1, tp_rank=1), {}) == 2  # tp_size 1: pp stage 1 is rank 1, +tp
    assert unique_rank(NS(dp_rank=1), {}) == 1  # pp_size 1, tp_size 1
    assert unique_rank(NS(dp_rank=1, pp_size=0, tp_size=None), {}) == 1  # 0 / None sizes read as 1
    assert unique_rank(NS(dp_rank=1, pp_size=2, pp_rank=None, tp_rank=None), {}) == 2
    assert rank_subdir(NS(), {}) == ""
    assert rank_subdir(NS(tp_rank=1, tp_size=2), {}) == "tp1"
    assert rank_subdir(NS(is_mla_model=True, tp_size=2, dcp_size=2), {}) == "dcp0"
    scheme = KeyScheme.from_storage_config(NS())
    assert scheme == KeyScheme() and scheme.v1_keys([H]) == [f"{H}_0_k", f"{H}_0_v"]


def test_multiplier_counts_the_objects_of_a_page():
    for config, plain, envelope in [
        (cfg(), 2, 1),
        (cfg(is_mla_model=True), 1, 1),
        (split_cfg(2, 3, 1, 1, 0), 6, 1),
    ]:
        scheme = KeyScheme.from_storage_config(config)
        assert scheme.v1_multiplier() == scheme.multiplier == plain == len(scheme.v1_keys([H]))
        assert scheme.v1_multiplier(envelope=True) == envelope == len(scheme.v1_keys([H], envelope=True))


def test_component_keys_pass_the_rank_suffix_through():
    from umbp_nvme.sglang.keys import PoolRegistry

    reg = PoolRegistry()
    reg.register("indexer", Pool())
    reg.register("swa", Pool(v_buffer=1))
    scheme = KeyScheme.from_storage_config(cfg(is_mla_model=True, model_name="m"))
    assert scheme.component_keys([H], "indexer", reg) == ([f"m_{H}__indexer"], 1)
    assert scheme.component_keys([H], "indexer", reg, rank_suffix="3") == ([f"m_{H}_3_indexer"], 1)
    mha = KeyScheme.from_storage_config(cfg(tp_rank=1, tp_size=2))
    assert mha.component_keys([H], "swa", reg, rank_suffix="0") == ([f"{H}_0_swa_k", f"{H}_0_swa_v"], 2)
    assert mha.component_keys([H], "swa", reg) == ([f"{H}_1_swa_k", f"{H}_1_swa_v"], 2)


def test_registry_items_are_a_snapshot_of_name_pool_pairs():
    from umbp_nvme.sglang.keys import PoolRegistry

    reg = PoolRegistry()
    a, b = Pool(), Pool()
    reg.register("mamba", a)
    reg.register("swa", b)
    items = reg.items()
    assert items == [("mamba", a), ("swa", b)]
    reg.register("indexer", a)
    assert len(items) == 2 and len(reg.items()) == 3
    assert "indexer" in reg and "kv" not in reg


def test_unregistered_pool_messages_in_full():
    from umbp_nvme.sglang.keys import UnregisteredPoolError

    assert str(UnregisteredPoolError("swa", ["mamba"])) == (
        "Unregistered UMBP hybrid pool: swa. Registered pools: mamba. "
        "Register it with register_mem_host_pool_v2(host_pool, name) before batch I/O."
    )
    # KV is never a side pool: the hint says where KV goes instead
    assert str(UnregisteredPoolError("kv")) == (
        "Unregistered UMBP hybrid pool: kv. Registered pools: none. The KV anchor is never a side pool: it is "
        "registered with register_mem_pool_host and read and written through batch_get_v1 / batch_set_v1."
    )


FIELD_DEFAULTS = dict(
    tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False, dp_rank=0, dp_size=1, dcp_rank=0, dcp_size=1,
    attn_cp_rank=0, model_name=None, extra_config=None, should_split_heads=False,
)

BASE_CONFIGS = [
    dict(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, dp_rank=1, dp_size=2),
    dict(tp_rank=3, tp_size=4, pp_rank=2, pp_size=3, is_mla_model=True, dp_rank=1, dp_size=2),
    dict(tp_rank=1, tp_size=4, is_mla_model=True, dcp_rank=1, dcp_size=2, attn_cp_rank=1, pp_rank=1, pp_size=2),
    dict(tp_rank=1, tp_size=2, should_split_heads=True, tp_lcm_size=4, model_name="o/m", extra_config={"extra_backend_tag": "t"}),
    dict(tp_rank=0, tp_size=1, pp_rank=1, pp_size=2, dp_rank=2, dp_size=3, model_name="m"),
]


def observe(config, env):
    scheme = KeyScheme.from_storage_config(config)
    return (
        scheme.v1_keys([H]), scheme.side_pool_keys([H], "indexer", Pool())[0], scheme.config_prefix,
        rank_subdir(config, env), unique_rank(config, env), is_mla_follower(config), dp_rank_hint(config, env),
    )


@pytest.mark.parametrize("base", BASE_CONFIGS, ids=range(len(BASE_CONFIGS)))
@pytest.mark.parametrize("field", sorted(FIELD_DEFAULTS))
def test_a_missing_or_none_field_reads_as_its_default(base, field):
    # Fields move between sglang commits: a config without one, or with None in it, behaves
    # exactly like the same config with the field at its default.
    if field == "should_split_heads" and base.get("should_split_heads"):
        return  # tp_lcm_size then means nothing; covered by test_split_heads_flag_off_ignores_tp_lcm_size
    for env in ({}, {"LOCAL_RANK": "5"}):
        with_default = NS(**{**base, field: FIELD_DEFAULTS[field]})
        missing = NS(**{k: v for k, v in base.items() if k != field})
        as_none = NS(**{**base, field: None})
        expected = observe(with_default, env)
        assert observe(missing, env) == expected
        assert observe(as_none, env) == expected


def test_split_heads_without_tp_lcm_size_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"tp_lcm_size=None, tp_size=2$"):
        KeyScheme.from_storage_config(NS(tp_rank=0, tp_size=2, should_split_heads=True))


def test_scheme_carries_every_rank_field_of_the_config():
    config = cfg(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, is_mla_model=True, dcp_rank=1, dcp_size=2,
                 attn_cp_rank=2, model_name="m")
    assert KeyScheme.from_storage_config(config) == KeyScheme(
        tp_rank=3, tp_size=4, pp_rank=1, pp_size=2, is_mla=True, split_factor=0, config_prefix="m",
        dcp_rank=1, dcp_size=2, attn_cp_rank=2,
    )
