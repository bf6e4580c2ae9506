"""gemini_jax: long-context LLM decoding under a memory wall.

    import gemini_jax as gj
    model = gj.load_tiny()
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=4096))
    out = eng.generate(prompt_tokens, gj.SamplingParams(max_new_tokens=64))

    model, tok = gj.load_pretrained("smollm2-135m-instruct")   # a GGUF shipped by a pip package
"""

from gemini_jax import errors
from gemini_jax.config import EngineConfig, ModelConfig, RopeConfig, SamplingParams
from gemini_jax.engine import COUNTERS, Engine, GenerateOutput
from gemini_jax.model import Decoder, forward
from gemini_jax.encoders.prompt import Image, Prompt
from gemini_jax.tokenizer import ByteTokenizer, GGUFTokenizer, HFTokenizer
from gemini_jax.tiers.observe import SelectionObserver

Model = Decoder


def load_hf(path: str, dtype: str = "float32") -> Decoder:
    """A Hugging Face safetensors directory -> Model (see gemini_jax.weights)."""
    from gemini_jax.weights import load_hf as _load_hf

    return _load_hf(path, dtype=dtype)


def load_gguf(path: str, dtype: str = "float32") -> Decoder:
    """A GGUF file (llama / qwen2; F32, F16, BF16, Q8_0, Q4_0, Q4_1 dequantized) -> Model."""
    from gemini_jax.weights import load_gguf as _load_gguf

    return _load_gguf(path, dtype=dtype)


def load_pretrained(name: str, dtype: str = "float32") -> tuple[Decoder, GGUFTokenizer]:
    """(Model, tokenizer) of a pretrained model by name (`gj.list_pretrained()`), from its installed file."""
    from gemini_jax.weights import load_pretrained as _load_pretrained

    return _load_pretrained(name, dtype=dtype)


def pretrained_path(name: str) -> str:
    """Where the installed file of pretrained model `name` lies; the error says how to install it."""
    from gemini_jax.weights import pretrained_path as _pretrained_path

    return _pretrained_path(name)


def list_pretrained() -> list[str]:
    """The pretrained models' names."""
    from gemini_jax.weights import list_pretrained as _list_pretrained

    return _list_pretrained()


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
    "COUNTERS", "ByteTokenizer", "Decoder", "Engine", "EngineConfig", "GGUFTokenizer", "GenerateOutput", "HFTokenizer", "SelectionObserver",
    "Image", "Model", "ModelConfig", "Prompt", "RopeConfig", "SamplingParams", "errors", "forward", "list_encoders",
    "list_pretrained", "load_encoder", "load_gguf", "load_hf", "load_pretrained", "load_tiny", "pretrained_path",
]
