"""Load a GGUF file (llama.cpp's one-file format: metadata + tensors) into a `Decoder`.

The file is read with the `gguf` package and checked whole before anything is built: the
architecture, the sizes its metadata gives, and every tensor's name, type and shape. Only then are
the tensors dequantized (numpy, float32; `dequantize` below) and handed to `decoder_from_arrays`.

Layout. GGUF lists a tensor's dimensions fastest-first, so a Linear weight read into numpy is
[out, in], as in HF checkpoints; the decoder wants [in, out]. llama.cpp's converter also reorders
the rows of a llama model's Q and K projections inside each head, from rotate-half pairs (i, i + D/2)
to adjacent pairs (2i, 2i + 1), for its rope kernel; `unpermute_rope_rows` puts them back so the
decoder's rope (the HF one) applies. Qwen2 files keep HF's order (llama.cpp ropes them that way).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from gemini_jax.config import DTYPES, ModelConfig, RopeConfig
from gemini_jax.errors import CheckpointError, ConfigError
from gemini_jax.model import Decoder
from gemini_jax.tokenizer import gguf_field, read_gguf
from gemini_jax.weights.native import decoder_from_arrays, param_specs

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# GGML tensor type -> (values per block, bytes per block). The Q types store blocks of 32 values:
# Q8_0 an f16 scale and 32 int8; Q4_0 an f16 scale and 32 4-bit values (offset 8); Q4_1 an f16
# scale, an f16 minimum and 32 4-bit values; the 4-bit ones pack value j in the low nibble of byte
# j and value j + 16 in the high nibble.
BLOCK_LAYOUTS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20)}

# native name -> GGUF name (per layer: under `blk.{i}.`)
_LAYER = {
    "attn_norm": "attn_norm.weight",
    "wq": "attn_q.weight", "wk": "attn_k.weight", "wv": "attn_v.weight", "wo": "attn_output.weight",
    "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias",
    "mlp_norm": "ffn_norm.weight",
    "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight",
}
_TOP = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
# Tensors some files carry that mean a feature the decoder lacks.
_UNSUPPORTED_TENSORS = {"rope_freqs.weight": "llama3-style rope frequency factors"}


def dequantize(raw: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's raw bytes uint8[n_bytes] of GGML type `type_name` -> float32[shape].

    Raises `CheckpointError` for a type outside `BLOCK_LAYOUTS` or a byte count that does not fit.
    """
    if type_name not in BLOCK_LAYOUTS:
        raise CheckpointError(f"GGML tensor type {type_name} is not supported; supported: {sorted(BLOCK_LAYOUTS)}.")
    block_values, block_bytes = BLOCK_LAYOUTS[type_name]
    count = int(np.prod(shape))
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if count % block_values or raw.size != count // block_values * block_bytes:
        raise CheckpointError(f"a {type_name} tensor of shape {list(shape)} needs "
                              f"{count // block_values * block_bytes} bytes in blocks of {block_values}; "
                              f"got {raw.size}.")
    if type_name == "F32":
        values = raw.view(np.float32)
    elif type_name == "F16":
        values = raw.view(np.float16).astype(np.float32)
    elif type_name == "BF16":  # the top half of a float32
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        blocks = raw.reshape(-1, block_bytes)
        scale = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [n_blocks, 1]
        if type_name == "Q8_0":
            values = scale * blocks[:, 2:].view(np.int8).astype(np.float32)
        else:
            packed = blocks[:, 4:] if type_name == "Q4_1" else blocks[:, 2:]
            nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
            if type_name == "Q4_0":
                values = scale * (nibbles - 8.0)
            else:
                values = scale * nibbles + blocks[:, 2:4].view(np.float16).astype(np.float32)
    return values.reshape(shape)


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order of a Q/K projection [heads * D, ...]: its row 2i + j of a
    head (i < D/2, j in {0, 1}) is HF's row j * D/2 + i."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_config_from_gguf(reader, dtype: str = "float32") -> ModelConfig:
    """The `ModelConfig` a GGUF file's metadata describes (reader: `gemini_jax.tokenizer.read_gguf`).

    Raises `CheckpointError` naming the key for an unsupported architecture, a missing or invalid
    size, or a feature the decoder lacks (rope scaling other than linear, partial rotary ...).
    """
    path = reader.data.filename
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"{path}: general.architecture={arch!r} is not supported; supported: "
                              f"{SUPPORTED_ARCHITECTURES}.")

    def size(key: str, default=None) -> int:
        value = gguf_field(reader, f"{arch}.{key}", default)
        if isinstance(value, list):  # a per-layer list (some converters write one); the decoder needs one value
            if len(set(value)) != 1:
                raise CheckpointError(f"{path}: {arch}.{key}={value} differs between layers; the decoder "
                                      f"needs one value for all layers.")
            value = value[0]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{path}: {arch}.{key}={value!r} must be a positive integer.")
        return value

    tensors = _tensor_index(reader)
    embed = tensors.get(_TOP["embed"])
    if embed is None:
        raise CheckpointError(f"{path}: tensor {_TOP['embed']!r} is missing.")
    hidden, heads = size("embedding_length"), size("attention.head_count")
    head_dim = size("attention.key_length", hidden // heads)
    if size("attention.value_length", head_dim) != head_dim:
        raise CheckpointError(f"{path}: {arch}.attention.value_length differs from key_length={head_dim}; "
                              f"the decoder needs one head size.")
    if size("rope.dimension_count", head_dim) != head_dim:
        raise CheckpointError(f"{path}: {arch}.rope.dimension_count={size('rope.dimension_count')} is "
                              f"not the head size {head_dim}; partial rotary is not supported.")
    eps = gguf_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")
    try:
        return ModelConfig(
            family=arch,
            vocab_size=int(_shape(embed)[0]),
            hidden_size=hidden,
            intermediate_size=size("feed_forward_length"),
            num_layers=size("block_count"),
            num_heads=heads,
            num_kv_heads=size("attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position=size("context_length"),
            norm_eps=float(eps),
            qkv_bias=arch == "qwen2",
            tie_embeddings=_TOP["lm_head"] not in tensors,
            rope=_rope(reader, arch, path),
            bos_id=gguf_field(reader, "tokenizer.ggml.bos_token_id", None),
            eos_id=gguf_field(reader, "tokenizer.ggml.eos_token_id", None),
            dtype=dtype,
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: the metadata describes no valid model: {e}") from None


def _rope(reader, arch: str, path: str) -> RopeConfig:
    theta = gguf_field(reader, f"{arch}.rope.freq_base", 10000.0)
    kind = gguf_field(reader, f"{arch}.rope.scaling.type", "none")
    factor = gguf_field(reader, f"{arch}.rope.scaling.factor", None)
    if factor is None:  # the older spelling of a linear factor
        factor = gguf_field(reader, f"{arch}.rope.scale_linear", None)
        kind = "linear" if factor is not None and kind == "none" else kind
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return RopeConfig(theta=float(theta))
    if kind == "linear":
        return RopeConfig(theta=float(theta), kind="linear", factor=float(factor))
    raise CheckpointError(f"{path}: {arch}.rope.scaling.type={kind!r} is not supported; supported: 'none', "
                          f"'linear'.")


def _tensor_index(reader) -> dict:
    return {t.name: t for t in reader.tensors}


def _shape(tensor) -> tuple[int, ...]:
    """numpy (slowest-first) shape of a GGUF tensor."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def gguf_name_map(cfg: ModelConfig) -> dict[str, list[str]]:
    """Native name -> its GGUF tensors (one per layer for stacked weights)."""
    plan = {}
    for name in param_specs(cfg):
        if name.startswith("layers."):
            gguf_name = _LAYER[name.removeprefix("layers.")]
            plan[name] = [f"blk.{i}.{gguf_name}" for i in range(cfg.num_layers)]
        else:
            plan[name] = [_TOP[name]]
    return plan


def _is_matrix(native: str) -> bool:
    """Stored [out, in] (a projection); the embedding is [vocab, hidden] in both layouts."""
    return native != "embed" and native.removeprefix("layers.") in (
        "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head")


def load_gguf(path: str | os.PathLike, dtype: str = "float32") -> Decoder:
    """Load a llama or qwen2 GGUF file, its tensors dequantized (F32, F16, BF16, Q8_0, Q4_0, Q4_1)
    and cast to `dtype` (float32 | bfloat16 | float16). No `output.weight` means tied embeddings.

    Raises `ConfigError` for an unsupported dtype; `CheckpointError` for a missing, corrupt or
    truncated file, an unsupported architecture, quantization type or feature, or a missing, extra
    or mis-shaped tensor. Everything is checked before the first tensor is dequantized.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {DTYPES}.")
    return decoder_from_gguf(read_gguf(path), dtype)


def decoder_from_gguf(reader, dtype: str = "float32") -> Decoder:
    """`load_gguf` on a file already opened with `gemini_jax.tokenizer.read_gguf` (opening parses
    all the metadata, seconds for a large vocabulary, so a caller that also builds the tokenizer
    opens it once)."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {DTYPES}.")
    path = reader.data.filename
    cfg = model_config_from_gguf(reader, dtype)
    tensors = _tensor_index(reader)
    plan = gguf_name_map(cfg)
    specs = param_specs(cfg)

    wanted = {g for sources in plan.values() for g in sources}
    missing, unexpected = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} tensor(s) the metadata implies are missing: {_clip(missing)}.")
    if unexpected:
        why = "; ".join(f"{n} means {_UNSUPPORTED_TENSORS[n]}, not supported" for n in unexpected
                        if n in _UNSUPPORTED_TENSORS)
        raise CheckpointError(f"{path}: {len(unexpected)} tensor(s) the decoder has no place for"
                              f"{' (' + why + ')' if why else ''}: {_clip(unexpected)}.")
    for native, sources in plan.items():
        per_layer = tuple(specs[native].shape[1:] if native.startswith("layers.") else specs[native].shape)
        expected = per_layer[::-1] if _is_matrix(native) else per_layer
        for name in sources:
            tensor = tensors[name]
            kind = tensor.tensor_type.name
            if kind not in BLOCK_LAYOUTS:
                raise CheckpointError(f"{path}: tensor {name!r} is {kind}, a quantization type not supported; "
                                      f"supported: {sorted(BLOCK_LAYOUTS)}. Convert the file to one of those.")
            if _shape(tensor) != expected:
                raise CheckpointError(f"{path}: tensor {name!r} has shape {list(_shape(tensor))}, expected "
                                      f"{list(expected)} from the metadata.")
            block_values, block_bytes = BLOCK_LAYOUTS[kind]
            n_bytes = int(np.prod(expected)) // block_values * block_bytes
            if expected[-1] % block_values or int(tensor.n_bytes) != n_bytes:
                raise CheckpointError(f"{path}: tensor {name!r} ({kind}) holds {int(tensor.n_bytes)} bytes, which "
                                      f"do not fit shape {list(expected)}.")

    arrays = {}
    for native, sources in plan.items():
        parts = [_read(reader, tensors[name], cfg, native) for name in sources]
        # Each array goes to the device before the next is read: one model copy at a time.
        arrays[native] = jnp.asarray(np.stack(parts) if native.startswith("layers.") else parts[0],
                                     dtype=jnp.dtype(dtype))
    return decoder_from_arrays(cfg, arrays, source=path)


def _read(reader, tensor, cfg: ModelConfig, native: str) -> np.ndarray:
    """One GGUF tensor in the native layout, float32."""
    start = int(tensor.data_offset)
    w = dequantize(reader.data[start:start + int(tensor.n_bytes)], tensor.tensor_type.name, _shape(tensor))
    layer_name = native.removeprefix("layers.")
    if cfg.family == "llama" and layer_name in ("wq", "wk"):
        w = unpermute_rope_rows(w, cfg.num_heads if layer_name == "wq" else cfg.num_kv_heads)
    return w.T if _is_matrix(native) else w


def _clip(names: list[str], n: int = 8) -> str:
    return ", ".join(names[:n]) + (f" ... (+{len(names) - n} more)" if len(names) > n else "")
