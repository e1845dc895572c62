"""load_config: defaults -> UMBP_* env -> extra_config, and every error message (spec §6.11)."""

from __future__ import annotations

import logging

import pytest

from umbp_nvme.config import GiB, MiB, StoreConfig, load_config


def load(extra=None, env=None):
    return load_config(extra, env or {})


def test_defaults_without_env_or_extra():
    cfg = load()
    assert cfg == StoreConfig()
    assert cfg.ssd_storage_dir == "/tmp/umbp_ssd"
    assert cfg.ssd_capacity_bytes == 32 * GiB
    assert cfg.ssd_segment_size_bytes == 256 * MiB
    assert (cfg.ssd_high_watermark, cfg.ssd_low_watermark) == (0.98, 0.95)
    assert cfg.ssd_durability_mode == "strict" and cfg.ssd_io_backend == "io_uring"
    assert cfg.ssd_enabled is True and cfg.dram_capacity_bytes == 4 * GiB


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("UMBP_SSD_DIR", "/mnt/from-env")
    assert load_config().ssd_storage_dir == "/mnt/from-env"


def test_the_spec_launch_config():
    cfg = load(
        {
            "backend_name": "umbp_nvme",
            "module_path": "umbp_nvme.sglang_backend",
            "class_name": "UMBPNvmeStore",
            "interface_v1": 1,
            "ssd_storage_dir": "/mnt/nvme0/hicache",
            "ssd_capacity_bytes": 549755813888,
            "dram_capacity_bytes": 0,
            "ssd_io_backend": "io_uring",
            "ssd_durability_mode": "relaxed",
            "ssd_queue_depth": 256,
            "extra_backend_tag": "prod",
        }
    )
    assert cfg.ssd_storage_dir == "/mnt/nvme0/hicache"
    assert cfg.ssd_capacity_bytes == 549755813888
    assert cfg.dram_capacity_bytes == 0
    assert cfg.ssd_durability_mode == "relaxed"
    assert cfg.ssd_queue_depth == 256
    assert cfg.extra_backend_tag == "prod"


ENV_CASES = [
    ("UMBP_SSD_DIR", "/d", "ssd_storage_dir", "/d"),
    ("UMBP_SSD_CAPACITY", "1073741824", "ssd_capacity_bytes", GiB),
    ("UMBP_SSD_ENABLED", "0", "ssd_enabled", False),
    ("UMBP_SSD_HIGH_WM", "0.99", "ssd_high_watermark", 0.99),
    ("UMBP_SSD_LOW_WM", "0.5", "ssd_low_watermark", 0.5),
    ("UMBP_EVICTION_POLICY", "prefix_aware", "eviction_policy", "prefix_aware"),
    ("UMBP_DRAM_CAPACITY", "0", "dram_capacity_bytes", 0),
    ("UMBP_SSD_IO_BACKEND", "POSIX", "ssd_io_backend", "posix"),
    ("UMBP_SSD_DURABILITY", "async", "ssd_durability_mode", "relaxed"),
    ("UMBP_VERIFY_CRC", "off", "verify_crc", False),
    ("UMBP_SSD_QUEUE_DEPTH", "64", "ssd_queue_depth", 64),
    ("UMBP_IO_TIMEOUT_S", "2.5", "io_timeout_s", 2.5),
    ("UMBP_SSD_SEGMENT_SIZE", "8192", "ssd_segment_size_bytes", 8192),
    ("UMBP_O_DIRECT", "false", "o_direct", False),
]


@pytest.mark.parametrize("var,raw,field,expected", ENV_CASES)
def test_env_variable_sets_field(var, raw, field, expected):
    assert getattr(load(env={var: raw}), field) == expected


def test_empty_env_value_means_default():
    assert load(env={"UMBP_SSD_CAPACITY": ""}).ssd_capacity_bytes == 32 * GiB


def test_extra_config_overrides_env():
    cfg = load({"ssd_storage_dir": "/from-extra", "ssd_io_backend": "posix"}, {"UMBP_SSD_DIR": "/from-env", "UMBP_SSD_IO_BACKEND": "io_uring"})
    assert cfg.ssd_storage_dir == "/from-extra"
    assert cfg.ssd_io_backend == "posix"


@pytest.mark.parametrize(
    "raw,expected",
    [("strict", "strict"), ("sync", "strict"), ("relaxed", "relaxed"), ("async", "relaxed"), (" STRICT ", "strict"), ("Async", "relaxed")],
)
def test_durability_aliases(raw, expected):
    assert load({"ssd_durability_mode": raw}).ssd_durability_mode == expected


@pytest.mark.parametrize("raw,expected", [("posix", "posix"), (" IO_URING ", "io_uring")])
def test_io_backend_is_stripped_and_lowered(raw, expected):
    assert load({"ssd_io_backend": raw}).ssd_io_backend == expected


# ---------------------------------------------------------------------------- exact messages

