"""Tokenizers: a byte-level one for our small models, and HF `tokenizer.json` via `tokenizers`."""

from __future__ import annotations

import os
from typing import Sequence

from gemini_jax.errors import CheckpointError, TokenError


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; then BOS, EOS, PAD. Lossless for any text."""

    BOS, EOS, PAD = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        for i in ids:
            if not 0 <= int(i) < self.vocab_size:
                raise TokenError(f"token id {int(i)} is outside the byte vocabulary [0, {self.vocab_size}).")
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` package (no network)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise CheckpointError(f"no tokenizer.json at {file!r}.")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as e:  # the tokenizers package raises a bare Exception
            raise CheckpointError(f"cannot read tokenizer {file!r}: {e}") from None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=bos).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])
