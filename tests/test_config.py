"""Tests for kmesh_blend.config (pure Python; no torch, no vLLM)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kmesh_blend.config import (
    KNOWN_KEYS,
    ConfigError,
    KMeshConfig,
    StoreSpec,
    parse_store,
)


def test_defaults() -> None:
    cfg = KMeshConfig()
    assert cfg.store == "cpu"
    assert cfg.recompute_ratio == 0.15
    assert cfg.check_layers == (1,)
    assert cfg.selection == "per_request"
    assert cfg.schedule == "layer_sync"
    assert cfg.store_spec == StoreSpec("cpu", None, None, None)
    assert KMeshConfig.from_extra_config(None) == cfg
    assert KMeshConfig.from_extra_config({}) == cfg


def test_known_keys_match_fields() -> None:
    fields = [f.name for f in dataclasses.fields(KMeshConfig) if f.init]
    assert tuple(f"kmesh.{name}" for name in fields) == KNOWN_KEYS
    assert set(KMeshConfig().to_extra_config()) == set(KNOWN_KEYS)


def test_round_trip() -> None:
    cfg = KMeshConfig(
        store="redis://cache.local:6379",
        recompute_ratio=0.3,
        check_layers=(0, 2, 5),
        selection="collective",
        schedule="sequential",
    )
    extra = cfg.to_extra_config()
    assert extra == {
        "kmesh.store": "redis://cache.local:6379",
        "kmesh.recompute_ratio": 0.3,
        "kmesh.check_layers": [0, 2, 5],
        "kmesh.sink_tokens": 0,
        "kmesh.selection": "collective",
        "kmesh.schedule": "sequential",
        "kmesh.deviation": "k",
        "kmesh.drift_correction": "auto",
        "kmesh.round_lifetime": 2,
        "kmesh.max_round_jump": 64,
        "kmesh.retention_bytes": 1 << 30,
        "kmesh.singleflight_timeout_s": 10.0,
        "kmesh.separator": [],
        "kmesh.store_cpu_bytes": 1 << 30,
        "kmesh.store_timeout_s": 0.5,
        "kmesh.compress_mirrors": False,
        "kmesh.cascade_decode": False,
        "kmesh.share_kv_memory": False,
        "kmesh.share_kv_host_bytes": 1 << 30,
        "kmesh.speed_guard": "auto",
        "kmesh.cascade_level": "auto",
        "kmesh.cascade_exact": False,
    }
    back = KMeshConfig.from_extra_config(extra)
    assert back == cfg
    assert back.store_spec == StoreSpec("redis", None, "cache.local", 6379)
    assert KMeshConfig().to_extra_config() == KMeshConfig.from_extra_config(None).to_extra_config()


def test_extended_keys_parse() -> None:
    cfg = KMeshConfig.from_extra_config(
        {"kmesh.separator": "13, 10", "kmesh.deviation": "kv", "kmesh.singleflight_timeout_s": 2}
    )
    assert cfg.separator == (13, 10) and cfg.deviation == "kv"
    assert cfg.singleflight_timeout_s == 2.0 and isinstance(cfg.singleflight_timeout_s, float)


def test_from_extra_config_values() -> None:
    cfg = KMeshConfig.from_extra_config(
        {"kmesh.recompute_ratio": 1, "kmesh.check_layers": "1, 3", "kmesh.store": "disk:///d"}
    )
    assert cfg.recompute_ratio == 1.0
    assert isinstance(cfg.recompute_ratio, float)
    assert cfg.check_layers == (1, 3)
    assert cfg.store_spec == StoreSpec("disk", "/d", None, None)
    assert KMeshConfig.from_extra_config({"kmesh.recompute_ratio": 0}).recompute_ratio == 0.0
    assert KMeshConfig.from_extra_config({"kmesh.check_layers": (0, 4)}).check_layers == (0, 4)
    assert KMeshConfig.from_extra_config({"kmesh.check_layers": [2]}).check_layers == (2,)


def test_direct_construction_normalises_list_to_tuple() -> None:
    cfg = KMeshConfig(check_layers=[0, 7])  # type: ignore[arg-type]
    assert cfg.check_layers == (0, 7)
    assert hash(cfg) == hash(KMeshConfig(check_layers=(0, 7)))


@pytest.mark.parametrize(
    ("value", "spec"),
    [
        ("cpu", StoreSpec("cpu", None, None, None)),
        ("disk:///abs/path", StoreSpec("disk", "/abs/path", None, None)),
        ("disk:///", StoreSpec("disk", "/", None, None)),
        ("lm://localhost:65432", StoreSpec("lm", None, "localhost", 65432)),
        ("lm://10.0.0.2:1", StoreSpec("lm", None, "10.0.0.2", 1)),
        ("redis://h:65535", StoreSpec("redis", None, "h", 65535)),
        ("redis://[::1]:6379", StoreSpec("redis", None, "[::1]", 6379)),
    ],
)
def test_valid_stores(value: str, spec: StoreSpec) -> None:
    assert parse_store(value) == spec
    cfg = KMeshConfig.from_extra_config({"kmesh.store": value})
    assert cfg.store == value
    assert cfg.store_spec == spec


VALID = {
    "kmesh.recompute_ratio": "[0, 1]",
    "kmesh.check_layers": "strictly increasing list of distinct non-negative ints",
    "kmesh.selection": "'per_request', 'collective'",
    "kmesh.schedule": "'layer_sync', 'sequential'",
    "kmesh.store": "'disk:///ABS/PATH', 'lm://HOST:PORT' or 'redis://HOST:PORT'",
    "kmesh.deviation": "'k', 'v', 'kv'",
    "kmesh.drift_correction": "'off', 'auto'",
    "kmesh.round_lifetime": "an int ≥ 1",
    "kmesh.sink_tokens": "an int ≥ 0",
    "kmesh.retention_bytes": "an int ≥ 0",
    "kmesh.store_cpu_bytes": "an int ≥ 1",
    "kmesh.singleflight_timeout_s": "seconds > 0",
    "kmesh.store_timeout_s": "seconds > 0",
    "kmesh.separator": "a list of token ids",
    "kmesh.compress_mirrors": "true or false",
    "kmesh.cascade_decode": "true or false",
    "kmesh.share_kv_memory": "true or false",
    "kmesh.share_kv_host_bytes": "an int ≥ 0",
    "kmesh.speed_guard": "'auto', 'off'",
}
R, L, SEL, SCH, ST = (
    "kmesh.recompute_ratio",
    "kmesh.check_layers",
    "kmesh.selection",
    "kmesh.schedule",
    "kmesh.store",
)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        (R, -0.1),
        (R, 1.5),
        (R, math.nan),
        (R, "0.2"),
        (R, True),
        (R, None),
        (L, []),
        (L, [-1]),
        (L, [1, 1]),
        (L, [3, 1]),
        (L, ["1"]),
        (L, [True]),
        (L, 1.5),
        (L, "a,b"),
        (SEL, "both"),
        (SEL, ""),
        (SCH, "async"),
        (SCH, 3),
        (ST, ""),
        (ST, "s3://x"),
        (ST, "disk://relative/path"),
        (ST, "lm://host"),
        (ST, "lm://:80"),
        (ST, "redis://h:0"),
        (ST, "redis://h:99999"),
        (ST, "redis://h:port"),
        ("kmesh.deviation", "q"),
        ("kmesh.drift_correction", "on"),
        ("kmesh.drift_correction", True),
        ("kmesh.sink_tokens", -1),
        ("kmesh.sink_tokens", 1.0),
        ("kmesh.round_lifetime", 0),
        ("kmesh.round_lifetime", 1.5),
        ("kmesh.retention_bytes", -1),
        ("kmesh.retention_bytes", True),
        ("kmesh.store_cpu_bytes", 0),
        ("kmesh.singleflight_timeout_s", 0),
        ("kmesh.singleflight_timeout_s", "10"),
        ("kmesh.store_timeout_s", -0.1),
        ("kmesh.store_timeout_s", True),
        ("kmesh.separator", [-1]),
        ("kmesh.separator", "a,b"),
        ("kmesh.separator", 7),
        ("kmesh.compress_mirrors", "yes"),
        ("kmesh.compress_mirrors", 1),
        ("kmesh.cascade_decode", "on"),
        ("kmesh.cascade_decode", 0),
        ("kmesh.share_kv_memory", "yes"),
        ("kmesh.share_kv_memory", 1),
        ("kmesh.share_kv_host_bytes", -1),
        ("kmesh.speed_guard", "on"),
        ("kmesh.speed_guard", False),
        ("kmesh.share_kv_host_bytes", "1G"),
    ],
    ids=repr,
)
def test_bad_values(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        KMeshConfig.from_extra_config({key: value})
    msg = str(info.value)
    assert key in msg
    assert repr(value) in msg
    assert VALID[key] in msg
    assert info.value.key == key
    assert isinstance(info.value, ValueError)
    # Direct construction validates too.
    field = key.removeprefix("kmesh.")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        KMeshConfig(**{field: value})  # type: ignore[arg-type]


def test_unknown_key_suggests_closest() -> None:
    with pytest.raises(ConfigError) as info:
        KMeshConfig.from_extra_config({"kmesh.recompute_ration": 0.2})
    msg = str(info.value)
    assert "'kmesh.recompute_ration'" in msg
    assert "did you mean 'kmesh.recompute_ratio'" in msg
    for known in KNOWN_KEYS:
        assert known in msg
    assert info.value.key == "kmesh.recompute_ration"


def test_unknown_key_without_close_match() -> None:
    with pytest.raises(ConfigError) as info:
        KMeshConfig.from_extra_config({"kmesh.zzzzzzzz": 1})
    assert "did you mean" not in str(info.value)
    assert "kmesh.store" in str(info.value)


def test_non_kmesh_keys_ignored() -> None:
    extra: dict[str, object] = {
        "lmcache.chunk_size": 256,
        "kmesh": "no dot, not ours",
        "recompute_ratio": 99,
        "kmesh.selection": "collective",
    }
    cfg = KMeshConfig.from_extra_config(extra)
    assert cfg == KMeshConfig(selection="collective")


def test_validate_for_model() -> None:
    cfg = KMeshConfig(check_layers=(0, 3, 31))
    cfg.validate_for_model(32)  # every layer exists
    with pytest.raises(ConfigError) as info:
        cfg.validate_for_model(31)
    msg = str(info.value)
    assert "kmesh.check_layers" in msg
    assert "[31]" in msg
    assert "0..30" in msg
    with pytest.raises(ConfigError, match=r"\[3, 31\]"):
        cfg.validate_for_model(2)


def test_frozen() -> None:
    cfg = KMeshConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.recompute_ratio = 0.5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.store = "disk:///x"  # type: ignore[misc]
    assert cfg.recompute_ratio == 0.15
    assert cfg.store_spec.kind == "cpu"


def test_sharing_kv_memory_needs_cascade_decode() -> None:
    with pytest.raises(ConfigError) as info:
        KMeshConfig.from_extra_config({"kmesh.share_kv_memory": True})
    assert info.value.key == "kmesh.share_kv_memory" and "kmesh.cascade_decode" in str(info.value)
    both = {"kmesh.share_kv_memory": True, "kmesh.cascade_decode": True}
    assert KMeshConfig.from_extra_config(both).share_kv_memory is True
