"""The benchmark model: a tiny-but-real-shaped Llama built with transformers, saved as
safetensors and loaded into gemini_jax with `gj.load_hf`, so both sides run the SAME weights."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

# Llama-shaped: head_dim 64, GQA 4:1, a 32K vocabulary; ~45M parameters (~180 MB in fp32).
LLAMA_SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


@dataclass
class BenchModel:
    path: str  # the saved HF checkpoint directory
    ours: Any  # gj.Decoder
    hf: Any  # transformers LlamaForCausalLM (eval, fp32), or None if not requested
    description: str


def build_llama(seed: int, with_hf: bool = True) -> BenchModel:
    import torch
    import transformers

    import gemini_jax as gj

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**LLAMA_SHAPE, attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(cfg).eval().to(torch.float32)
    path = tempfile.mkdtemp(prefix="gj_bench_llama_")
    atexit.register(shutil.rmtree, path, True)
    hf.save_pretrained(path, safe_serialization=True)
    ours = gj.load_hf(path, dtype="float32")
    # Benchmarks time a fixed number of tokens: no EOS stop on the HF side either.
    hf.generation_config.eos_token_id = None
    s = LLAMA_SHAPE
    desc = (f"random-init Llama (transformers {transformers.__version__}), {s['num_hidden_layers']} layers, "
            f"hidden {s['hidden_size']}, {s['num_attention_heads']} heads / {s['num_key_value_heads']} kv heads "
            f"(head_dim {s['hidden_size'] // s['num_attention_heads']}), intermediate {s['intermediate_size']}, "
            f"vocab {s['vocab_size']}, {ours.cfg.num_params() / 1e6:.1f}M params, fp32; saved with "
            f"save_pretrained (safetensors) and loaded into gemini_jax with gj.load_hf")
    return BenchModel(path, ours, hf if with_hf else None, desc)


def build_llama_jax(seed: int) -> BenchModel:
    """The same Llama shape initialised by gemini_jax alone (random weights, no transformers):
    for rows that time our engine only, on machines without torch (e.g. a GPU box)."""
    import gemini_jax as gj
    from gemini_jax.testing import random_model

    s = LLAMA_SHAPE
    cfg = gj.ModelConfig(family="llama", vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                         intermediate_size=s["intermediate_size"], num_layers=s["num_hidden_layers"],
                         num_heads=s["num_attention_heads"], num_kv_heads=s["num_key_value_heads"],
                         head_dim=s["hidden_size"] // s["num_attention_heads"],
                         max_position=s["max_position_embeddings"], norm_eps=s["rms_norm_eps"],
                         rope=gj.RopeConfig(theta=s["rope_theta"]), tie_embeddings=s["tie_word_embeddings"])
    ours = random_model(cfg, seed)
    return BenchModel("", ours, None, f"random-init Llama shape of the other rows, built by gemini_jax "
                                      f"({ours.cfg.num_params() / 1e6:.1f}M params, fp32; no transformers)")
