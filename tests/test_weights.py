"""gemini_jax.weights: HF config mapping, HF checkpoint loading (parity with transformers), native
save/load, and the typed errors for every bad input.

Parity models are tiny random transformers models with *every* parameter perturbed (norm weights,
biases included), so a tensor loaded into the wrong slot cannot pass. Each family case also lists
config mutations that must break parity: proof that the feature (window, softcap, rope...) is
actually exercised by the prompts, not just present in the config.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from gemini_jax.config import ModelConfig, RopeConfig, replace
from gemini_jax.errors import CheckpointError, ConfigError
from gemini_jax.model import Decoder
from gemini_jax.testing import float_tolerance
from gemini_jax.weights import (decoder_from_arrays, load_hf, load_safetensors, model_arrays,
                                model_config_from_hf, param_specs, save_safetensors)
from gemini_jax.weights.hf_config import FAMILY_DEFAULTS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
LENGTHS = (5, 21)  # 21 > every sliding window below (8)
TOL = 1e-4  # the contract (README, exactness table: hf): max |ours - transformers| / max |transformers|
# The float bound of that relative error: two float32 implementations of the same layers, each layer's
# longest reduction (the widest matmul) summed in another order. It must sit below the contract.
REL_BOUND = float_tolerance(depth=SIZES["num_hidden_layers"], terms=SIZES["intermediate_size"], magnitude=1.0)
assert REL_BOUND <= TOL, (REL_BOUND, TOL)
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=4.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=16)
NO_WINDOWS = dict(layer_windows=(0, 0, 0))

# name -> (config class, model class, config kwargs, save_pretrained kwargs, mutations that must fail)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(attention_bias=True, rope_parameters=LLAMA3),
              dict(max_shard_size="40KB"),  # sharded: several files + index
              [dict(rope=RopeConfig(theta=500000.0))]),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8), {},
                [NO_WINDOWS, dict(layer_windows=(7,) * 3), dict(layer_windows=(9,) * 3)]),  # off-by-one
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=True),
              {}, [NO_WINDOWS]),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(tie_word_embeddings=True,
                   rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=1000.0)),
              {}, [dict(rope=RopeConfig(theta=1000.0))]),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(sliding_window=8, attn_logit_softcapping=1.0, final_logit_softcapping=0.5,
                    query_pre_attn_scalar=24),
               {}, [NO_WINDOWS, dict(attn_softcap=None), dict(final_softcap=None), dict(attn_scale=None)]),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=8, sliding_window_pattern=2, tie_word_embeddings=False,
                    query_pre_attn_scalar=24,
                    rope_parameters={"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
                                     "sliding_attention": dict(rope_type="default", rope_theta=100.0)}),
               {}, [NO_WINDOWS, dict(local_rope=None), dict(rope=RopeConfig(theta=1e6))]),
}


def _hf_model(config_cls: str, model_cls: str, **config_kwargs):
    config = getattr(transformers, config_cls)(**config_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # norms, biases and embeddings all move off their init
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _tokens(batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, SIZES["vocab_size"], (batch, length))


def _ours(model: Decoder, tokens: np.ndarray) -> np.ndarray:
    B, T = tokens.shape
    logits, _ = model(jnp.asarray(tokens, jnp.int32), jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    return np.asarray(logits)


def _theirs(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor(tokens)).logits.float().numpy()


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("family", sorted(CASES))
def test_hf_parity(family, tmp_path):
    config_cls, model_cls, kwargs, save_kwargs, mutations = CASES[family]
    hf = _hf_model(config_cls, model_cls, **SIZES, **kwargs)
    hf.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
    model = load_hf(tmp_path)
    assert model.cfg.family == family
    assert (model.lm_head is None) == hf.config.tie_word_embeddings
    refs = {}
    for length, batch in zip(LENGTHS, (1, 2)):
        tokens = _tokens(batch, length, seed=length)
        refs[length] = (tokens, _theirs(hf, tokens))
        err = _rel_err(_ours(model, tokens), refs[length][1])
        assert err <= REL_BOUND, f"{family} T={length} seed={length}: rel err {err:.2e} > {REL_BOUND:.2e}"

    _greedy_32_matches_transformers(family, hf, model)

    # Each mutation removes one feature; if parity survived it, the test would not be testing it.
    tokens, ref = refs[LENGTHS[-1]]
    for change in mutations:
        mutated = decoder_from_arrays(replace(model.cfg, **change), model_arrays(model))
        assert _rel_err(_ours(mutated, tokens), ref) > 10 * TOL, f"{family}: {change} did not matter"


def _greedy_32_matches_transformers(family, hf, model):
    """32 greedy tokens through Engine.generate (paged cache) equal transformers' generate.

    EOS is disabled on both sides (tiny random models emit it at random). Where the two differ
    the step must be a near-tie in transformers' own logits (teacher-forced check)."""
    import gemini_jax as gj

    prompt = _tokens(1, 11, 0)[0]
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=64, prefill_chunk=8,
                                           cache=gj.config.CacheConfig(block_size=8)))
    ours = eng.generate([int(t) for t in prompt], gj.SamplingParams(max_new_tokens=32, stop_at_eos=False)).tokens
    with torch.no_grad():
        theirs = hf.generate(torch.tensor(prompt[None]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ref = _theirs(hf, np.asarray([list(prompt) + ours]))[0, len(prompt) - 1:-1]
    chosen = ref[np.arange(32), ours]
    # Our logits sit within REL_BOUND of transformers': two of them that close may swap (twice the bound).
    tol = 2 * REL_BOUND * np.abs(ref).max()
    assert np.all(ref.max(-1) - chosen <= tol), f"{family} seed=0: not greedy under HF logits"
    if ours != theirs:
        # transformers' generate may itself depart from its forward pass (Gemma 2's hybrid cache
        # computes the step differently); only where its tokens are greedy under its own forward
        # logits is it a reference our tokens must equal (up to near-ties).
        ref_t = _theirs(hf, np.asarray([list(prompt) + theirs]))[0, len(prompt) - 1:-1]
        tol = 2 * REL_BOUND * np.abs(ref_t).max()
        consistent = np.all(ref_t.max(-1) - ref_t[np.arange(32), theirs] <= tol)
        if consistent:
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            gap = ref[first, ours[first]] - ref[first, theirs[first]]
            assert abs(gap) <= tol, f"{family}: diverged from transformers at {first} without a tie"


def test_sharded_checkpoint_layout(tmp_path):
    _, _, kwargs, save_kwargs, _ = CASES["llama"]
    hf = _hf_model("LlamaConfig", "LlamaForCausalLM", **SIZES, **kwargs)
    hf.save_pretrained(tmp_path, safe_serialization=True, **save_kwargs)
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "model.safetensors.index.json").exists()
    assert not (tmp_path / "model.safetensors").exists()
    model = load_hf(tmp_path)
    np.testing.assert_array_equal(np.asarray(model.layers.wq[...][1]),
                                  hf.model.layers[1].self_attn.q_proj.weight.detach().numpy().T)
    np.testing.assert_array_equal(np.asarray(model.lm_head[...]), hf.lm_head.weight.detach().numpy().T)


def test_gemma3_multimodal_checkpoint_loads_text_decoder(tmp_path):
    text = dict(SIZES, num_hidden_layers=2, sliding_window=4, query_pre_attn_scalar=24)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  image_size=16, patch_size=8)
    hf = _hf_model("Gemma3Config", "Gemma3ForConditionalGeneration", text_config=text, vision_config=vision,
                   mm_tokens_per_image=4, boi_token_index=120, eoi_token_index=121, image_token_index=122)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["model_type"] == "gemma3"
    model = load_hf(tmp_path)  # vision tower and projector tensors are skipped
    assert model.cfg.tie_embeddings and model.cfg.layer_windows == (4, 4)
    tokens = _tokens(1, 11, seed=3)
    err = _rel_err(_ours(model, tokens), _theirs(hf, tokens))
    assert err <= REL_BOUND, f"seed=3: rel err {err:.2e} > {REL_BOUND:.2e}"


