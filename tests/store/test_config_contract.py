"""StoreConfig boundaries and layering, stated as rules (issue 17).

For each numeric key: the smallest allowed value is accepted and the next one below is refused,
from extra_config and from the environment alike; every default is pinned; a value set in the
environment survives an extra_config that does not name it.
"""

from __future__ import annotations

import logging
import os

import pytest

from umbp_nvme.config import ENV_KEYS, GiB, MiB, StoreConfig, load_config, parse_bool


def load(extra=None, env=None):
    return load_config(extra, env or {})


def error_of(extra=None, env=None) -> str:
    with pytest.raises(ValueError) as err:
        load(extra, env)
    return str(err.value)


def test_every_default_is_pinned():
    cfg = StoreConfig()
    assert vars(cfg) == dict(
        ssd_storage_dir="/tmp/umbp_ssd",
        ssd_capacity_bytes=32 * GiB,
        ssd_segment_size_bytes=256 * MiB,
        ssd_queue_depth=256,
        ssd_io_backend="io_uring",
        ssd_write_slice_bytes=8 * MiB,
        ssd_read_priority="on",
        ssd_crc_worker=True,
        ssd_crc_policy="nice",
        ssd_crc_nice=19,
        ssd_durability_mode="strict",
        ssd_high_watermark=0.98,
        ssd_low_watermark=0.95,
        eviction_policy="lru",
        admission_policy="auto",
        verify_crc=True,
        io_timeout_s=30.0,
        o_direct=True,
        extra_backend_tag=None,
        ssd_enabled=True,
        dram_capacity_bytes=4 * GiB,
        eviction_candidate_window=16,
        auto_promote_on_read=True,
        gds_staging=False,
        ssd_require_mount=False,
        ssd_background_open_bytes=64 * MiB,
        ssd_record_cache_bytes=64 * MiB,
    )
    assert load() == cfg and cfg.validate() is cfg
    assert (GiB, MiB) == (1 << 30, 1 << 20)


# key -> (smallest accepted, largest refused below it)
INT_MINIMA = {
    "ssd_queue_depth": (1, 0),
    "ssd_crc_nice": (0, -1),
    "eviction_candidate_window": (0, -1),
    "dram_capacity_bytes": (0, -1),
    "ssd_copy_queue_depth": (0, -1),
    "ssd_copy_worker_threads": (0, -1),
    "ssd_copy_batch_max_ops": (0, -1),
}


@pytest.mark.parametrize("key", sorted(INT_MINIMA))
def test_each_integer_key_accepts_its_minimum_and_refuses_one_below(key):
    lo, below = INT_MINIMA[key]
    for value in (lo, str(lo), float(lo), f" {lo} ", f"+{lo}"):
        cfg = load({key: value})
        if hasattr(cfg, key):
            assert getattr(cfg, key) == lo and type(getattr(cfg, key)) is int
    for value in (below, str(below)):
        assert error_of({key: value}) == f"extra_config[{key!r}] must be an integer >= {lo}, got {value!r}"


def test_segment_and_capacity_boundaries():
    # one 4 KiB segment and a capacity of exactly one segment: the smallest store there is
    cfg = load({"ssd_segment_size_bytes": 4096, "ssd_capacity_bytes": 4096})
    assert (cfg.ssd_segment_size_bytes, cfg.ssd_capacity_bytes) == (4096, 4096)
    cfg = load({"ssd_segment_size_bytes": 8192, "ssd_capacity_bytes": 8192})
    assert cfg.ssd_capacity_bytes == cfg.ssd_segment_size_bytes == 8192
    assert error_of({"ssd_segment_size_bytes": 8192, "ssd_capacity_bytes": 8191}).startswith(
        "ssd_capacity_bytes (8191) must be at least ssd_segment_size_bytes (8192): the store needs room for one "
        "segment; lower ssd_segment_size_bytes or raise ssd_capacity_bytes"
    )
    for seg in (4095, 4097, 6144, 1):
        assert error_of({"ssd_segment_size_bytes": seg, "ssd_capacity_bytes": GiB}) == (
            f"ssd_segment_size_bytes must be a multiple of 4096 (O_DIRECT alignment), got {seg}"
        )


@pytest.mark.parametrize("value", [0.1, "0.1", 0.3, 0.5, "0.5", 1, "30", 86400.0, "86400"])
def test_io_timeout_in_range_is_accepted(value):
    assert load({"io_timeout_s": value}).io_timeout_s == float(value)


