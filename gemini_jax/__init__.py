"""gemini_jax: long-context LLM decoding under a memory wall.

    import gemini_jax as gj
    model = gj.load_tiny()
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=4096))
    out = eng.generate(prompt_tokens, gj.SamplingParams(max_new_tokens=64))
"""

from gemini_jax import errors
from gemini_jax.config import EngineConfig, ModelConfig, RopeConfig, SamplingParams
from gemini_jax.engine import COUNTERS, Engine, GenerateOutput
from gemini_jax.model import Decoder, forward
from gemini_jax.encoders.prompt import Image, Prompt
from gemini_jax.tokenizer import ByteTokenizer, HFTokenizer

Model = Decoder


def load_hf(path: str, dtype: str = "float32") -> Decoder:
    """A Hugging Face safetensors directory -> Model (see gemini_jax.weights)."""
    from gemini_jax.weights import load_hf as _load_hf

    return _load_hf(path, dtype=dtype)


def load_encoder(name: str):
    """A shipped modality encoder with its projector (`gj.list_encoders()` names them), for `gj.Image`."""
    from gemini_jax.encoders import load_encoder as _load_encoder

    return _load_encoder(name)


def list_encoders() -> list[str]:
    """The shipped modality encoders' names."""
    from gemini_jax.encoders import list_encoders as _list_encoders

    return _list_encoders()


def load_tiny() -> Decoder:
    """The small byte-level model shipped inside the package (no network)."""
    from gemini_jax.tiny import load_tiny as _load_tiny

    return _load_tiny()


__all__ = [
    "COUNTERS", "ByteTokenizer", "Decoder", "Engine", "EngineConfig", "GenerateOutput", "HFTokenizer", "Image",
    "Model", "ModelConfig", "Prompt", "RopeConfig", "SamplingParams", "errors", "forward", "list_encoders",
    "load_encoder", "load_hf", "load_tiny",
]
