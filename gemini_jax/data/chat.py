"""Needle prompts for chat models: real text with a pass key in it, asked through the model's own
chat template (`GGUFTokenizer.apply_chat_template`), the RULER-style tasks asked the same way, and
the turn that adds an instruction after an interrupted answer.

    ex = chat_needle_example(heldout_text(), tok, 4096, 0.5, np.random.default_rng(0))
    out = engine.generate(ex.prompt, ...);  chat_answer_correct(tok.decode(out.tokens), ex.answer)
    ex = chat_ruler_example(heldout_text(), tok, "niah_multikey", 2048, np.random.default_rng(0))
    exact, recall = chat_ruler_score(tok.decode(out.tokens), ex)

The byte-level tasks in `gemini_jax.data.tasks` speak the small byte model's format; these speak
plain English to an instruction-tuned model. Token counts are the model's own (BPE), so the prompt
length is the tokenizer's, within a few tokens of the `length` asked for.
"""

from __future__ import annotations

import re

import numpy as np

from gemini_jax.data import ruler as suite
from gemini_jax.data.tasks import MARK, NeedleExample, check_haystack, random_key, text_window
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


RULER_INTRO = ("Below is some Python source code with some lines of notes planted in it. Read it, then "
               "answer the question after it.\n\n")
RULER_ANSWER = " Answer with a comma-separated list of the answers only."
# Bytes of a RULER-style prompt per token of SmolLM2's BPE, for the first attempt at a length in
# tokens (the suite's bodies mix source code with lists of words and numbers).
RULER_BYTES_PER_TOKEN = 3.5


def _ruler_chat(tok, body: str):
    """The suite's prompt text (its last line the question, "... They are " + MARK) as a chat prompt:
    the lines as planted, the question asked in plain English. -> (token ids, question)."""
    head, _, ask = body.rpartition("\n# ")
    question = ask.split(" They are ")[0].split(" The pass key")[0].strip()
    content = RULER_INTRO + head.replace(MARK, "").strip("\n") + "\n\n" + question + RULER_ANSWER
    return tok.apply_chat_template([{"role": "user", "content": content}]), question


def chat_ruler_example(text: np.ndarray, tok, task: str, length: int, rng: np.random.Generator,
                       *, kind: str = "digits") -> suite.RulerExample:
    """Trial of RULER-style `task` (`gemini_jax.data.ruler`) for a chat model: the suite's prompt
    built on `text`, its question put in plain English and the whole rendered by the tokenizer's
    chat template, about `length` tokens (within a few percent: the body is built in bytes, sized
    from a first try). Answers and their order are the suite's."""
    check_haystack(text)
    seed = int(rng.integers(1 << 62))
    size = int(length * RULER_BYTES_PER_TOKEN)
    for _ in range(4):  # a first try at the bytes-per-token guess, then again at the rate measured
        ex = suite.example(task, text, size, np.random.default_rng(seed), kind=kind)
        body = bytes(int(b) for b in ex.prompt[1:]).decode("utf-8", errors="ignore")
        ids, _ = _ruler_chat(tok, body)
        if abs(len(ids) - length) <= 0.03 * length:
            break
        size = max(64, int(size * length / len(ids)))
    return suite.RulerExample(task, np.asarray(ids, np.int32), ex.answers, ex.ordered)


def chat_ruler_score(answer: str, ex: suite.RulerExample) -> tuple[bool, float]:
    """(exact, recall) of a chat model's free-form answer, as RULER scores one: recall is the
    fraction of the answers it names as words of their own (string-match-all); exact when it
    names every one, in the asked order where the task asks for one. Like RULER's, the score does
    not charge extra words: an answer listing every planted key would score on the multi-key task."""
    words = re.findall(r"[A-Za-z0-9_-]+", answer)
    hits = [a for a in ex.answers if a in words]
    recall = len(hits) / len(ex.answers)
    first = [words.index(a) for a in hits]
    exact = len(hits) == len(ex.answers) and (not ex.ordered or first == sorted(first))
    return exact, recall
