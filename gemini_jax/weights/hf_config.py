"""Hugging Face `config.json` -> `ModelConfig`.

Reads both the transformers 4.x spelling (`rope_theta` + `rope_scaling`, Gemma 3's
`rope_local_base_freq` and `sliding_window_pattern`) and the 5.x one (`rope_parameters`, keyed by
layer type for Gemma 3, and an explicit `layer_types` list). Keys a config leaves out take the
default of transformers' own config class for that family (5.24), because that is what
transformers would run; `tests/test_weights.py` checks the table below against those classes.

Anything that would change the math and that the decoder cannot express (an MLP bias, YaRN rope,
partial rotary, bidirectional attention ...) is refused with a `ConfigError` rather than ignored.
"""

from __future__ import annotations

from typing import Any, Optional

from gemini_jax.config import DTYPES, ModelConfig, RopeConfig
from gemini_jax.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "gelu": "gelu"}
_LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers 5.24 class defaults for the keys read here (None: the key has no default there).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=2048,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=10000.0),
    "mistral": dict(rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=131072,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rope_theta=10000.0,
                    sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=32768,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, rope_theta=10000.0,
                  sliding_window=4096, use_sliding_window=False, max_window_layers=28),
    "qwen3": dict(rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=32768,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, rope_theta=10000.0,
                  sliding_window=4096, use_sliding_window=False, max_window_layers=28, head_dim=128),
    "gemma2": dict(rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
                   tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, rope_theta=10000.0,
                   sliding_window=4096, head_dim=256, query_pre_attn_scalar=256,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                   tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0, sliding_window=4096, head_dim=256,
                   query_pre_attn_scalar=256, attn_logit_softcapping=None, final_logit_softcapping=None,
                   sliding_window_pattern=6),
}


def model_config_from_hf(config: dict[str, Any], dtype: str = "float32") -> ModelConfig:
    """Map a parsed HF `config.json` onto a `ModelConfig` whose weights are `dtype`.

    Raises `ConfigError` for an unknown `model_type`, a missing size field, or a feature the decoder
    does not implement; the message names the key and lists what is supported.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {DTYPES}.")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        hint = (" (no model_type key: a gemini_jax native checkpoint loads with load_safetensors)"
                if model_type is None else "")
        raise ConfigError(f"model_type={model_type!r} is not supported{hint}; "
                          f"supported: {SUPPORTED_MODEL_TYPES}.")
    if model_type == "gemma3":  # multimodal wrapper: the decoder is its text tower
        # The wrapper's own tie flag is the one transformers ties by; its token ids win too.
        top = {k: config[k] for k in ("tie_word_embeddings", "bos_token_id", "eos_token_id") if k in config}
        config = {**(config.get("text_config") or {}), **top}
    family = {"gemma3_text": "gemma3", "gemma3": "gemma3"}.get(model_type, model_type)
    c = _Keys(config, FAMILY_DEFAULTS[family], model_type)
    gemma = family in ("gemma2", "gemma3")

    _refuse_unsupported(c, family)
    num_layers, hidden, heads = c.required("num_hidden_layers"), c.required("hidden_size"), \
        c.required("num_attention_heads")
    head_dim = c.get("head_dim")
    if head_dim is None:
        head_dim = hidden // heads
    # transformers' Mistral has no attention biases whatever the config says.
    attention_bias = bool(c.get("attention_bias", False)) and family != "mistral"
    global_rope, local_rope = _ropes(c, family)
    softcap = (lambda key: c.get(key)) if gemma else (lambda key: None)

    return ModelConfig(
        family=family,
        vocab_size=c.required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=c.required("intermediate_size"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=int(head_dim),
        max_position=int(c.get("max_position_embeddings")),
        norm_eps=float(c.get("rms_norm_eps")),
        norm_kind="rms_plus_one" if gemma else "rms",
        activation=_activation(c, gemma),
        # Qwen2 always has q/k/v biases and never an o bias; elsewhere `attention_bias` covers all four.
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        qk_norm=family in ("qwen3", "gemma3"),
        sandwich_norms=gemma,
        embed_scale=gemma,
        attn_scale=float(c.get("query_pre_attn_scalar")) ** -0.5 if gemma else None,
        attn_softcap=softcap("attn_logit_softcapping"),
        final_softcap=softcap("final_logit_softcapping"),
        tie_embeddings=bool(c.get("tie_word_embeddings")),
        rope=global_rope,
        local_rope=local_rope,
        layer_windows=_layer_windows(c, family, num_layers),
        bos_id=_first(c.get("bos_token_id")),
        eos_id=_first(c.get("eos_token_id")),
        dtype=dtype,
    )


class _Keys:
    """A config dict with the family's defaults behind it."""

    def __init__(self, config: dict[str, Any], defaults: dict[str, Any], model_type: str):
        self.config, self.defaults, self.model_type = config, defaults, model_type

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.config:
            return self.config[key]
        return self.defaults.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.config

    def required(self, key: str) -> int:
        value = self.config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"config.json ({self.model_type}): {key}={value!r} must be a positive "
                              f"integer; it has no default.")
        return value


