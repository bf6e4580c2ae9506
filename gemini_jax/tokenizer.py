"""Tokenizers: a byte-level one for our small models, HF `tokenizer.json` and GGUF vocabularies via
`tokenizers`."""

from __future__ import annotations

import datetime
import json
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


# ---- GGUF ------------------------------------------------------------------------------------
# A GGUF file (llama.cpp's format) carries its tokenizer as metadata. The reading helpers live
# here, the lowest module that needs them; gemini_jax.weights.gguf reads the weights with them.

_MISSING = object()


def read_gguf(path: str | os.PathLike):
    """Open a GGUF file (memory-mapped, read-only) -> `gguf.GGUFReader`.

    Raises `CheckpointError` when the file is missing or is not a readable GGUF (bad magic,
    unsupported version, truncated header or tensor data).
    """
    from gguf import GGUFReader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"no GGUF file at {path!r}.")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/UnicodeDecodeError on bad bytes
        raise CheckpointError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); the file is "
                              f"corrupt or truncated, download it again.") from None


def gguf_field(reader, key: str, default=_MISSING):
    """The value of metadata `key` (a Python scalar, str or list); `default` when absent, else
    `CheckpointError` naming the key."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise CheckpointError(f"{reader.data.filename}: GGUF metadata key {key!r} is missing.")
        return default
    try:
        return field.contents()
    except Exception as e:  # undecodable strings, a malformed array
        raise CheckpointError(f"{reader.data.filename}: GGUF metadata key {key!r} cannot be read "
                              f"({type(e).__name__}: {e}).") from None


# GGUF token types (llama.cpp's llama_token_type): 3 = control (<|im_start|>), 4 = user-defined.
_CONTROL, _USER_DEFINED = 3, 4
# Byte-level BPE splits text before merging; `tokenizer.ggml.pre` names the split rule. GPT-2's rule
# is the byte-level pre-tokenizer's own regex (None); the others are given here.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# SmolLM's vocabulary has no merges between digits, so GPT-2's rule splits it as its own would.
GGUF_PRE_TOKENIZERS = {
    "default": None, "gpt2": None, "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's spelling of each byte: printable latin-1 bytes stand for themselves, the
    rest map to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in keep:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


class GGUFTokenizer:
    """The tokenizer a GGUF file describes (`tokenizer.ggml.*` metadata), built with `tokenizers`.

    Supports byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`: SmolLM, Qwen2, Llama 3)
    with the split rules in `GGUF_PRE_TOKENIZERS`. Control tokens (`<|im_start|>` ...) are matched
    whole in text, as transformers does. `apply_chat_template` renders the file's own Jinja chat
    template in a sandbox. Raises `CheckpointError` for a missing/corrupt file or a tokenizer kind
    it cannot build.
    """

    def __init__(self, path: str | os.PathLike, *, reader=None):
        """`reader`: the file already opened with `read_gguf` (opening parses all its metadata)."""
        reader = read_gguf(path) if reader is None else reader
        self.path = os.fspath(path)
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        self._tok = _byte_level_bpe(self.path, reader, tokens)
        self.vocab_size = len(tokens)
        self.bos_id = _token_id(reader, "tokenizer.ggml.bos_token_id", self.vocab_size)
        self.eos_id = _token_id(reader, "tokenizer.ggml.eos_token_id", self.vocab_size)
        self.add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False))
        self.chat_template = gguf_field(reader, "tokenizer.chat_template", None)
        self._tokens = tokens

    def encode(self, text: str, *, bos: bool | None = None) -> list[int]:
        """Token ids of `text`; `bos` prepends the BOS id (None: as the file's `add_bos_token` says)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if (self.add_bos if bos is None else bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """Text of `ids` (`skip_special` drops control tokens); `TokenError` for an id outside the vocabulary."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise TokenError(f"token id {i} is outside the vocabulary [0, {self.vocab_size}) of {self.path}.")
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The file's chat template rendered over `messages` ([{"role": ..., "content": ...}, ...]).

        Raises `CheckpointError` if the file has no chat template, `TokenError` if the template
        refuses the messages (its `raise_exception`) or fails on them.
        """
        if not self.chat_template:
            raise CheckpointError(f"{self.path} has no tokenizer.chat_template; format the prompt yourself.")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        # Same environment options as transformers' chat templates, so whitespace renders alike.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)  # dated system prompts
        special = {name: self._tokens[i] if i is not None else "" for name, i in
                   (("bos_token", self.bos_id), ("eos_token", self.eos_id))}
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **special, **extra)
        except jinja2.TemplateError as e:
            raise TokenError(f"the chat template of {self.path} refused the messages: {e}") from None

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            **extra) -> list[int]:
        """Token ids of `render_chat(messages, ...)` (no BOS added: a template writes its own)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), bos=False)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own `tojson` escapes <, >, & and ' for HTML; prompts want the characters themselves.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_id(reader, key: str, vocab_size: int):
    token_id = gguf_field(reader, key, None)
    if token_id is not None and not 0 <= int(token_id) < vocab_size:
        raise CheckpointError(f"{reader.data.filename}: {key}={token_id} is outside the vocabulary "
                              f"[0, {vocab_size}).")
    return None if token_id is None else int(token_id)


def _byte_level_bpe(path: str, reader, tokens: list[str]):
    """A `tokenizers.Tokenizer` for a GGUF byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = gguf_field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' "
                              f"(byte-level BPE).")
    pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                              f"{sorted(GGUF_PRE_TOKENIZERS)}.")
    merges = gguf_field(reader, "tokenizer.ggml.merges")
    types = gguf_field(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for "
                              f"{len(tokens)} tokens.")
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {bad!r} is not two tokens separated by a space.")

    # A token spelled with characters outside the byte alphabet (a mislabelled one) is re-spelled
    # from its UTF-8 bytes, so the BPE model can still name it.
    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
    vocab = {}
    for i, token in enumerate(spelled):
        vocab.setdefault(token, i)
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as e:  # the tokenizers package raises a bare Exception
        raise CheckpointError(f"{path}: the vocabulary and merges do not form a BPE tokenizer: {e}") from None
    split = GGUF_PRE_TOKENIZERS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens outside the byte alphabet could never come out of the BPE model; they are
    # mislabelled entries, and adding them would grow the vocabulary past the model's.
    control = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
               if kind == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types)
            if kind == _USER_DEFINED and t in vocab]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    return tok