def error_of(extra=None, env=None) -> str:
    with pytest.raises(ValueError) as err:
        load(extra, env)
    return str(err.value)


def test_io_backend_message():
    msg = error_of({"ssd_io_backend": "aio"})
    assert msg.startswith("extra_config['ssd_io_backend'] must be one of: posix, io_uring")
    assert "'aio'" in msg


def test_durability_message():
    msg = error_of({"ssd_durability_mode": "eventual"})
    assert msg.startswith("extra_config['ssd_durability_mode'] must be one of: strict, sync, relaxed, async")
    assert "'eventual'" in msg


def test_ssd_backend_message_for_unknown_value():
    msg = error_of({"ssd_backend": "nfs"})
    assert msg.startswith("extra_config['ssd_backend'] must be one of: file, spdk, spdk_proxy")
    assert "'nfs'" in msg


def test_ssd_backend_file_is_accepted():
    assert load({"ssd_backend": " File "}) == StoreConfig()


@pytest.mark.parametrize("backend", ["spdk", "spdk_proxy", "SPDK"])
def test_ssd_backend_spdk_is_refused(backend):
    msg = error_of({"ssd_backend": backend})
    assert "local-NVMe backend" in msg and "SPDK" in msg and "Remove the key" in msg


def test_ssd_backend_spdk_from_env_is_refused():
    assert "local-NVMe backend" in error_of(env={"UMBP_SSD_BACKEND": "spdk"})


BOOL_KEYS = ["ssd_enabled", "auto_promote_on_read", "ssd_copy_async", "disable_zero_copy_register", "verify_crc", "o_direct"]


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("value", ["maybe", 2, -1, 0.5, None, "", "tru"])
def test_bool_message(key, value):
    assert error_of({key: value}) == (
        f"extra_config[{key!r}] must be a boolean-like value (true/false, 1/0, yes/no, on/off), got {value!r}"
    )


@pytest.mark.parametrize(
    "value,expected",
    [(True, True), (False, False), (1, True), (0, False), ("true", True), ("FALSE", False), (" yes ", True),
     ("no", False), ("On", True), ("off", False), ("1", True), ("0", False)],
)
def test_strict_bool_accepts(value, expected):
    assert load({"ssd_enabled": value}).ssd_enabled is expected


def test_string_false_is_false():
    assert load({"verify_crc": "false"}).verify_crc is False


def test_env_bool_message_names_the_variable():
    assert error_of(env={"UMBP_SSD_ENABLED": "nah"}) == (
        "UMBP_SSD_ENABLED must be a boolean-like value (true/false, 1/0, yes/no, on/off), got 'nah'"
    )


INT_KEYS = ["ssd_capacity_bytes", "ssd_segment_size_bytes", "ssd_queue_depth", "dram_capacity_bytes",
            "eviction_candidate_window", "ssd_copy_queue_depth", "ssd_copy_worker_threads", "ssd_copy_batch_max_ops"]


@pytest.mark.parametrize("key", INT_KEYS)
@pytest.mark.parametrize("value", [True, -1, "-5", "12abc", "0x10", 1.5, None, [4096]])
def test_int_message_names_key_and_value(key, value):
    msg = error_of({key: value})
    assert msg.startswith(f"extra_config[{key!r}] must be an integer >= ")
    assert msg.endswith(f"got {value!r}")


@pytest.mark.parametrize("value", ["1073741824", " 1073741824 ", 1073741824, 1073741824.0])
def test_int_accepts_digit_strings_and_integral_floats(value):
    assert load({"ssd_capacity_bytes": value}).ssd_capacity_bytes == GiB


@pytest.mark.parametrize("key", ["ssd_capacity_bytes", "ssd_segment_size_bytes", "ssd_queue_depth"])
def test_zero_is_refused_where_it_means_nothing(key):
    assert error_of({key: 0}) == f"extra_config[{key!r}] must be an integer >= 1, got 0"


def test_dram_capacity_zero_is_fine():
    assert load({"dram_capacity_bytes": 0}).dram_capacity_bytes == 0


def test_env_int_message_names_the_variable():
    assert error_of(env={"UMBP_SSD_CAPACITY": "lots"}) == "UMBP_SSD_CAPACITY must be an integer >= 1, got 'lots'"


def test_segment_must_be_4096_multiple():
    assert error_of({"ssd_segment_size_bytes": 5000}) == (
        "ssd_segment_size_bytes must be a multiple of 4096 (O_DIRECT alignment), got 5000"
    )


def test_capacity_must_hold_one_segment():
    msg = error_of({"ssd_capacity_bytes": 4096, "ssd_segment_size_bytes": 8192})
    assert msg.startswith("ssd_capacity_bytes (4096) must be at least ssd_segment_size_bytes (8192)")


