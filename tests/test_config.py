"""Config validation errors name the field; Hydra presets compose into valid configs."""

import dataclasses
import os

import pytest
from hydra import compose, initialize_config_dir

import gemini_jax as gj
from gemini_jax.config import EngineConfig, HardwareConfig, ModelConfig, compat, from_dict
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


# ---- which features combine: gemini_jax.config.compat ------------------------------------------------
def _unchecked(**kw) -> EngineConfig:
    """An EngineConfig holding `kw` without running its checks (to ask the table about it)."""
    cfg = object.__new__(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        value = kw.get(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
        object.__setattr__(cfg, f.name, value)
    return cfg


SPARSE = gj.config.SparseConfig(enabled=True, budget=64)
TIERS = gj.config.TierConfig(enabled=True, device_fraction=0.5)
ALIGNED = gj.config.CacheConfig(align="syntax")
CONTIGUOUS = gj.config.CacheConfig(kind="contiguous")
# One engine config per ENGINE row (by its index), breaking that row and no other.
ENGINE_BREAKS = {
    0: dict(cache=CONTIGUOUS, sparse=SPARSE),
    1: dict(cache=ALIGNED, attention_impl="pallas"),
    2: dict(cache=ALIGNED, tier=TIERS),
    3: dict(cache=ALIGNED, mesh=gj.config.MeshConfig(data=2)),
    4: dict(cache=ALIGNED, sparse=dataclasses.replace(SPARSE, positions="compact")),
    5: dict(cache=CONTIGUOUS, tier=TIERS),
    6: dict(attention_impl="pallas", tier=TIERS),
    7: dict(tier=TIERS, sparse=dataclasses.replace(SPARSE, rerank=2)),
    8: dict(cache=CONTIGUOUS, tier=gj.config.TierConfig(persistent=True, disk_path="/nonexistent/prefixes")),
    9: dict(cache=CONTIGUOUS, mesh=gj.config.MeshConfig(model=2)),
}


@pytest.mark.parametrize("row", range(len(compat.ENGINE)))
def test_each_row_of_the_engine_table_refuses_its_combination_alone(row):
    assert sorted(ENGINE_BREAKS) == list(range(len(compat.ENGINE))), "every row needs a breaking config here"
    kw = dict(max_seq_len=256, **ENGINE_BREAKS[row])
    cfg = _unchecked(**kw)
    refusing = [i for i, r in enumerate(compat.ENGINE) if r.refuses(cfg)]
    assert refusing == [row], f"row {row} ({compat.ENGINE[row].feature}): rows {refusing} refuse {kw}"
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kw)
    assert str(e.value) == compat.ENGINE[row].message(cfg)


def test_model_and_use_rows_refuse_by_their_message():
    byte = tiny_config("tiny", vocab_size=compat.BYTE_VOCAB)
    for kw, model, row in ((dict(cache=ALIGNED), tiny_config("tiny", vocab_size=300), 0),
                           (dict(cache=ALIGNED), tiny_config("gemma2", vocab_size=compat.BYTE_VOCAB), 1),
                           (dict(sparse=dataclasses.replace(SPARSE, positions="compact")), tiny_config("gemma3"), 2)):
        cfg = EngineConfig(max_seq_len=256, **kw)
        with pytest.raises(ConfigError) as e:
            compat.check_model(cfg, model)
        assert str(e.value) == compat.MODEL[row].message(cfg, model), f"model row {row}"
    compat.check_model(EngineConfig(max_seq_len=256, cache=ALIGNED), byte)  # a byte-level full-attention model runs
    for use in ("sessions", "serving"):
        for row, cache in enumerate((CONTIGUOUS, ALIGNED)):
            cfg = EngineConfig(max_seq_len=256, cache=cache)
            with pytest.raises(ConfigError) as e:
                compat.check_use(use, cfg, "here: ")
            assert str(e.value) == "here: " + compat.USES[use][row].message(cfg)
        compat.check_use(use, EngineConfig(max_seq_len=256))