@pytest.mark.parametrize("value", [1e-300, "1e-300", 5e-324, 1e-3, 0.099, 86400.5, 1e10, "1e300", 1.7e308])
def test_io_timeout_out_of_range_is_refused_naming_the_key(value):
    # 1e-300 failed every operation; 1e10 made SyncPageStore's open raise OverflowError (threading.TIMEOUT_MAX)
    assert error_of({"io_timeout_s": value}) == (
        f"extra_config['io_timeout_s'] must be between 0.1 and 86400 seconds, got {value!r}: "
        "shorter fails healthy operations, longer overflows the waits built on it")
    assert error_of(env={"UMBP_IO_TIMEOUT_S": str(value)}).startswith(
        "UMBP_IO_TIMEOUT_S must be between 0.1 and 86400 seconds, got ")
    with pytest.raises(ValueError, match=r"^io_timeout_s must be between 0.1 and 86400 seconds, got "):
        StoreConfig(io_timeout_s=float(value))


@pytest.mark.parametrize("field,value", [("ssd_low_watermark", "0.5"), ("ssd_high_watermark", "0.95"),
                                         ("ssd_high_watermark", True), ("ssd_low_watermark", None)])
def test_watermark_of_the_wrong_type_set_by_hand_is_a_value_error(field, value):
    # a str was a TypeError from the comparison; True passed as 1.0
    with pytest.raises(ValueError, match=r"^SSD watermarks must satisfy 0 < ssd_low_watermark < ssd_high_watermark"):
        StoreConfig(**{field: value})


@pytest.mark.parametrize("value", [0, 0.0, "-0.5", -1e-9])
def test_non_positive_io_timeout_is_refused(value):
    assert error_of({"io_timeout_s": value}) == f"extra_config['io_timeout_s'] must be a positive number, got {value!r}"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "inf", "x", None, True])
def test_non_finite_io_timeout_is_refused(value):
    assert error_of({"io_timeout_s": value}) == f"extra_config['io_timeout_s'] must be a finite number, got {value!r}"


@pytest.mark.parametrize(
    "field,value",
    [("io_timeout_s", 0), ("io_timeout_s", -1.0), ("io_timeout_s", float("nan")), ("io_timeout_s", float("inf")),
     ("io_timeout_s", "5"), ("io_timeout_s", None), ("io_timeout_s", True)],
)
def test_validate_refuses_a_bad_timeout_set_by_hand(field, value):
    # the config is checked once, when it is made: no StoreConfig with a bad value exists
    with pytest.raises(ValueError, match=r"^io_timeout_s must be a positive number of seconds, got "):
        StoreConfig(**{field: value})


def test_validate_accepts_every_boundary_set_by_hand():
    cfg = StoreConfig(ssd_capacity_bytes=4096, ssd_segment_size_bytes=4096, ssd_queue_depth=1, io_timeout_s=1,
                      ssd_low_watermark=1e-9, ssd_high_watermark=1.0, ssd_io_backend="posix",
                      ssd_durability_mode="relaxed", eviction_policy="prefix_aware")
    assert cfg.validate() is cfg


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("ssd_storage_dir", "", "ssd_storage_dir must be a non-empty path, got ''"),
        ("ssd_storage_dir", "  ", "ssd_storage_dir must be a non-empty path, got '  '"),
        ("ssd_storage_dir", 5, "ssd_storage_dir must be a non-empty path, got 5"),
        ("ssd_capacity_bytes", 0, "ssd_capacity_bytes must be a positive integer, got 0"),
        ("ssd_capacity_bytes", True, "ssd_capacity_bytes must be a positive integer, got True"),
        ("ssd_segment_size_bytes", 4096.0, "ssd_segment_size_bytes must be a positive integer, got 4096.0"),
        ("ssd_queue_depth", 0, "ssd_queue_depth must be a positive integer, got 0"),
        ("ssd_queue_depth", -3, "ssd_queue_depth must be a positive integer, got -3"),
        ("ssd_io_backend", "auto2", "ssd_io_backend must be one of: posix, io_uring, auto; got 'auto2'"),
        ("ssd_durability_mode", "fsync", "ssd_durability_mode must be 'strict' or 'relaxed', got 'fsync'"),
        ("eviction_policy", "fifo", "eviction_policy must be one of: lru, prefix_aware; got 'fifo'"),
        ("ssd_crc_policy", "fast", "ssd_crc_policy must be one of: idle, batch, nice, normal; got 'fast'"),
        ("ssd_crc_nice", 20, "ssd_crc_nice must be an integer in [0, 19], got 20"),
        ("ssd_crc_nice", True, "ssd_crc_nice must be an integer in [0, 19], got True"),
    ],
)
def test_validate_names_the_field_and_value(field, value, message):
    with pytest.raises(ValueError) as err:
        StoreConfig(**{field: value}).validate()
    assert str(err.value) == message


