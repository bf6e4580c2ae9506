"""Config validation errors name the field; Hydra presets compose into valid configs."""

import dataclasses
import os

import pytest
from hydra import compose, initialize_config_dir

import gemini_jax as gj
from gemini_jax.config import EngineConfig, HardwareConfig, ModelConfig, from_dict
from gemini_jax.errors import ConfigError
from gemini_jax.hydra_schema import build, register
from gemini_jax.testing import tiny_config

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@pytest.mark.parametrize("field,value", [
    ("num_heads", 5), ("head_dim", 15), ("norm_kind", "layer"), ("activation", "relu"),
    ("dtype", "int8"), ("layer_windows", (1, 2)), ("attn_softcap", -1.0), ("eos_id", 10_000),
    ("family", "gpt2"), ("vocab_size", 0),
])
def test_model_config_errors_name_the_field(field, value):
    base = dataclasses.asdict(tiny_config("tiny"))
    base[field] = value
    with pytest.raises(ConfigError, match=field):
        from_dict(ModelConfig, base)


def test_unknown_field_refused():
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict(EngineConfig, {"max_seq_len": 8, "blocksize": 16})


@pytest.mark.parametrize("kw,field", [
    (dict(max_seq_len=0), "max_seq_len"), (dict(prefill_chunk=-3), "prefill_chunk"),
    (dict(attention_impl="cuda"), "attention_impl"),
    (dict(cache=dict(kind="ring")), "cache.kind"), (dict(cache=dict(dtype="int4")), "cache.dtype"),
    (dict(cache=dict(block_size=12)), "cache.block_size"), (dict(cache=dict(block_size=512)), "cache.block_size"),
    (dict(max_seq_len=1024, cache=dict(block_size=16, num_pages=20)), "cache.num_pages"),
])
def test_engine_config_errors(kw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        from_dict(EngineConfig, kw)


@pytest.mark.parametrize("model", ["tiny", "llama3_1_8b", "mistral_7b", "qwen2_5_7b", "qwen3_8b",
                                   "gemma2_9b", "gemma3_4b"])
def test_model_presets_compose(model):
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", overrides=[f"model={model}"])
    mcfg = build(ModelConfig, cfg.model)
    assert len(mcfg.layer_windows) == mcfg.num_layers
    if model == "gemma2_9b":
        assert mcfg.layer_windows[:4] == (4096, 0, 4096, 0)
    if model == "gemma3_4b":
        assert mcfg.layer_windows[:6] == (1024,) * 5 + (0,) and mcfg.local_rope.theta == 10000.0


@pytest.mark.parametrize("hw", ["cpu", "rtx4090", "l40s", "a100_80g", "a100_80g_x8", "h200"])
def test_hardware_presets(hw):
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", overrides=[f"hardware={hw}"])
    h = build(HardwareConfig, cfg.hardware)
    assert h.name == hw and (h.present == (hw == "cpu"))


def test_hydra_override_type_checked():
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", overrides=["experiment=generate", "engine.max_seq_len=123"])
        assert build(EngineConfig, cfg.engine).max_seq_len == 123
        with pytest.raises(Exception, match="max_seq_len"):
            compose(config_name="config", overrides=["engine.max_seq_len=lots"])


def test_slurm_launcher_config_composes():
    """`hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml) resolves to the submitit launcher
    of the `slurm` extra, with our defaults and overrides applied."""
    from hydra.utils import get_class

    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", return_hydra_config=True,
                      overrides=["hydra/launcher=slurm", "hydra.launcher.nodes=2", "distributed=true"])
    launcher = cfg.hydra.launcher
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 1, 8)
    assert cfg.distributed is True


def test_public_api_names():
    for name in ("load_hf", "load_tiny", "forward", "Engine", "EngineConfig", "SamplingParams", "Model"):
        assert hasattr(gj, name)


@pytest.mark.parametrize("preset,enabled,digest", [("off", False, "minmax"), ("quest", True, "minmax"),
                                                    ("mean", True, "mean")])
def test_sparse_presets(preset, enabled, digest):
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", overrides=[f"sparse={preset}", "engine.sparse.budget=1024"])
    sp = build(EngineConfig, cfg.engine).sparse
    assert (sp.enabled, sp.digest, sp.budget) == (enabled, digest, 1024)


@pytest.mark.parametrize("preset,rerank,budget", [("extrapolate", 0, 1024), ("extrapolate_rerank", 2, 1536)])
def test_extrapolate_presets(preset, rerank, budget):
    register()
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose(config_name="config", overrides=["experiment=needle", f"sparse={preset}"])
    sp = build(EngineConfig, cfg.engine).sparse
    assert (sp.positions, sp.score_distance, sp.rerank, sp.budget) == ("compact", 512, rerank, budget)
    # Reranking reads candidate keys before selecting: over tiers it is refused, naming the knob.
    if rerank:
        with initialize_config_dir(config_dir=CONF, version_base=None):
            cfg = compose(config_name="config", overrides=["experiment=needle", f"sparse={preset}", "tier=host"])
        with pytest.raises(gj.errors.ConfigError, match="sparse.rerank"):
            build(EngineConfig, cfg.engine)


def test_hardware_tiers_take_no_attention_path():
    """The attention path is the engine's (engine.attention_impl); a hardware tier describes the
    machine for the cost model and emulation, so a knob it would ignore is refused."""
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['attention_impl'\]"):
        from_dict(HardwareConfig, {"name": "gpu", "device_memory_gb": 80.0, "host_memory_gb": 512.0,
                                   "attention_impl": "pallas"})