@pytest.mark.parametrize(
    "low,high",
    [(0.7, 0.7), (0.8, 0.7), (0.0, 0.9), (-0.1, 0.9), (0.5, 1.01), (0.5, 0.0)],
)
def test_watermark_order(low, high):
    msg = error_of({"ssd_low_watermark": low, "ssd_high_watermark": high})
    assert msg == (
        "SSD watermarks must satisfy 0 < ssd_low_watermark < ssd_high_watermark <= 1, "
        f"got ssd_low_watermark={float(low)!r}, ssd_high_watermark={float(high)!r}"
    )


def test_watermarks_accept_strings_and_high_one():
    cfg = load({"ssd_low_watermark": "0.25", "ssd_high_watermark": 1})
    assert (cfg.ssd_low_watermark, cfg.ssd_high_watermark) == (0.25, 1.0)


@pytest.mark.parametrize("value", ["high", True, None, "nan", float("inf")])
def test_watermark_type(value):
    assert error_of({"ssd_high_watermark": value}) == f"extra_config['ssd_high_watermark'] must be a finite number, got {value!r}"


def test_watermark_layering_env_low_extra_high():
    cfg = load({"ssd_high_watermark": 0.6}, {"UMBP_SSD_LOW_WM": "0.5"})
    assert (cfg.ssd_low_watermark, cfg.ssd_high_watermark) == (0.5, 0.6)


def test_eviction_policy():
    assert load({"eviction_policy": " LRU "}).eviction_policy == "lru"
    msg = error_of({"eviction_policy": "fifo"})
    assert msg == "extra_config['eviction_policy'] must be one of: lru, prefix_aware; got 'fifo'"


@pytest.mark.parametrize("value", [0, -1, "soon", True])
def test_io_timeout(value):
    assert error_of({"io_timeout_s": value}).startswith("extra_config['io_timeout_s'] must be a ")


@pytest.mark.parametrize("value", ["", "   ", 5, None])
def test_storage_dir_must_be_a_path(value):
    assert error_of({"ssd_storage_dir": value}) == f"extra_config['ssd_storage_dir'] must be a non-empty directory path, got {value!r}"


def test_extra_backend_tag_any_to_str():
    assert load({"extra_backend_tag": 3}).extra_backend_tag == "3"
    assert load({"extra_backend_tag": None}).extra_backend_tag is None


# ---------------------------------------------------------------------------- key policy

def test_loader_keys_are_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.config"):
        load({"backend_name": "umbp_nvme", "module_path": "m", "class_name": "C", "interface_v1": 1})
    assert caplog.records == []


def test_ignored_umbp_keys_are_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.config"):
        cfg = load({"ssd_copy_async": "true", "ssd_copy_queue_depth": 4096, "ssd_copy_worker_threads": 2,
                    "ssd_copy_batch_max_ops": 128, "disable_zero_copy_register": False, "eviction_candidate_window": 8,
                    "auto_promote_on_read": "no", "kv_events_endpoint": "tcp://localhost:5557", "kv_events_topic": ""})
    assert caplog.records == []
    assert cfg.eviction_candidate_window == 8 and cfg.auto_promote_on_read is False


def test_unknown_key_warns_once_and_does_not_raise(caplog):
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.config"):
        cfg = load({"ssd_capactiy_bytes": 1})
    assert cfg == StoreConfig()
    assert len(caplog.records) == 1
    assert "'ssd_capactiy_bytes'" in caplog.records[0].getMessage()


def test_distributed_only_key_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="umbp_nvme.config"):
        load({"node_address": "10.0.0.1"})
    assert len(caplog.records) == 1 and "distributed" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    "key,value",
    [("master_address", "10.0.0.1:15558"), ("standalone_address", "127.0.0.1:9000"), ("standalone_auto_start", True),
     ("spdk_nvme_pci_addr", "0000:47:00.0"), ("spdk_proxy_shm_name", "/x"), ("spdk_passthrough", {})],
)
def test_remote_keys_are_refused(key, value):
    msg = error_of({key: value})
    assert msg.startswith(f"extra_config[{key!r}]={value!r} selects ")
    assert "umbp_nvme is a local-NVMe backend" in msg
    assert "Remove this key" in msg


def test_empty_master_address_is_not_remote_mode():
    assert load({"master_address": "", "standalone_address": None}) == StoreConfig()


@pytest.mark.parametrize("var", ["UMBP_MASTER_ADDRESS", "UMBP_STANDALONE_ADDRESS", "UMBP_SPDK_NVME_PCI"])
def test_remote_env_is_refused(var):
    msg = error_of(env={var: "x:1"})
    assert msg.startswith(f"{var}='x:1' selects ") and "local-NVMe backend" in msg


def test_validate_on_a_hand_built_config():
    with pytest.raises(ValueError, match="eviction_policy must be one of: lru, prefix_aware; got 'mru'"):
        StoreConfig(eviction_policy="mru").validate()
    assert StoreConfig().validate() == StoreConfig()