def test_dtypes_bf16_checkpoint_and_bf16_load(tmp_path):
    hf = _hf_model("Qwen2Config", "Qwen2ForCausalLM", **SIZES)
    hf.save_pretrained(tmp_path / "f32", safe_serialization=True)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", safe_serialization=True)

    upcast = load_hf(tmp_path / "bf16", dtype="float32")  # BF16 on disk -> exact f32 values
    assert upcast.embed[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(upcast.layers.bq[...][2]),
                                  hf.model.layers[2].self_attn.q_proj.bias.detach().float().numpy())

    f32 = load_hf(tmp_path / "f32")
    half = load_hf(tmp_path / "f32", dtype="bfloat16")
    assert half.cfg.dtype == "bfloat16" and half.layers.wq[...].dtype == jnp.bfloat16
    tokens = _tokens(1, 9, seed=4)
    # Each value rounds once to bfloat16 per step (the sums accumulate in float32): eps of bfloat16 per layer.
    tol = float_tolerance(dtype="bfloat16", depth=SIZES["num_hidden_layers"], magnitude=1.0)
    err = _rel_err(_ours(half, tokens), _ours(f32, tokens))
    assert err <= tol, f"seed=4: bf16 vs f32 rel err {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------- config mapping


def _hf_config_dict(model_type: str, **kwargs) -> dict:
    """What transformers itself makes of these keys (its legacy conversions applied)."""
    return transformers.AutoConfig.for_model(model_type, **kwargs).to_dict()


