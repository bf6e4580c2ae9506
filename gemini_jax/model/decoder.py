"""The decoder: one Flax NNX module for every supported family.

Family differences are data in `ModelConfig` (norm kind, sandwich norms, qk-norm, biases,
soft-caps, per-layer sliding windows and rope), not subclasses. Layer weights are stacked along
a leading layer axis and the layers run under `jax.lax.scan`, so compile time does not grow with
depth; the engine holds them per layer instead (`unstack_layers`), and the layers then run
unrolled, each reading its own buffers (a scan copies each layer's slice before using it). Attention over past keys is delegated to a *KV backend* (dense, contiguous cache, paged
cache ...) so the model itself never knows where the KV lives.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.config import ModelConfig
from gemini_jax.model import layers

# Per-layer weights: name -> shape given the config (None when the family lacks it).
def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = {
        "attn_norm": (E,), "wq": (E, q), "wk": (E, kv), "wv": (E, kv), "wo": (q, E),
        "mlp_norm": (E,), "w_gate": (E, I), "w_up": (E, I), "w_down": (I, E),
    }
    if cfg.qkv_bias:
        shapes.update(bq=(q,), bk=(kv,), bv=(kv,))
    if cfg.o_bias:
        shapes.update(bo=(E,))
    if cfg.qk_norm:
        shapes.update(q_norm=(D,), k_norm=(D,))
    if cfg.sandwich_norms:
        shapes.update(post_attn_norm=(E,), post_mlp_norm=(E,))
    return shapes


def _is_norm(name: str) -> bool:
    return name.endswith("norm")


class LayerStack(nnx.Module):
    """All decoder layers' weights, each stacked along a leading [num_layers] axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        n = cfg.num_layers
        out_std = 0.02 / np.sqrt(2 * n)  # GPT-2 style: residual writers start small
        for name, shape in layer_param_shapes(cfg).items():
            full = (n, *shape)
            if _is_norm(name):
                init = jnp.zeros(full, dtype) if cfg.norm_kind == "rms_plus_one" else jnp.ones(full, dtype)
            elif name.startswith("b"):
                init = jnp.zeros(full, dtype)
            else:
                std = out_std if name in ("wo", "w_down") else 0.02
                init = (std * jax.random.normal(rngs.params(), full, jnp.float32)).astype(dtype)
            setattr(self, name, nnx.Param(init))

    def _params(self) -> dict[str, nnx.Param]:
        return {k: v for k, v in vars(self).items() if isinstance(v, nnx.Param)}

    @property
    def per_layer(self) -> bool:
        """True when each layer's weights are separate buffers (`unstack_layers`), not one array."""
        return any(isinstance(v.get_value(), tuple) for v in self._params().values())

    def arrays(self) -> dict[str, jax.Array]:
        """The stacked weights [num_layers, ...] (stacked here when they are held per layer)."""
        return {k: jnp.stack(v.get_value()) if isinstance(v.get_value(), tuple) else v[...]
                for k, v in self._params().items()}

    def layer(self, idx) -> dict[str, jax.Array]:
        """Layer `idx`'s weights (`idx` a Python int, or traced): its own buffers when held per
        layer, else a slice of the stacked arrays."""
        if not self.per_layer:
            return {k: v[...][idx] for k, v in self._params().items()}
        held = {k: v.get_value() for k, v in self._params().items()}
        if isinstance(idx, (int, np.integer)):
            return {k: t[int(idx)] for k, t in held.items()}
        # A traced index (the tiered runner's per-layer programs, one compile for every layer):
        # a switch whose branch returns that layer's buffers (one layer copied, as a slice would).
        return jax.lax.switch(idx, [functools.partial(lambda j: {k: t[j] for k, t in held.items()}, j)
                                    for j in range(len(next(iter(held.values()))))])


def unstack_layers(state):
    """A model state (`nnx.split`) whose layer weights are one buffer per layer (a tuple of
    `num_layers` arrays per name) instead of one stacked array. Decode programs over it read each
    layer's weights where they lie: a scan over the stacked arrays copies every layer's slice
    before its matmuls (XLA's dynamic-slice materializes), which doubles a decode step's weight
    traffic. The decoder then runs its layers unrolled (`Decoder.__call__`). The per-layer bytes
    in tree order are the stacked bytes, so `params_sha256` is unchanged."""
    layers = state["layers"]
    for name in list(layers.keys()):
        v = layers[name]
        arr = v.get_value()
        if not isinstance(arr, tuple):
            layers[name] = v.replace(tuple(arr[i] for i in range(arr.shape[0])))
    return state