@pytest.mark.parametrize("low,high", [(0.7, 0.9), (1e-6, 1.0), (0.89, 0.9), (0.5, 0.500001)])
def test_watermarks_inside_the_range_are_accepted(low, high):
    cfg = load({"ssd_low_watermark": low, "ssd_high_watermark": high})
    assert (cfg.ssd_low_watermark, cfg.ssd_high_watermark) == (low, high)


def test_every_environment_variable_reaches_its_field():
    env = {
        "UMBP_SSD_DIR": "/e", "UMBP_SSD_CAPACITY": str(2 * GiB), "UMBP_SSD_ENABLED": "off",
        "UMBP_SSD_HIGH_WM": "0.8", "UMBP_SSD_LOW_WM": "0.4", "UMBP_EVICTION_POLICY": "prefix_aware",
        "UMBP_DRAM_CAPACITY": "0", "UMBP_SSD_BACKEND": "file", "UMBP_DISABLE_ZERO_COPY_REGISTER": "1",
        "UMBP_SSD_SEGMENT_SIZE": str(MiB), "UMBP_SSD_IO_BACKEND": "POSIX", "UMBP_SSD_DURABILITY": "async",
        "UMBP_VERIFY_CRC": "no", "UMBP_SSD_QUEUE_DEPTH": "1", "UMBP_IO_TIMEOUT_S": "0.5", "UMBP_O_DIRECT": "false",
        "UMBP_GDS_STAGING": "on", "UMBP_SSD_WRITE_SLICE_BYTES": str(16 * MiB), "UMBP_SSD_READ_PRIORITY": "off",
        "UMBP_SSD_REQUIRE_MOUNT": "yes", "UMBP_ADMISSION_POLICY": "second", "UMBP_SSD_CRC_WORKER": "off",
        "UMBP_SSD_CRC_POLICY": " Idle ", "UMBP_SSD_CRC_NICE": "5", "UMBP_SSD_BACKGROUND_OPEN_BYTES": "1m",
        "UMBP_SSD_RECORD_CACHE_BYTES": "2m",
    }
    assert set(env) == set(ENV_KEYS)
    cfg = load(env=env)
    assert (cfg.ssd_storage_dir, cfg.ssd_capacity_bytes, cfg.ssd_enabled) == ("/e", 2 * GiB, False)
    assert (cfg.ssd_high_watermark, cfg.ssd_low_watermark, cfg.eviction_policy) == (0.8, 0.4, "prefix_aware")
    assert (cfg.dram_capacity_bytes, cfg.ssd_segment_size_bytes, cfg.ssd_io_backend) == (0, MiB, "posix")
    assert (cfg.ssd_durability_mode, cfg.verify_crc, cfg.ssd_queue_depth) == ("relaxed", False, 1)
    assert (cfg.ssd_background_open_bytes, cfg.ssd_record_cache_bytes) == (MiB, 2 * MiB)
    assert (cfg.io_timeout_s, cfg.o_direct, cfg.gds_staging) == (0.5, False, True)
    assert (cfg.ssd_write_slice_bytes, cfg.ssd_read_priority, cfg.ssd_require_mount) == (16 * MiB, "off", True)
    assert cfg.admission_policy == "second"
    assert (cfg.ssd_crc_worker, cfg.ssd_crc_policy, cfg.ssd_crc_nice) == (False, "idle", 5)
    # extra_config overrides each one it names and leaves the others alone
    cfg = load({"o_direct": True, "ssd_queue_depth": 8}, env)
    assert (cfg.o_direct, cfg.ssd_queue_depth, cfg.verify_crc, cfg.io_timeout_s) == (True, 8, False, 0.5)


def test_env_layer_parses_with_the_variable_name_and_skips_only_empty_values():
    assert error_of(env={"UMBP_O_DIRECT": "maybe"}) == (
        "UMBP_O_DIRECT must be a boolean-like value (true/false, 1/0, yes/no, on/off), got 'maybe'"
    )
    assert error_of(env={"UMBP_SSD_QUEUE_DEPTH": "0"}) == "UMBP_SSD_QUEUE_DEPTH must be an integer >= 1, got '0'"
    assert load(env={"UMBP_SSD_QUEUE_DEPTH": ""}).ssd_queue_depth == 256
    # a blank (not empty) value is a value, and not an integer
    assert error_of(env={"UMBP_SSD_QUEUE_DEPTH": " "}) == "UMBP_SSD_QUEUE_DEPTH must be an integer >= 1, got ' '"
    # UMBP_SSD_BACKEND=file is accepted and changes nothing
    assert load(env={"UMBP_SSD_BACKEND": " FILE "}) == StoreConfig()


