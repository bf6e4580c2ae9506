"""Needle prompts for chat models: real text with a pass key in it, asked through the model's own
chat template (`GGUFTokenizer.apply_chat_template`), and the turn that adds an instruction after an
interrupted answer.

    ex = chat_needle_example(heldout_text(), tok, 4096, 0.5, np.random.default_rng(0))
    out = engine.generate(ex.prompt, ...);  chat_answer_correct(tok.decode(out.tokens), ex.answer)

The byte-level tasks in `gemini_jax.data.tasks` speak the small byte model's format; these speak
plain English to an instruction-tuned model. Token counts are the model's own (BPE), so the prompt
length is the tokenizer's, within a few tokens of the `length` asked for.
"""

from __future__ import annotations

import re

import numpy as np

from gemini_jax.data.tasks import NeedleExample, check_haystack, random_key, text_window
from gemini_jax.errors import ConfigError

INTRO = "Below is some Python source code. Somewhere in it is a line with a pass key.\n\n"
NEEDLE = "# The pass key is {key}. Remember it: {key} is the pass key."
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
# A text window of this many bytes per token wanted holds enough tokens of Python source (about
# 3.9 bytes per token for SmolLM2's BPE on the standard library).
BYTES_PER_TOKEN = 6


def chat_needle_example(text: np.ndarray, tok, length: int, depth: float, rng: np.random.Generator,
                        *, key: str | None = None) -> NeedleExample:
    """A chat prompt of about `length` tokens: INTRO, haystack text with the NEEDLE line planted at
    `depth` (0 = start, 1 = end; moved to the nearest line start), then QUESTION, rendered by the
    tokenizer's chat template with the assistant's turn open. `answer` is the key's digits."""
    check_haystack(text)
    if not 0.0 <= depth <= 1.0:
        raise ConfigError(f"depth={depth} must be in [0, 1].")
    key = key or random_key(rng)
    needle = NEEDLE.format(key=key)
    frame = tok.apply_chat_template([{"role": "user", "content": INTRO + needle + "\n" + QUESTION}])
    room = length - len(frame) - 2  # the two newlines around the needle may merge into other tokens
    if room < 16:
        raise ConfigError(f"length={length} leaves {room} tokens of haystack after the chat template, the "
                          f"needle and the question ({len(frame)} tokens); ask for at least {len(frame) + 18}.")
    hay = text_window(text, room * BYTES_PER_TOKEN, rng).tobytes().decode("utf-8", errors="ignore")
    ids = tok.encode(hay)[:room]
    before, after = tok.decode(ids[:int(round(depth * len(ids)))]), tok.decode(ids[int(round(depth * len(ids))):])
    cut = before.rfind("\n")  # the needle is a line of its own: start it after a newline
    if cut >= 0:
        before, after = before[:cut + 1], before[cut + 1:] + after
    content = INTRO + before + needle + "\n" + after + QUESTION
    prompt = tok.apply_chat_template([{"role": "user", "content": content}])
    rendered = tok.render_chat([{"role": "user", "content": content}])
    needle_at = len(tok.encode(rendered[:rendered.index(needle)]))
    return NeedleExample(prompt=np.asarray(prompt, np.int32), answer=key, depth=float(depth), needle_at=needle_at)


def chat_answer_correct(answer: str, key: str) -> bool:
    """The key's digits appear in the answer as a number of their own (not inside a longer one)."""
    return re.search(rf"(?<!\d){re.escape(key)}(?!\d)", answer) is not None


def chat_continuation(tok, instruction: str) -> list[int]:
    """Tokens that close an interrupted assistant turn and add a user turn saying `instruction`,
    leaving the assistant's next turn open: what the chat template itself puts between an assistant
    message and the next user message, taken from a rendered conversation."""
    mark = "\x00interrupted\x00"
    full = tok.render_chat([{"role": "user", "content": "?"}, {"role": "assistant", "content": mark},
                            {"role": "user", "content": instruction}])
    return tok.encode(full[full.index(mark) + len(mark):])
