"""Key claiming and validation through the C++ parser (ctypes against the built
libtidepool.so): what tidepool takes, what it leaves for PyTorch, and the error texts."""

from __future__ import annotations

import pytest

from tidepool import _config
from tidepool._config import ConfigError, claim

KNOWN_KEYS = ("backend:tidepool, tidepool.mode, tidepool.state_budget, tidepool.pinned_budget, "
              "tidepool.log, tidepool.device_backend, tidepool.optimizer_hooks, "
              "tidepool.tier_min_bytes")


@pytest.mark.parametrize("conf, remaining", [
    ("backend:tidepool", ""),
    ("backend:tidepool,expandable_segments:True", "expandable_segments:True"),
    ("max_split_size_mb:128,backend:tidepool,garbage_collection_threshold:0.6",
     "max_split_size_mb:128,garbage_collection_threshold:0.6"),
    ("roundup_power2_divisions:[256:1,512:2,>:8],tidepool.mode:pool,"
     "pinned_use_cuda_host_register:True",
     "roundup_power2_divisions:[256:1,512:2,>:8],pinned_use_cuda_host_register:True"),
    ("tidepool.log:debug, expandable_segments:True", " expandable_segments:True"),
])
def test_tidepool_entries_are_claimed_and_pytorch_entries_kept_in_order(conf, remaining):
    result = claim(conf)
    assert result.enabled
    assert result.remaining == remaining


@pytest.mark.parametrize("conf", [
    "", "expandable_segments:True", "backend:native",
    "backend:cudaMallocAsync,max_split_size_mb:64",
    "garbage_collection_threshold:0.6,,expandable_segments:False",
])
def test_strings_that_do_not_name_tidepool_are_returned_untouched(conf):
    result = claim(conf)
    assert not result.enabled
    assert result.remaining == conf
    assert result.config["enabled"] is False


def test_defaults():
    assert claim("backend:tidepool").config == {
        "enabled": True, "mode": "global", "state_budget": {"kind": "bytes", "bytes": 0},
        "pinned_budget": {"kind": "unset"}, "log": "warn", "device_backend": "auto",
        "optimizer_hooks": True, "tier_min_bytes": 1 << 20}


def test_every_key():
    config = claim("backend:tidepool,tidepool.mode:pool,tidepool.state_budget:4GiB,"
                   "tidepool.pinned_budget:50%,tidepool.log:debug,tidepool.device_backend:cuda,"
                   "tidepool.optimizer_hooks:off,tidepool.tier_min_bytes:256KiB").config
    assert config == {
        "enabled": True, "mode": "pool", "state_budget": {"kind": "bytes", "bytes": 4 << 30},
        "pinned_budget": {"kind": "fraction", "fraction": 0.5}, "log": "debug",
        "device_backend": "cuda", "optimizer_hooks": False, "tier_min_bytes": 256 << 10}


@pytest.mark.parametrize("value, expected", [
    ("0", 0), ("123", 123), ("64KiB", 64 << 10), ("1.5GiB", 3 << 29), ("3MB", 3_000_000),
    ("2GB", 2_000_000_000), ("1TiB", 1 << 40),
])
def test_state_budget_sizes(value, expected):
    assert claim(f"tidepool.state_budget:{value}").config["state_budget"] == {
        "kind": "bytes", "bytes": expected}


@pytest.mark.parametrize("value, expected",
                         [("0", 0), ("4096", 4096), ("2MiB", 2 << 20), ("1MB", 10**6)])
def test_tier_min_bytes_sizes(value, expected):
    assert claim(f"tidepool.tier_min_bytes:{value}").config["tier_min_bytes"] == expected


def test_unknown_key_names_the_key_and_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        claim("backend:tidepool,tidepool.statebudget:1GiB")
    assert str(e.value) == ("allocator configuration: unknown key 'tidepool.statebudget'; "
                            f"tidepool keys are: {KNOWN_KEYS}")


@pytest.mark.parametrize("conf, message", [
    ("tidepool.mode:everything",
     "tidepool.mode: 'everything' is not a valid value; allowed: global, pool"),
    ("tidepool.log:loud",
     "tidepool.log: 'loud' is not a valid value; allowed: off, warn, info, debug"),
    ("tidepool.device_backend:tpu",
     "tidepool.device_backend: 'tpu' is not a valid value; allowed: auto, cuda, host"),
    ("tidepool.optimizer_hooks:true",
     "tidepool.optimizer_hooks: 'true' is not a valid value; allowed: on, off"),
    ("tidepool.state_budget:lots", "tidepool.state_budget: 'lots' is not a valid value"),
    ("tidepool.state_budget:-4GiB", "tidepool.state_budget: '-4GiB' is not a valid value"),
    ("tidepool.state_budget:120%", "a percentage must be in (0%, 100%]"),
    ("tidepool.pinned_budget:4 GiB", "tidepool.pinned_budget: '4 GiB' is not a valid value"),
    ("tidepool.tier_min_bytes:5%", "tidepool.tier_min_bytes: '5%' is not a valid value; allowed: a "
     "byte count with an optional unit (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. 1MiB; not a "
     "percentage"),
    ("tidepool.tier_min_bytes:small", "tidepool.tier_min_bytes: 'small' is not a valid value"),
    ("tidepool.tier_min_bytes:0.5", "not a whole number of bytes"),
    ("tidepool.mode", "tidepool.mode needs a value (key:value); allowed: global, pool"),
    ("tidepool.log:info,tidepool.log:debug", "tidepool.log is given twice"),
    ("backend:native,backend:tidepool",
     "backend:tidepool conflicts with 'backend:native'; name one backend"),
    # tidepool keys alone turn tidepool on (allocator/config.cpp, Note [one backend])
    ("tidepool.mode:pool,backend:cudaMallocAsync",
     "tidepool.mode:pool conflicts with 'backend:cudaMallocAsync'; name one backend"),
    ("a:[1,2,backend:tidepool", "unbalanced '['"),
    # Note [expandable segments]: PyTorch's MemPool, which pool mode uses, refuses them
    ("backend:tidepool,tidepool.mode:pool,expandable_segments:True",
     "tidepool conflicts with 'expandable_segments:True': pool mode puts optimizer state in a "
     "torch.cuda.MemPool"),
])
def test_bad_values_name_key_value_and_what_is_allowed(conf, message):
    with pytest.raises(ConfigError) as e:
        claim(conf)
    assert message in str(e.value)


def test_apply_makes_the_configuration_active_and_a_failed_apply_changes_nothing():
    applied = _config.apply("backend:tidepool,tidepool.log:off,tidepool.state_budget:1MiB")
    assert applied == _config.active_config()
    assert applied["state_budget"] == {"kind": "bytes", "bytes": 1 << 20}
    with pytest.raises(ConfigError, match="tidepool.log: 'nope'"):
        _config.apply("tidepool.log:nope")
    assert _config.active_config() == applied


def test_long_strings_round_trip():
    entries = [f"key{i}:{i}" for i in range(500)]
    result = claim(",".join(entries[:250] + ["backend:tidepool"] + entries[250:]))
    assert result.remaining == ",".join(entries)