@pytest.mark.parametrize("var", ["UMBP_MASTER_ADDRESS", "UMBP_STANDALONE_ADDRESS", "UMBP_SPDK_NVME_PCI"])
def test_remote_environment_is_refused_only_when_set(var):
    assert load(env={var: ""}) == StoreConfig()
    assert load(env={var: "   "}) == StoreConfig()
    msg = error_of(env={var: "10.0.0.1:5000"})
    what = "SPDK" if "SPDK" in var else "UMBP's remote (master / standalone-process) modes"
    assert msg == (
        f"{var}='10.0.0.1:5000' selects {what}, but umbp_nvme is a local-NVMe backend: each process stores its "
        "pages in files under ssd_storage_dir. Remove this key (and any other master_address / standalone_* / "
        "spdk_* keys) from the config."
    )


@pytest.mark.parametrize("key", ["master_address", "standalone_address", "standalone_port", "spdk_nvme_pci", "spdk_x"])
def test_remote_keys_are_refused_only_when_set(key):
    assert load({key: None}) == StoreConfig()
    assert load({key: ""}) == StoreConfig()
    msg = error_of({key: "h:1"})
    what = "SPDK" if key.startswith("spdk") else "UMBP's remote (master / standalone-process) modes"
    assert msg.startswith(f"extra_config[{key!r}]='h:1' selects {what}, but umbp_nvme is a local-NVMe backend")


def test_near_miss_remote_key_names_are_only_unknown(caplog):
    with caplog.at_level(logging.WARNING):
        assert load({"master": "x", "xstandalone_address": "y", "my_spdk_x": 1}) == StoreConfig()
    assert sum("unknown extra_config key" in r.getMessage() for r in caplog.records) == 3


def test_ignored_keys_are_type_checked():
    assert load({"ssd_copy_async": "yes", "disable_zero_copy_register": 0, "ssd_copy_queue_depth": "0"}) == StoreConfig()
    with pytest.raises(ValueError, match=r"^extra_config\['ssd_copy_async'\] must be a boolean-like value"):
        load({"ssd_copy_async": "sometimes"})


def test_kv_events_keys_are_accepted_and_a_subscriber_warns(caplog):
    with caplog.at_level(logging.WARNING):
        assert load({"kv_events_subscriber": "", "kv_events_endpoint": "tcp://x:1", "kv_events_topic": "t"}) == StoreConfig()
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert load({"kv_events_subscriber": True}) == StoreConfig()
    assert [r.getMessage() for r in caplog.records] == [
        "umbp_nvme: extra_config['kv_events_subscriber'] is set, but this backend subscribes to no KV events; ignored "
        "(kv_events_endpoint publishes this store's DISK events: docs/fleet.md)."
    ]


def test_unknown_and_distributed_key_warnings_name_the_key(caplog):
    with caplog.at_level(logging.WARNING):
        load({"ssd_capacity": 1, "node_address": "n", "zzz": 2})
        load_config({"promethus": 1}, env={}, known=["prometheus"])  # a key the caller takes out itself
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == [
        "umbp_nvme: unknown extra_config key 'ssd_capacity' is ignored. Did you mean 'ssd_capacity_bytes'?",
        "umbp_nvme: extra_config['node_address'] only applies to UMBP's distributed mode and is ignored by this "
        "local-NVMe backend.",
        "umbp_nvme: unknown extra_config key 'zzz' is ignored. Known keys are UMBP's (ssd_storage_dir, "
        "ssd_capacity_bytes, ssd_io_backend, ...; docs/sglang.md §9).",
        "umbp_nvme: unknown extra_config key 'promethus' is ignored. Did you mean 'prometheus'?",
    ]


@pytest.mark.parametrize("key", ["ssd_capacity_bytes", "ssd_segment_size_bytes", "ssd_write_slice_bytes", "dram_capacity_bytes"])
def test_byte_keys_take_binary_units_and_refuse_decimal_looking_ones(key):
    assert getattr(load({key: "512MiB"}), key) == 512 << 20
    assert getattr(load({key: " 0.5 g "}), key) == 512 << 20
    err = error_of({key: "10GB"})
    assert err.startswith(f"extra_config[{key!r}]: '10GB' is ambiguous") and "10GiB or 10g (10737418240 bytes" in err