LEGACY_CONFIGS = {  # transformers 4.x spellings: top-level rope_theta + rope_scaling, no layer_types
    "llama": dict(rope_theta=5e5, rope_scaling=dict(LLAMA3, rope_type="llama3")),
    "llama-linear-type-key": dict(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0}),
    "mistral": dict(rope_theta=1e6, sliding_window=None),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    "qwen3": dict(use_sliding_window=False, sliding_window=8),
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=24),
    "gemma3_text": dict(rope_theta=1e6, rope_local_base_freq=100.0, sliding_window=8, sliding_window_pattern=2,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}),
}


@pytest.mark.parametrize("case", sorted(LEGACY_CONFIGS))
def test_legacy_config_maps_like_transformers(case):
    model_type = case.split("-")[0]
    legacy = dict(SIZES, **LEGACY_CONFIGS[case])
    ours = model_config_from_hf(dict(legacy, model_type=model_type))
    theirs = _hf_config_dict(model_type, **legacy)
    assert ours == model_config_from_hf(theirs)
    # Sliding windows: transformers' layer_types (when it has them) against ours.
    if "layer_types" in theirs:
        window = theirs["sliding_window"] or 0
        assert ours.layer_windows == tuple(window if t == "sliding_attention" else 0 for t in theirs["layer_types"])