def _refuse_unsupported(c: _Keys, family: str) -> None:
    problems = []
    if c.get("mlp_bias", False):
        problems.append("mlp_bias=true (the decoder's MLP has no biases)")
    if c.get("use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=true (the decoder is causal only)")
    if problems:
        raise ConfigError(f"config.json ({c.model_type}) uses unsupported feature(s): {'; '.join(problems)}. "
                          f"Supported: model types {SUPPORTED_MODEL_TYPES}, rope types {SUPPORTED_ROPE_TYPES}, "
                          f"no MLP bias, causal attention.")


def _activation(c: _Keys, gemma: bool) -> str:
    # Gemma 2/3 configs name it `hidden_activation`; some older ones only `hidden_act`.
    key = "hidden_activation" if gemma and c.get("hidden_activation") is not None else "hidden_act"
    name = c.get(key)
    if name not in _ACTIVATIONS:
        raise ConfigError(f"config.json ({c.model_type}): {key}={name!r} is not supported; "
                          f"supported: {sorted(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


def _first(token_id) -> Optional[int]:
    """eos/bos may be a list (several stop ids); the config keeps the first."""
    if isinstance(token_id, (list, tuple)):
        return int(token_id[0]) if token_id else None
    return None if token_id is None else int(token_id)


def _rope(params: dict[str, Any], theta: float, where: str, partial_default: float = 1.0) -> RopeConfig:
    """One rope parameter dict (4.x `rope_scaling` or a 5.x `rope_parameters` entry)."""
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    partial = params.get("partial_rotary_factor", partial_default)
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: partial_rotary_factor={partial} is not supported (only full rotary).")

    def need(key):
        if key not in params:
            raise ConfigError(f"{where}: rope_type={kind!r} needs {key!r}; got keys {sorted(params)}.")
        return params[key]

    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(need("factor")))
    if kind == "llama3":
        return RopeConfig(theta=theta, kind="llama3", factor=float(need("factor")),
                          low_freq_factor=float(need("low_freq_factor")),
                          high_freq_factor=float(need("high_freq_factor")),
                          original_max_position=int(need("original_max_position_embeddings")))
    raise ConfigError(f"{where}: rope_type={kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}.")


def _ropes(c: _Keys, family: str) -> tuple[RopeConfig, Optional[RopeConfig]]:
    """(global rope, local rope for sliding layers or None)."""
    theta = float(c.get("rope_theta"))
    partial = c.get("partial_rotary_factor", 1.0)
    params = c.get("rope_parameters")
    per_type = isinstance(params, dict) and any(k in params for k in _LAYER_TYPES)
    if params is not None and not per_type:
        glob = _rope(params, theta, "rope_parameters", partial)
    elif per_type:
        glob = _rope(params.get("full_attention"), theta, "rope_parameters.full_attention", partial)
    else:
        glob = _rope(c.get("rope_scaling"), theta, "rope_scaling", partial)
    if family != "gemma3":
        return glob, None
    local_theta = float(c.get("rope_local_base_freq"))
    if per_type:
        local = _rope(params.get("sliding_attention"), local_theta, "rope_parameters.sliding_attention", partial)
    else:  # 4.x: `rope_scaling` applies to the global layers only; local layers use plain rope
        local = RopeConfig(theta=local_theta)
    return glob, local


def _layer_windows(c: _Keys, family: str, num_layers: int) -> tuple[int, ...]:
    """Per-layer sliding window (0 = full). transformers' mask: p - W < k <= p, as ours."""
    window = c.get("sliding_window")
    if family in ("qwen2", "qwen3") and not c.get("use_sliding_window"):
        window = None  # Qwen's config drops the window unless use_sliding_window is set
    if family == "llama":
        return (0,) * num_layers
    if family == "mistral":  # Mistral's model reads no layer_types: one window for every layer
        return (int(window or 0),) * num_layers

    layer_types = c.get("layer_types")
    if layer_types is None:
        if family in ("qwen2", "qwen3"):
            first = int(c.get("max_window_layers"))
            sliding = [window is not None and i >= first for i in range(num_layers)]
        elif family == "gemma2":
            sliding = [(i + 1) % 2 != 0 for i in range(num_layers)]
        else:
            # 4.x wrote `sliding_window_pattern`; 5.x keeps it as `_sliding_window_pattern`.
            key = "sliding_window_pattern" if c.has("sliding_window_pattern") else "_sliding_window_pattern"
            pattern = c.config.get(key, c.defaults["sliding_window_pattern"])
            if not isinstance(pattern, int) or pattern <= 0:
                raise ConfigError(f"config.json ({c.model_type}): {key}={pattern!r} must be a positive integer.")
            sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        bad = sorted({t for t in layer_types if t not in _LAYER_TYPES})
        if bad or len(layer_types) != num_layers:
            raise ConfigError(f"config.json ({c.model_type}): layer_types={layer_types} must list "
                              f"{num_layers} entries from {_LAYER_TYPES}; unsupported: {bad}.")
        sliding = [t == "sliding_attention" for t in layer_types]
    if family == "gemma3" and any(sliding) and not window:
        raise ConfigError(f"config.json ({c.model_type}): sliding_attention layers with "
                          f"sliding_window={window!r} are not supported (need a positive window).")
    return tuple(int(window) if s and window else 0 for s in sliding)