# A KV backend attends the new queries to past + new keys and returns its updated cache.
#   backend(layer, q[B,T,H,D], k[B,T,K,D], v[B,T,K,D], q_pos[B,T], window, cache) -> (out, cache)
KVBackend = Callable[..., tuple[jax.Array, Any]]


def self_attention_backend(cfg: ModelConfig) -> KVBackend:
    """No cache: the tokens attend to themselves (full-sequence reference forward)."""

    def attend(layer, q, k, v, q_pos, window, cache):
        del layer
        valid = jnp.ones(q_pos.shape, bool)
        mask = layers.attention_mask(q_pos, q_pos, valid, window)
        return layers.dense_attention(q, k, v, mask, scale=cfg.scale, cap=cfg.attn_softcap), cache

    return attend


class Decoder(nnx.Module):
    """Token ids -> logits. `__call__` takes a KV backend; `gj.forward` is the no-cache path."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = jnp.dtype(cfg.dtype)
        self.embed = nnx.Param(
            (0.02 * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size))).astype(dtype))
        self.layers = LayerStack(cfg, rngs)
        norm_init = jnp.zeros if cfg.norm_kind == "rms_plus_one" else jnp.ones
        self.final_norm = nnx.Param(norm_init((cfg.hidden_size,), dtype))
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(
                (0.02 * jax.random.normal(rngs.params(), (cfg.hidden_size, cfg.vocab_size))).astype(dtype))
        else:
            self.lm_head = None

    def __call__(self, tokens, positions, backend: Optional[KVBackend] = None, cache=None,
                 *, remat: bool = False, select=None, slots=None):
        """tokens, positions int32[B, T] -> (logits f32[B, T, V], cache). `tokens` may instead be
        input embeddings f32[B, T, E] (soft tokens: gemini_jax.runtime.soft).

        `slots` int32[B, T]: where the tokens sit in the KV cache, when that is not their position
        (syntax-aligned pages leave padding slots between tokens: `cache.align`); the backend
        writes and masks by slot, rope rotates by position. None: the positions.

        `select` int32[B]: compute logits only at token index select[b] of each row -> [B, 1, V]
        (prefill needs just the last real token's logits; the vocab projection is not free).
        """
        cfg = self.cfg
        backend = backend or self_attention_backend(cfg)
        h = tokens if jnp.issubdtype(tokens.dtype, jnp.floating) else self.embed_tokens(tokens)
        rope = self._rope_tables(positions)

        def layer_fn(carry, xs):
            h, cache = carry
            p, idx = xs
            q, k, v = self._qkv(p, h, positions, rope, idx)
            out, cache = backend(idx, q, k, v, positions if slots is None else slots, self._window(idx), cache)
            h = self._finish(p, h, out)
            return (h, cache), None

        if remat:
            layer_fn = jax.checkpoint(layer_fn)
        if self.layers.per_layer:  # unrolled: each layer reads its own buffers (`unstack_layers`)
            for i in range(cfg.num_layers):
                (h, cache), _ = layer_fn((h, cache), (self.layers.layer(i), i))
        else:
            xs = (self.layers.arrays(), jnp.arange(cfg.num_layers))
            (h, cache), _ = jax.lax.scan(layer_fn, (h, cache), xs)
        if select is not None:
            h = jnp.take_along_axis(h, select[:, None, None].astype(jnp.int32), axis=1)
        return self.logits(h), cache

    def logits(self, h):
        cfg = self.cfg
        h = layers.rms_norm(h, self.final_norm[...], cfg.norm_eps, cfg.norm_kind == "rms_plus_one")
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        out = jnp.einsum("bte,ev->btv", h, head, preferred_element_type=jnp.float32)
        return layers.softcap(out, cfg.final_softcap)

    def _norm(self, x, w):
        return layers.rms_norm(x, w, self.cfg.norm_eps, self.cfg.norm_kind == "rms_plus_one")

    # ---- one layer in two halves -------------------------------------------------------------
    # The scan above runs them back to back; the tiered KV path (gemini_jax.runtime.tiered) runs
    # them from the host, layer by layer, so it can make the selected pages resident in between.
    def embed_tokens(self, tokens):
        h = self.embed[...][tokens]
        if self.cfg.embed_scale:
            h = h * jnp.asarray(self.cfg.hidden_size ** 0.5, dtype=h.dtype)
        return h

    def layer_params(self, idx) -> dict[str, jax.Array]:
        """Layer `idx`'s weights (`LayerStack.layer`)."""
        return self.layers.layer(idx)

    def _rope_tables(self, positions):
        cfg = self.cfg
        glob = layers.rope_angles(positions, layers.inv_frequencies(cfg.rope, cfg.head_dim))
        if cfg.local_rope is None:
            return glob, glob
        # Gemma 3: sliding layers use their own rope base
        return glob, layers.rope_angles(positions, layers.inv_frequencies(cfg.local_rope, cfg.head_dim))

    def _window(self, idx):
        return jnp.asarray(self.cfg.layer_windows, jnp.int32)[idx]

    def _qkv(self, p, h, positions, rope, idx):
        """Pre-attention half: norm, projections, qk-norm, rope -> q [B,T,H,D], k, v [B,T,K,D]."""
        cfg = self.cfg
        (cos_g, sin_g), (cos_l, sin_l) = rope
        use_local = jnp.asarray([w > 0 and cfg.local_rope is not None for w in cfg.layer_windows])[idx]
        cos, sin = jnp.where(use_local, cos_l, cos_g), jnp.where(use_local, sin_l, sin_g)
        B, T, _ = h.shape
        x = self._norm(h, p["attn_norm"])
        q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
        if cfg.qkv_bias:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self._norm(q, p["q_norm"]), self._norm(k, p["k_norm"])
        return layers.apply_rope(q, cos, sin), layers.apply_rope(k, cos, sin), v

    def layer_qkv(self, idx, h, positions):
        return self._qkv(self.layer_params(idx), h, positions, self._rope_tables(positions), idx)

    def _finish(self, p, h, attn):
        """Post-attention half: output projection, residual, MLP, residual."""
        cfg = self.cfg
        B, T = attn.shape[:2]
        out = attn.reshape(B, T, cfg.num_heads * cfg.head_dim) @ p["wo"]
        if cfg.o_bias:
            out = out + p["bo"]
        if cfg.sandwich_norms:
            out = self._norm(out, p["post_attn_norm"])
        h = h + out
        return h + self._mlp(p, h)

    def layer_finish(self, idx, h, attn):
        return self._finish(self.layer_params(idx), h, attn)

    def _mlp(self, p, h):
        cfg = self.cfg
        x = self._norm(h, p["mlp_norm"])
        x = layers.activation(cfg.activation)(x @ p["w_gate"]) * (x @ p["w_up"])
        x = x @ p["w_down"]
        if cfg.sandwich_norms:
            x = self._norm(x, p["post_mlp_norm"])
        return x


def validate_tokens(tokens, vocab_size: int, what: str = "prompt") -> np.ndarray:
    """int32 copy of a 1-D token sequence, or TokenError naming the first bad id."""
    from gemini_jax.errors import TokenError

    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise TokenError(f"{what} must be a 1-D sequence of token ids; got shape {arr.shape}.")
    if arr.size == 0:
        raise TokenError(f"{what} is empty; give at least one token.")
    if not np.issubdtype(arr.dtype, np.integer):
        raise TokenError(f"{what} must hold integer token ids; got dtype {arr.dtype}.")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise TokenError(f"{what}[{i}] = {int(arr[i])} is outside the vocabulary [0, {vocab_size}) "
                         f"({bad.size} bad id(s) in all).")
    return arr.astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def _forward_jit(graphdef, state, tokens):
    model = nnx.merge(graphdef, state)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    logits, _ = model(tokens[None], positions)
    return logits[0]


def forward(model: Decoder, tokens) -> jax.Array:
    """Full-sequence logits f32[T, vocab] with dense attention and no cache: the reference path."""
    toks = validate_tokens(tokens, model.cfg.vocab_size, "tokens")
    return _forward_jit(*nnx.split(model), jnp.asarray(toks))