def test_layer_window_rules():
    def windows(model_type, **kw):
        return model_config_from_hf(dict(SIZES, model_type=model_type, num_hidden_layers=7, **kw)).layer_windows

    assert windows("mistral", sliding_window=8) == (8,) * 7
    assert windows("gemma2", sliding_window=8) == (8, 0, 8, 0, 8, 0, 8)
    assert windows("gemma3_text", sliding_window=8) == (8, 8, 8, 8, 8, 0, 8)  # default pattern 6
    assert windows("gemma3_text", sliding_window=8, _sliding_window_pattern=3) == (8, 8, 0, 8, 8, 0, 8)
    assert windows("qwen2", sliding_window=8) == (0,) * 7  # use_sliding_window defaults to false
    assert windows("qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=5) == (0,) * 5 + (8, 8)
    assert windows("llama", sliding_window=8) == (0,) * 7  # Llama has no sliding attention
    assert windows("qwen3", sliding_window=8, use_sliding_window=True,
                   layer_types=["full_attention", "sliding_attention"] * 3 + ["full_attention"]) == (0, 8) * 3 + (0,)


def test_config_fields():
    cfg = model_config_from_hf(dict(SIZES, model_type="gemma2", eos_token_id=[1, 107], head_dim=None,
                                    final_logit_softcapping=None), dtype="bfloat16")
    assert cfg.eos_id == 1 and cfg.bos_id == 2 and cfg.dtype == "bfloat16"
    assert cfg.head_dim == 16 and cfg.final_softcap is None and cfg.attn_softcap == 50.0
    assert cfg.attn_scale == 256 ** -0.5 and cfg.tie_embeddings and cfg.norm_kind == "rms_plus_one"
    assert cfg.activation == "gelu_tanh" and cfg.sandwich_norms and cfg.embed_scale and not cfg.qk_norm
    qwen2 = model_config_from_hf(dict(SIZES, model_type="qwen2"))
    assert qwen2.qkv_bias and not qwen2.o_bias and not qwen2.tie_embeddings and qwen2.eos_id is None
    no_head_dim = {k: v for k, v in SIZES.items() if k != "head_dim"}
    assert model_config_from_hf(dict(no_head_dim, model_type="llama")).head_dim == 16
    assert model_config_from_hf(dict(no_head_dim, model_type="qwen3")).head_dim == 128  # HF default


@pytest.mark.parametrize("family", sorted(FAMILY_DEFAULTS))
def test_family_defaults_match_transformers(family):
    model_type = {"gemma3": "gemma3_text"}.get(family, family)
    cls = type(transformers.AutoConfig.for_model(model_type))
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    instance = cls(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    rope = instance.rope_parameters
    for key, ours in FAMILY_DEFAULTS[family].items():
        if key == "rope_theta":
            theirs = rope["full_attention" if family == "gemma3" else "rope_theta"]
            theirs = theirs["rope_theta"] if family == "gemma3" else theirs
        elif key == "rope_local_base_freq":
            theirs = rope["sliding_attention"]["rope_theta"]
        elif key == "sliding_window_pattern":
            theirs = instance._sliding_window_pattern
        else:
            theirs = fields[key]
        assert ours == theirs, f"{family}.{key}: ours {ours!r}, transformers {theirs!r}"


@pytest.mark.parametrize("change, words", [
    (dict(model_type="gpt2"), ["gpt2", "llama", "gemma3_text"]),
    (dict(model_type="llama", mlp_bias=True), ["mlp_bias", "Supported"]),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), ["use_bidirectional_attention"]),
    (dict(model_type="llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     ["yarn", "llama3"]),
    (dict(model_type="llama", rope_scaling={"type": "dynamic", "factor": 2.0}), ["dynamic"]),
    (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 2.0}), ["low_freq_factor"]),
    (dict(model_type="llama", partial_rotary_factor=0.5), ["partial_rotary_factor"]),
    (dict(model_type="llama", hidden_act="relu"), ["relu", "silu"]),
    (dict(model_type="gemma2", layer_types=["full_attention", "chunked_attention", "full_attention"]),
     ["chunked_attention"]),
    (dict(model_type="gemma3_text", sliding_window=None), ["sliding_window"]),
    (dict(model_type="llama", hidden_size=None), ["hidden_size"]),
])
def test_config_errors(change, words):
    with pytest.raises(ConfigError) as info:
        model_config_from_hf(dict(SIZES, **change))
    for word in words:
        assert word in str(info.value)


