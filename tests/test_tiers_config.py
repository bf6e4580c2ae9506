"""TierConfig validation names the field; conf/tier presets compose into valid configs."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir

from gemini_jax.config import from_dict
from gemini_jax.errors import ConfigError
from gemini_jax.hydra_schema import build, register
from gemini_jax.tiers import TierConfig

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@pytest.mark.parametrize("kw,field", [
    (dict(device_pages=0), "tier.device_pages"), (dict(device_fraction=1.5), "tier.device_fraction"),
    (dict(device_fraction=0.0), "tier.device_fraction"),
    (dict(device_pages=4, device_fraction=0.5), "tier.device_pages"),
    (dict(host_pages=0), "tier.host_pages"), (dict(disk_path=" "), "tier.disk_path"),
    (dict(write_policy="lazy"), "tier.write_policy"), (dict(disk_layout="ocdbt"), "tier.disk_layout"),
    (dict(on_corrupt="ignore"), "tier.on_corrupt"), (dict(prefetch_depth=-1), "tier.prefetch_depth"),
    (dict(prefetch_depth=1.5), "tier.prefetch_depth"), (dict(pin_sink_pages=-1), "tier.pin_sink_pages"),
    (dict(hot_threshold=40, hot_window=32), "tier.hot_threshold"), (dict(shard_pages=0), "tier.shard_pages"),
    (dict(io_workers=0), "tier.io_workers"),
])
def test_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        TierConfig(**kw)


def test_device_slots():
    assert TierConfig().device_slots(101) == 100
    assert TierConfig(device_fraction=0.25).device_slots(101) == 25
    assert TierConfig(device_pages=7).device_slots(101) == 7
    with pytest.raises(ConfigError, match="device_pages=200"):
        TierConfig(device_pages=200).device_slots(101)
    assert hash(TierConfig()) == hash(TierConfig())  # usable as a jit static argument


def test_unknown_field_refused():
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict(TierConfig, {"prefetch_dept": 2})


@pytest.mark.parametrize("preset", ["all_device", "host", "disk"])
def test_presets_compose(preset, monkeypatch, tmp_path):
    register()  # the schemas and resolvers (conf/tier/disk.yaml asks gj_run_dir for its default)
    monkeypatch.setenv("GJ_KV_DIR", str(tmp_path / "kv"))
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(overrides=[f"+tier={preset}", "engine.tier.prefetch_depth=3"])
    tier = build(TierConfig, cfg.engine.tier)
    assert tier.prefetch_depth == 3
    assert tier.enabled == (preset != "all_device")
    assert (tier.disk_path is not None) == (preset == "disk")
    if preset == "disk":
        assert tier.disk_path == str(tmp_path / "kv") and tier.host_pages is not None
    if preset == "disk":  # without GJ_KV_DIR: a directory of this run's own, another for the next run
        monkeypatch.delenv("GJ_KV_DIR")
        paths = []
        for _ in range(2):
            with initialize_config_dir(config_dir=CONF, version_base=None):
                paths.append(build(TierConfig, compose(overrides=["+tier=disk"]).engine.tier).disk_path)
        assert paths[0] != paths[1] and all(os.path.isdir(p) and not os.listdir(p) for p in paths), paths