def test_a_home_relative_storage_dir_is_expanded():
    home = os.path.expanduser("~")
    assert load({"ssd_storage_dir": "~/kv"}).ssd_storage_dir == os.path.join(home, "kv")
    assert load({"ssd_storage_dir": ["~/a", "/b"]}).storage_roots == [os.path.join(home, "a"), "/b"]


def test_dir_accepts_path_like_and_keeps_it_verbatim():
    import pathlib

    assert load({"ssd_storage_dir": pathlib.Path("/mnt/x")}).ssd_storage_dir == "/mnt/x"
    assert load({"ssd_storage_dir": " /mnt/y "}).ssd_storage_dir == " /mnt/y "
    assert os.fspath(load({"ssd_storage_dir": "rel"}).ssd_storage_dir) == "rel"


@pytest.mark.parametrize("value,expected", [(True, True), (False, False), (1, True), (0, False), (" On ", True),
                                            ("NO", False), ("1", True), ("0", False), ("Yes", True), ("off", False)])
def test_parse_bool_accepts_exactly_the_boolean_likes(value, expected):
    assert parse_bool(value, "L") is expected


@pytest.mark.parametrize("value", [2, -1, "2", "", "y", "t", "nope", 1.0, 0.0, None, [1]])
def test_parse_bool_refuses_everything_else(value):
    with pytest.raises(ValueError) as err:
        parse_bool(value, "L")
    assert str(err.value) == f"L must be a boolean-like value (true/false, 1/0, yes/no, on/off), got {value!r}"


def test_string_enums_are_stripped_and_lowered_from_both_layers():
    cfg = load({"ssd_durability_mode": " Sync ", "eviction_policy": "Prefix_Aware"}, {"UMBP_SSD_IO_BACKEND": " Io_Uring "})
    assert (cfg.ssd_durability_mode, cfg.eviction_policy, cfg.ssd_io_backend) == ("strict", "prefix_aware", "io_uring")
    assert error_of({"ssd_durability_mode": "fast"}) == (
        "extra_config['ssd_durability_mode'] must be one of: strict, sync, relaxed, async; got 'fast'"
    )
    assert error_of({"ssd_backend": "nfs"}) == "extra_config['ssd_backend'] must be one of: file, spdk, spdk_proxy; got 'nfs'"


def test_an_empty_environment_variable_skips_only_itself():
    # UMBP_SSD_DIR comes first in ENV_KEYS: leaving it empty must not drop the variables after it.
    env = {var: "" for var in ENV_KEYS}
    env["UMBP_O_DIRECT"] = "0"  # the last one
    env["UMBP_SSD_CAPACITY"] = str(2 * GiB)
    cfg = load(env=env)
    assert (cfg.o_direct, cfg.ssd_capacity_bytes, cfg.ssd_storage_dir) == (False, 2 * GiB, "/tmp/umbp_ssd")


@pytest.mark.parametrize("minimum", [0, 1, 7])
def test_integer_parsers_accept_integral_values_from_their_minimum(minimum):
    from umbp_nvme.config import int_parser

    parse = int_parser(minimum)
    for value in (minimum, minimum + 1, float(minimum), str(minimum), f" +{minimum + 2} ", 10**12):
        expected = int(str(value).strip()) if isinstance(value, str) else int(value)
        got = parse(value, "L")
        assert got == expected and type(got) is int
    for value in (minimum - 1, str(minimum - 1), float(minimum) - 0.5, True, False, None, "", "1e3", "x", [minimum]):
        with pytest.raises(ValueError) as err:
            parse(value, "L")
        assert str(err.value) == f"L must be an integer >= {minimum}, got {value!r}"


def test_spdk_backend_message_in_full():
    assert error_of({"ssd_backend": " SPDK "}) == (
        "extra_config['ssd_backend'] is ' SPDK ', but umbp_nvme is a local-NVMe backend that stores pages in "
        "files on a mounted file system; SPDK is not supported. Remove the key or set it to 'file', and drop any "
        "spdk_* keys."
    )


def test_an_empty_remote_key_skips_only_itself():
    # An empty master_address is "not set" (UMBP); the keys after it still apply, in order.
    cfg = load({"master_address": "", "ssd_queue_depth": 3, "standalone_address": None, "o_direct": False})
    assert (cfg.ssd_queue_depth, cfg.o_direct) == (3, False)


@pytest.mark.parametrize("alias,mode", [("sync", "strict"), ("async", "relaxed"), (" Strict ", "strict")])
def test_durability_aliases_are_mapped_once_when_the_config_is_made(alias, mode):
    assert StoreConfig(ssd_durability_mode=alias).ssd_durability_mode == mode