# ---------------------------------------------------------------- checkpoint errors


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A valid single-file tiny Llama checkpoint; tests copy it before breaking it."""
    path = tmp_path_factory.mktemp("llama")
    _hf_model("LlamaConfig", "LlamaForCausalLM", **SIZES).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def ckpt(llama_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(llama_dir, dst)
    return dst


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_known_harmless_tensors_are_ignored(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    assert load_hf(ckpt).cfg.num_layers == 3


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_hf(ckpt)


def test_corrupt_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_hf(ckpt)


def test_no_weight_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_hf(ckpt)


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing: model\.layers\.2\.mlp\.up_proj\.weight"):
        load_hf(ckpt)


def test_missing_lm_head_when_untied(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_hf(ckpt)


def test_unexpected_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.1.mlp.gate_proj.bias": np.ones(128, np.float32)}))
    with pytest.raises(CheckpointError, match=r"no place for.*model\.layers\.1\.mlp\.gate_proj\.bias"):
        load_hf(ckpt)


def test_wrong_shape(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": np.ones((16, 64), np.float32)}))
    with pytest.raises(CheckpointError, match=r"k_proj.weight' has shape \[16, 64\], expected \[32, 64\]"):
        load_hf(ckpt)


def test_integer_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight' has dtype I32"):
        load_hf(ckpt)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors(ckpt, damage):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else np.random.default_rng(387).bytes(4096))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_hf(ckpt)


def test_sharded_index_errors(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:10]}, ckpt / "a.safetensors")
    save_file({n: tensors[n] for n in names[10:]}, ckpt / "b.safetensors")
    weight_map = {n: "a.safetensors" if i < 10 else "b.safetensors" for i, n in enumerate(names)}
    index = ckpt / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert load_hf(ckpt).cfg.num_layers == 3  # the hand-made shards are valid

    index.write_text(json.dumps({"weight_map": dict(weight_map, **{names[0]: "c.safetensors"})}))
    with pytest.raises(CheckpointError, match=r"shard file\(s\) \['c.safetensors'\]"):
        load_hf(ckpt)
    index.write_text(json.dumps({"weight_map": dict(weight_map, **{names[0]: "b.safetensors"})}))
    with pytest.raises(CheckpointError, match="index .* and the shard disagree"):
        load_hf(ckpt)
    index.write_text("[]")
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        load_hf(ckpt)


def test_bad_dtype_and_family(ckpt):
    with pytest.raises(ConfigError, match="dtype='int8' is not supported"):
        load_hf(ckpt, dtype="int8")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(config, model_type="phi3")))
    with pytest.raises(ConfigError, match=r"config.json: model_type='phi3' is not supported"):
        load_hf(ckpt)


# ---------------------------------------------------------------- native checkpoints

NATIVE = ModelConfig(family="tiny", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True, o_bias=True, qk_norm=True,
                     sandwich_norms=True, layer_windows=(4, 0), local_rope=RopeConfig(theta=100.0),
                     rope=RopeConfig(theta=1e4, kind="linear", factor=2.0), eos_id=1)


def _random_native(cfg: ModelConfig) -> Decoder:
    rng = np.random.RandomState(0)  # every weight random, norms and biases included
    return decoder_from_arrays(cfg, {k: rng.normal(0, 0.1, v.shape) for k, v in param_specs(cfg).items()})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_roundtrip(tmp_path, dtype):
    model = _random_native(replace(NATIVE, dtype=dtype))
    save_safetensors(model, tmp_path)
    loaded = load_safetensors(tmp_path)
    assert loaded.cfg == model.cfg
    before, after = model_arrays(model), model_arrays(loaded)
    assert sorted(before) == sorted(after) and "layers.wq" in after and "lm_head" in after
    for name in before:
        assert after[name].dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(after[name]), np.asarray(before[name]))
    if dtype == "float32":
        tokens = _tokens(1, 7, seed=5) % NATIVE.vocab_size
        np.testing.assert_array_equal(_ours(loaded, tokens), _ours(model, tokens))
        as_bf16 = load_safetensors(tmp_path, dtype="bfloat16")
        assert as_bf16.layers.wq[...].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(as_bf16.embed[...]),
                                      np.asarray(before["embed"]).astype(ml_dtypes.bfloat16))


def test_native_errors(tmp_path):
    model = _random_native(replace(NATIVE, tie_embeddings=True))
    save_safetensors(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ConfigError, match="no model_type key"):
        load_hf(tmp_path)  # a native dir is not an HF one, and the error says which loader to use
    with pytest.raises(ConfigError, match="dtype='float64'"):
        load_safetensors(tmp_path, dtype="float64")

    (tmp_path / "config.json").write_text(json.dumps(dict(config, tie_embeddings=False)))
    with pytest.raises(CheckpointError, match=r"missing \['lm_head'\]"):
        load_safetensors(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=40)))
    with pytest.raises(CheckpointError, match=r"'layers.w_down' has shape \[2, 48, 32\], expected \[2, 40, 32\]"):
        load_safetensors(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(config, flavour="x")))
    with pytest.raises(ConfigError, match="unknown field"):
        load_safetensors(tmp_path)


def test_load_safetensors_refuses_hf_dir(llama_dir):
    with pytest.raises(ConfigError, match="load it with load_hf"):
        load_safetensors(llama_dir)
